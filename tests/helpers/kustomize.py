"""Renders deploy/k8s as `kubectl kustomize` does, offline and without the binary, for the
subset of kustomize the manifests use (`resources` and strategic-merge `patches` by file).
A kustomization using anything else is refused, so a new feature cannot be silently ignored;
tests/unit/test_deploy.py cross-checks the result with `kubectl kustomize` where kubectl exists."""

from __future__ import annotations

from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S = DEPLOY / "k8s"
OVERLAYS = ("cpu", "gpu", "colocated")


def _merge(base, patch):
    """Strategic merge as kustomize does it for what the overlays patch: maps merge, lists of
    named items (containers, env, volumes) merge by name, other lists are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            merged[key] = _merge(base[key], value) if key in base else value
        return merged
    named = lambda items: isinstance(items, list) and items and all(isinstance(i, dict) and "name" in i for i in items)  # noqa: E731
    if named(base) and named(patch):
        merged = [dict(i) for i in base]
        index = {item["name"]: n for n, item in enumerate(merged)}
        for item in patch:
            if item["name"] in index:
                merged[index[item["name"]]] = _merge(merged[index[item["name"]]], item)
            else:
                merged.append(item)
        return merged
    return patch


def render(directory: Path) -> list[dict]:
    """The objects of a kustomization that uses `resources` (files and kustomizations) and
    `patches` (strategic merge patches by file) only, as `kubectl kustomize` renders them."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert set(kustomization) <= {"apiVersion", "kind", "resources", "patches"}, "a feature render() lacks"
    objects: list[dict] = []
    for resource in kustomization.get("resources", []):
        path = directory / resource
        objects += render(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in kustomization.get("patches", []):
        assert set(patch) == {"path"}, "render() applies patches given by path only"
        for doc in yaml.safe_load_all((directory / patch["path"]).read_text()):
            (n,) = [
                i
                for i, o in enumerate(objects)
                if (o["kind"], o["metadata"]["name"]) == (doc["kind"], doc["metadata"]["name"])
            ]
            objects[n] = _merge(objects[n], doc)
    return objects


def render_overlay(overlay: str) -> list[dict]:
    return render(K8S / "overlays" / overlay)


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def workloads(objects: list[dict]) -> dict[str, dict]:
    """Deployments and StatefulSets by name (the manifests use no other pod controller)."""
    return {**by_kind(objects, "Deployment"), **by_kind(objects, "StatefulSet")}

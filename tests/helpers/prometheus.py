"""Scraping a /metrics endpoint as Prometheus would, with the stack's token, and reading the
samples back with prometheus-client's own parser."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from rlmesh.common.auth import client_headers

Samples = dict[tuple[str, frozenset], float]


def scrape(url: str, headers: dict[str, str] | None = None) -> Samples:
    """Every sample at `url` (a /metrics address): (sample name, labels) -> value."""
    response = httpx.get(url, headers=client_headers() if headers is None else headers, timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain; version=")
    return parse(response.text)


def parse(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sample `name` whose labels include `labels`, summed over the other labels (0 if none)."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)


def label_values(samples: Samples, name: str, label: str) -> set[str]:
    return {dict(ls)[label] for (n, ls) in samples if n == name and label in dict(ls)}

"""A thin client of the coordinator's REST API for the `rlmesh` command (`rlmesh run`,
`rlmesh runs`, `rlmesh demo`): where the coordinator is and its token, a run's metric
records, and following a run with one progress line per SFT step or rollout."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from rlmesh.common import auth

FINAL = ("completed", "failed", "stopped")
URL_ENV = "RLMESH_COORDINATOR_URL"
POLL_SECONDS = 0.5
DEADLINE_SECONDS = 60.0  # of each call to the coordinator


class CliError(Exception):
    """Something the user can fix: said in one line, no stack trace."""


@dataclass
class Coordinator:
    url: str
    headers: dict[str, str]
    data_dir: Path | None  # the local stack's, when it was found there

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=DEADLINE_SECONDS, headers=self.headers)

    def final_model_path(self, final_model: str) -> str:
        """A run's final model as a path to open: under the local stack's trainer work_dir
        (`rlmesh up` puts it in <data_dir>/trainer), else as the API gives it (relative to the
        trainer's work_dir on its machine)."""
        if not final_model or self.data_dir is None:
            return final_model
        return str(self.data_dir / "trainer" / final_model)


def find_coordinator(data_dir: str | Path, url: str = "", token_file: str = "") -> Coordinator:
    """The coordinator to talk to: `url` (or RLMESH_COORDINATOR_URL), else the one the `rlmesh
    up` with this data directory started. Its token: `token_file`, else RLMESH_TOKEN or
    RLMESH_TOKEN_FILE, else the stack's token file in the data directory."""
    from rlmesh.cli.launcher import running_stack

    data_dir = Path(data_dir).resolve()
    url = url or os.environ.get(URL_ENV, "")
    local = None
    if not url:
        state = running_stack(data_dir)
        if state is None:
            raise CliError(
                f"no coordinator: no `rlmesh up` is running with data directory {data_dir} "
                f"(--data-dir); or name one with --url or {URL_ENV}"
            )
        url, local = state["coordinator_url"], data_dir
    try:
        if token_file:
            token = Path(token_file).read_text().strip()
        else:
            token = auth.stack_token()
            if token is None and (data_dir / "token").exists():
                token = (data_dir / "token").read_text().strip()
    except (OSError, auth.AuthConfigError) as e:
        raise CliError(f"the token cannot be read: {e}") from None
    return Coordinator(url.rstrip("/"), auth.credential_headers(token), local)


def answer(r: httpx.Response) -> dict | list:
    """The JSON body of a 2xx answer; else a CliError with the coordinator's reason (a 422's
    every field and message)."""
    if r.is_success:
        return r.json()
    try:
        detail = r.json().get("detail", r.text)
    except ValueError:
        detail = r.text
    if isinstance(detail, list):  # 422: one line per field
        detail = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', [])[1:])}: {e.get('msg', '')}" for e in detail)
    raise CliError(f"{r.request.method} {r.request.url.path}: {r.status_code} {detail}")


def run_metrics(http: httpx.Client, run_id: str, page: int = 1000) -> list[dict]:
    """Every metric record of a run, oldest first, a page at a time (GET /runs/{id} embeds
    only the newest few)."""
    records: list[dict] = []
    while True:
        got = answer(http.get(f"/runs/{run_id}/metrics", params={"since": len(records), "limit": page}))
        records += got["records"]
        if not got["records"] or len(records) >= got["total"]:
            return records


def eval_rewards(metrics: dict) -> dict[str, float | None]:
    """Eval dataset name -> its mean reward, from a metric record or an eval_before/after;
    None when every sample of it failed (its mean of 0 would read as a reward)."""
    return {
        name: None if metrics.get(f"eval/{name}/failed_ratio", 0) >= 1 else v
        for k, v in metrics.items()
        if k.startswith("eval/") and k.endswith("/reward_mean") and k.count("/") == 2 and v is not None
        for name in [k[len("eval/") : -len("/reward_mean")]]
    }


def reward_text(reward: float | None) -> str:
    """An eval_rewards value as shown."""
    return "n/a (every sample failed)" if reward is None else f"{reward:.2f}"


def _eval_label(name: str) -> str:
    return "held-out eval" if name == "held_out" else f"eval {name}"


def train_reward(metrics: dict) -> float | None:
    """The rollouts' mean reward; a run fed by environments has no rollouts: its trained batch's."""
    return metrics.get("rollout/reward_mean", metrics.get("train/reward_mean"))


def progress(run: dict, start: float) -> str:
    """One line of where the run stands."""
    m = run.get("latest_metrics") or {}
    phase = run["phase"]
    elapsed = f"{time.monotonic() - start:5.0f}s"
    if run["status"] == "queued":
        return f"{elapsed}  queued, #{run.get('queue_position')} in line"
    if phase == "sft" and "sft_step" not in m:
        return f"{elapsed}  warm start (SFT)"
    if phase == "sft":
        return f"{elapsed}  warm start (SFT) step {m.get('sft_step', 0)}  loss {m.get('sft/loss', float('nan')):.3f}"
    if phase == "rl" and (reward := train_reward(m)) is not None:
        line = (
            f"{elapsed}  RL rollout {run['rollout_id']:>3}/{run['num_rollouts']}  "
            f"train reward {reward:.2f}  weights v{run['weight_version']}"
        )
        return line + "".join(f"  {_eval_label(name)} {reward_text(v)}" for name, v in eval_rewards(m).items())
    return f"{elapsed}  {phase}" + (f" ({run['status']})" if run["status"] in FINAL else "")


def follow(
    http: httpx.Client,
    run_id: str,
    start: float,
    echo: Callable[[str], None] = print,
    poll_seconds: float = POLL_SECONDS,
    check: Callable[[dict], dict | None] | None = None,
) -> dict:
    """Poll the run until it ends, saying a progress line whenever it moves (each SFT step,
    each rollout, a change of place in the queue); returns its final record. `check(run)`,
    asked at every poll, may end the wait early with the record it returns."""
    last = None
    while True:
        run = answer(http.get(f"/runs/{run_id}", params={"metrics_last": 1}))
        m = run.get("latest_metrics") or {}
        where = (
            run["status"] == "queued",
            run.get("queue_position"),
            run["phase"],
            run["rollout_id"],
            m.get("sft_step"),
        )
        if where != last:
            echo(progress(run, start))
            last = where
        if run["status"] in FINAL:
            return run
        if check is not None and (ended := check(run)) is not None:
            return ended
        time.sleep(poll_seconds)

"""A run fed from outside: an environment written against the real atroposlib (BaseEnv in
`serve` mode, its SGLang client on rlmesh's engine) is pointed at the run's trajectory API
by its rollout_server_url alone, and the run trains on what it posts; malformed posts are
refused with a 422 that names what is wrong, counted, and the run goes on. In `process` mode
the same kind of environment writes JSONL, generating on rlmesh's engine."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import threading

import httpx
import pytest
from transformers import AutoTokenizer

from rlmesh.common.auth import client_headers, required_token
from rlmesh.common.grpc_server import sync_channel
from rlmesh.coordinator.app import API_TASK
from rlmesh.coordinator.app import start as start_coordinator
from rlmesh.coordinator.config import Settings as CoordinatorSettings
from rlmesh.coordinator.trajectory import RunView, ScoredData, scored_group
from rlmesh.v1 import buffer_pb2, buffer_pb2_grpc
from tests.helpers.runs import assert_time_split, run_config
from tests.helpers.stack import start_local_stack, wait_for_run

pytest.importorskip("atroposlib")

from tests.helpers.atropos_env import ReverseEnv

ROLLOUTS = 3


def environments_config(tmp_path, tiny_model_dir) -> dict:
    config = run_config(tmp_path, tiny_model_dir, num_rollouts=ROLLOUTS)
    config.update(source="environments", mode="fully_async", sft_warmup={"steps": 0}, pause_mode="in_place")
    config["rollout"] = {"rollout_batch_size": 2, "n_samples_per_prompt": 4}
    config["environments"] = {"max_token_length": 64}
    return config


def run_env_in_thread(env: ReverseEnv) -> threading.Thread:
    """The environment's own loop (env_manager: register, then post until the run's steps
    are covered), as `python env.py serve` runs it."""

    def main() -> None:
        try:
            asyncio.run(asyncio.wait_for(env.env_manager(), timeout=120))
        except TimeoutError:
            pass

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    return thread


async def _stop_coordinator(server) -> None:
    """As SIGTERM would: its run loop is cancelled, the run stays active in Redis."""
    serving = next(t for t in asyncio.all_tasks() if t.get_name() == API_TASK)
    server.should_exit = True
    await serving


def restart_coordinator(stack, redis_url, start_in_loop, loop_thread) -> httpx.Client:
    loop_thread.run(_stop_coordinator(stack.servers["coordinator"]), timeout=60)
    a = stack.addresses
    settings = CoordinatorSettings(
        port=0,
        redis_url=redis_url,
        buffer_address=a["buffer"],
        rollout_address=a["rollout"],
        reward_address=a["reward"],
        trainer_address=a["trainer"],
    )
    _, port = start_in_loop(lambda: start_coordinator(settings))
    return httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30, headers=client_headers())


@pytest.mark.slow
def test_an_atropos_environment_trains_a_run(
    redis_url, start_in_loop, loop_thread, tmp_path, tiny_model_dir, engine_url
):
    stack = start_local_stack(start_in_loop, redis_url, engine_url, tmp_path)
    api, buffer = stack.api, buffer_pb2_grpc.BufferStub(sync_channel(stack.addresses["buffer"]))
    r = api.post("/runs", json=environments_config(tmp_path, tiny_model_dir))
    assert r.status_code == 201, r.text
    run_id = r.json()["id"]
    run = wait_for_run(api, run_id, lambda run: run["phase"] == "rl" or run["status"] == "failed", timeout=60)
    assert run["status"] != "failed", run["error"]
    base = str(api.base_url).rstrip("/")
    url = base + run["trajectory_api"]
    assert run["trajectory_api"].startswith("/atropos/")

    # No token header (an Atropos client sends none): the path's capability is the credential.
    plain = httpx.Client(timeout=30)
    assert plain.get(f"{base}/atropos/not-the-capability/info").status_code == 404
    info = plain.get(f"{url}/info").json()
    assert info == {"batch_size": 8, "max_token_len": 64}

    bad_masks = {"tokens": [[5, 6, 7]] * 4, "masks": [[-100, 6]] * 4, "scores": [0.0, 1.0, 0.0, 1.0]}
    r = plain.post(f"{url}/scored_data", json=bad_masks)
    assert r.status_code == 422 and "masks[0] has 2 entries" in r.json()["detail"], r.text
    nan_score = {"tokens": [[5, 6, 7]] * 4, "masks": [[-100, 6, 7]] * 4, "scores": [0.0, math.nan, 0.0, 1.0]}
    r = plain.post(f"{url}/scored_data", content=json.dumps(nan_score), headers={"content-type": "application/json"})
    assert r.status_code == 422 and "scores[1] is nan" in r.json()["detail"], r.text
    out_of_vocab = {"tokens": [[5, 6, 10**6]] * 4, "masks": [[-100, 6, 7]] * 4, "scores": [0.0, 1.0, 0.0, 1.0]}
    r = plain.post(f"{url}/scored_data_list", json=[out_of_vocab])
    assert r.status_code == 422 and "outside [0," in r.json()["detail"], r.text
    advantages = {**bad_masks, "masks": [[-100, 6, 7]] * 4, "advantages": [[1.0, 1.0, 1.0]] * 4}
    r = plain.post(f"{url}/scored_data", json=advantages)
    assert r.status_code == 422 and "advantages" in r.json()["detail"], r.text

    # Registrations live in Redis with the run: a restarted coordinator knows them.
    held = {"max_token_length": 64, "desired_name": "by hand", "weight": 2.0, "group_size": 4}
    assert plain.post(f"{url}/register-env", json=held).json()["env_id"] == 0
    api = restart_coordinator(stack, redis_url, start_in_loop, loop_thread)
    base = str(api.base_url).rstrip("/")
    url = base + run["trajectory_api"]
    status = plain.request("GET", f"{url}/status-env", json={"env_id": 0})
    assert status.status_code == 200 and status.json()["env_weight"] == 1.0, status.text
    assert plain.post(f"{url}/disconnect-env", json={"env_id": 0}).json() == {"status": "success"}

    # The environment, unmodified but for its rollout_server_url. Its minimum share of each
    # batch is made by the buffer's lease (here, as the only environment, always met).
    env = ReverseEnv.make(
        url, engine_url, str(tiny_model_dir), required_token(), group_size=4, steps=ROLLOUTS, min_batch_allocation=0.5
    )
    thread = run_env_in_thread(env)
    run = wait_for_run(api, run_id, timeout=150)
    assert run["status"] == "completed", run["error"]
    thread.join(timeout=30)

    assert run["environment_groups_refused"] == 4
    assert "advantages" in run["environment_refusal"]
    assert run["environment_groups_received"] >= 2 * ROLLOUTS
    rl = [m for m in api.get(f"/runs/{run_id}/metrics").json()["records"] if "iteration/seconds" in m]
    assert [m["rollout_id"] for m in rl] == list(range(1, ROLLOUTS + 1))
    assert all(m["train/samples"] == 8 for m in rl)  # full batches of the environment's groups
    assert_time_split(rl)
    s = buffer.GetStats(buffer_pb2.GetStatsRequest(run_id=run_id))
    assert s.acknowledged_groups == 2 * ROLLOUTS and s.dead_letter_groups == 0
    samples = api.get(f"/runs/{run_id}/samples").json()
    assert samples["groups"][0]["dataset"] == "reverse_0"
    assert samples["groups"][0]["samples"][0]["messages"][0]["content"].startswith("rev ")


def generation_tokens(engine_url: str) -> float:
    """The engine's sglang:generation_tokens_total (Prometheus text)."""
    text = httpx.get(f"{engine_url}/metrics", timeout=10).text
    return sum(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("sglang:generation_tokens_total")
    )


@pytest.mark.slow
def test_an_atropos_environments_process_mode_generates_on_rlmesh_engine(tmp_path, tiny_model_dir, engine_url):
    """`python env.py process` (no trainer, no trajectory API): the environment generates on
    rlmesh's engine through its SGLang /generate and writes scored groups to JSONL, groups
    the trajectory API would take as they are."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"rev {a}{b}=", "label": f"{b}{a}"}) + "\n" for a, b in ["ab", "cd"]))
    out = tmp_path / "groups.jsonl"
    model = str(tiny_model_dir)
    generated_before = generation_tokens(engine_url)
    flags = {
        "env.dataset_path": rows,
        "env.tokenizer_name": model,
        "env.data_path_to_save_groups": out,
        "env.total_steps": 2,
        "env.group_size": 4,
        "env.use_wandb": False,
        "openai.server_type": "sglang",
        "openai.base_url": f"{engine_url}/v1",
        "openai.model_name": model,
    }
    done = subprocess.run(
        [sys.executable, "-m", "rlmesh.cli.reverse_env", "process", *(f"--{k}={v}" for k, v in flags.items())],
        env={**os.environ, "OPENAI_API_KEY": required_token()},  # (the engine's key)
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-3000:]

    groups = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(groups) == 2
    tokenizer = AutoTokenizer.from_pretrained(model)
    run = RunView(vocab_size=len(tokenizer), max_token_length=64, max_group_size=8, weight_version=0)
    responses = 0
    for group in groups:
        assert len(group["tokens"]) == 4 and len(group["scores"]) == 4
        g = scored_group(ScoredData(**group), run, None)  # (raises naming what is wrong)
        assert tokenizer.decode(g.samples[0].prompt_tokens) in ("rev ab=", "rev cd=")
        assert all(lp <= 0 for s in g.samples for lp in s.rollout_log_probs)
        responses += sum(s.response_length for s in g.samples)
    assert generation_tokens(engine_url) - generated_before >= responses

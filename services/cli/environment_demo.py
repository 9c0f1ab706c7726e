"""`rlmesh demo --task environment`: the demo's task (reverse three letters) trained through
an Atropos environment instead of rlmesh's own rollouts.

The run is the regular demo's (its datasets, its SFT warm start on the training prompts, its
held-out eval, its optimizer) with `source: environments`: after the warm start the
coordinator generates nothing for training. The environment (rlmesh/cli/reverse_env.py, an
ordinary atroposlib BaseEnv) runs as a process of its own, as its author would run it:
`python -m rlmesh.cli.reverse_env serve`, pointed at the run's trajectory API by its
rollout_server_url alone; it reads the same training prompts, generates n samples per prompt
on the stack's engine through SGLang's /generate, scores exact match and posts the groups.

The warm start is kept, as in the regular demo: the evaluation before RL is taken after it,
so "before -> after" is what RL through the environment added."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rlmesh.cli.demo import demo_config
from rlmesh.common.auth import required_token
from rlmesh.common.run_config import RunConfig

# What the regular demo's run needs changed to take its RL samples from environments.
ENVIRONMENT_RUN = {
    "source": "environments",
    # Environments generate continuously, on whatever weights the engine holds when they ask;
    # in_place: their requests are not aborted while weights are pushed.
    "mode": "fully_async",
    "pause_mode": "in_place",
    "environments": {"max_token_length": 64},
}


def atroposlib_missing() -> str:
    """Why the environment demo cannot run here ("" when it can)."""
    try:
        import atroposlib  # noqa: F401
    except ImportError:
        return "the environment demo needs atroposlib: pip install 'rlmesh[atropos]'"
    return ""


def environment_demo_config(model_path: str, train: Path, held_out: Path, sft_steps: int, rollouts: int) -> RunConfig:
    config = demo_config(model_path, train, held_out, sft_steps, rollouts).model_dump(mode="json")
    config.update(ENVIRONMENT_RUN, name="demo: reverse three letters, through an Atropos environment")
    return RunConfig.model_validate(config)


def start_environment(
    trajectory_url: str, engine_url: str, model_path: str, train: Path, cfg: RunConfig, log_file: Path
) -> subprocess.Popen:
    """`python -m rlmesh.cli.reverse_env serve`, its output to log_file. Its group size is
    the run's n_samples_per_prompt; the engine's key (the stack's token) goes by environment."""
    command = [
        sys.executable,
        "-m",
        "rlmesh.cli.reverse_env",
        "serve",
        "--env.rollout_server_url",
        trajectory_url,
        "--env.tokenizer_name",
        model_path,
        "--env.dataset_path",
        str(train),
        "--env.group_size",
        str(cfg.rollout.n_samples_per_prompt),
        "--env.max_new_tokens",
        str(cfg.rollout.sampling.max_new_tokens),
        "--openai.server_type",
        "sglang",
        "--openai.base_url",
        f"{engine_url}/v1",
        "--openai.model_name",
        model_path,
    ]
    env = {**os.environ, "OPENAI_API_KEY": required_token(), "TOKENIZERS_PARALLELISM": "false"}
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)


def stop_environment(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

"""`rlmesh demo --task agent`: the tiny model learns to use a tool for a task it cannot
solve alone.

The task: "code abc=" asks for the secret code of a three-letter string, two digits
that only the `code` tool knows (a hash: nothing to learn from the strings themselves, and
the held-out strings are never seen in training). The model must call the tool in the
Hermes/Qwen form, `<tool_call>{"name": "code", "arguments": {"s": "abc"}}</tool_call>`, read
the tool turn the agent loop appends ("T: 47"), and answer with the code. A short SFT warm
start on whole episodes (the record's metadata `sft_response`) of its own strings teaches
the format, and leaves copying unseen strings into the call unreliable; GRPO with an
exact-match reward on the final answer, through the built-in agent loop on other strings,
makes it reliable. Evaluation runs the same loop, greedy, on the held-out strings.

Two digits, not one: a guessed digit earned reward one time in ten whatever the call was,
and GRPO reinforced those lucky episodes, broken calls included, as much as good ones
(measured: RL lowered the held-out reward); a guessed pair hits one time in a hundred."""

from __future__ import annotations

import itertools
import json
import zlib
from pathlib import Path

from rlmesh.common.run_config import RunConfig

LETTERS = "abcdefgh"
TOOL_NAME = "code"
# How `rlmesh up` and the demo's own stack register the tool (rollout settings `tools`).
TOOL_IMPORT_PATH = "rlmesh.cli.agent_demo:code"


def code(s: str) -> str:
    """The secret code of a string: two digits."""
    return f"{zlib.crc32(('rlmesh:' + s).encode()) % 100:02d}"


def call_text(s: str) -> str:
    return "<tool_call>" + json.dumps({"name": TOOL_NAME, "arguments": {"s": s}}) + "</tool_call>"


def episode_text(s: str) -> str:
    """A whole episode as the agent loop builds it for the tiny model's chat template: the
    call, the tool turn, the answer (the trainer sees these same characters)."""
    return f"{call_text(s)}\nT: {code(s)}\nA: {code(s)}"


def write_task(out_dir: Path) -> tuple[Path, Path, Path]:
    """Three disjoint sets of strings: the warm start's episodes, RL's prompts, and the
    held-out eval's. RL never sees a string the warm start showed: on strings it had learned by
    heart, every sample of a group would earn the same reward, and GRPO would learn nothing."""
    out_dir.mkdir(parents=True, exist_ok=True)
    sets: tuple[list, list, list] = ([], [], [])
    for chars in itertools.product(LETTERS, repeat=3):
        s = "".join(chars)
        row = {"prompt": f"code {s}=", "label": code(s), "meta": {"sft_response": episode_text(s)}}
        bucket = zlib.crc32(s.encode()) % 5  # 1/5 warm start, 3/5 RL, 1/5 held out
        sets[0 if bucket == 1 else 2 if bucket == 0 else 1].append(row)
    paths = out_dir / "agent-warm-start.jsonl", out_dir / "agent-train.jsonl", out_dir / "agent-eval.jsonl"
    for path, rows in zip(paths, sets):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


def agent_demo_config(
    model_path: str, warm_start: Path, train: Path, held_out: Path, sft_steps: int, rollouts: int
) -> RunConfig:
    # The turn ends with its call: the tool answers, not the model's imagination.
    sampling = {"max_new_tokens": 80, "stop": ["</tool_call>"], "no_stop_trim": True}
    return RunConfig.model_validate(
        {
            "name": "demo: call a tool for a secret code",
            "model_path": model_path,
            "datasets": [
                {"name": "warm_start", "path": str(warm_start), "metadata_key": "meta"},
                {"name": "train", "path": str(train), "metadata_key": "meta", "seed": 0},
                {"name": "held_out", "path": str(held_out), "metadata_key": "meta", "eval": True},
            ],
            "num_rollouts": rollouts,
            "rollout": {
                "rollout_batch_size": 8,
                "n_samples_per_prompt": 16,
                "sampling": {**sampling, "temperature": 0.8},
                # The SFT warm start templates prompts as the agent loop does.
                "apply_chat_template": True,
                "generate": {
                    "name": "agent",
                    "options": {
                        "tools": [TOOL_NAME],
                        "tool_parser": "hermes",
                        "max_turns": 3,
                        "max_response_tokens": 160,
                    },
                },
            },
            "reward": {"components": {"exact_match": 1.0}},
            "algorithm": {"advantage_estimator": "grpo"},
            # RL steps far smaller than the warm start's: after it the policy is sharp, and at
            # SFT's rate one RL step moved whole episodes' log-probs by tens of nats.
            "sft_optimizer": {"lr": 3e-3, "grad_clip": 1.0},
            "optimizer": {"lr": 5e-4, "grad_clip": 1.0},
            "micro_batch_size": 64,
            "sft_warmup": {"steps": sft_steps, "batch_groups": 32, "dataset": "warm_start"},
            "eval": {"interval": 5, "limit": 48, "sampling": {**sampling, "temperature": 0.0}},
            "seed": 0,
        }
    )

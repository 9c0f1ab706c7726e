"""An Atropos environment for the demo's task (reverse three letters), written against the
real atroposlib as any Atropos environment is: a `BaseEnv` that owns its data (a JSONL file
of {"prompt", "label"} rows), generates n samples per prompt through an SGLang server's
native /generate (exact token ids and log-probs), and scores exact match. Nothing in it
knows of rlmesh: `rlmesh demo --task environment` runs it as its author would,

    python -m rlmesh.cli.reverse_env serve --env.rollout_server_url <the run's trajectory API> \\
        --env.tokenizer_name <model> --env.dataset_path train.jsonl \\
        --openai.base_url http://<engine>/v1 --openai.model_name <model>

and `process` instead of `serve` writes the scored groups to JSONL (no trainer at all).
The engine's API key is read from OPENAI_API_KEY (flags show in `ps`)."""

from __future__ import annotations

import json
import os
import random

from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig
from pydantic import Field

IGNORED = -100  # Atropos's mask of a token not trained on


class ReverseEnvConfig(BaseEnvConfig):
    dataset_path: str = Field("", description="JSONL of {'prompt': ..., 'label': ...} rows to train on.")
    max_new_tokens: int = Field(8, description="Most tokens of an answer.")
    temperature: float = Field(1.0, description="Sampling temperature.")


class ReverseEnv(BaseEnv):
    name = "reverse"
    env_config_cls = ReverseEnvConfig

    @classmethod
    def config_init(cls) -> tuple[ReverseEnvConfig, list[APIServerConfig]]:
        config = ReverseEnvConfig(
            group_size=8,
            use_wandb=False,
            wandb_name=cls.name,
            max_token_length=64,
            max_num_workers=16,
            # At most two training batches queued ahead of the trainer (rlmesh's default
            # staleness bound in fully_async is 2 weight versions).
            max_batches_offpolicy=2,
            steps_per_eval=0,
            # (ensure_scores_are_not_same stays on, Atropos's default: a group whose samples all
            # score alike teaches nothing and is not posted, so every trained group has signal)
            total_steps=-1,  # the trainer's num_steps (register-env)
            batch_size=-1,  # the trainer's (/info)
            include_messages=True,
        )
        server = APIServerConfig(
            server_type="sglang",
            base_url="http://127.0.0.1:30000/v1",
            model_name="",
            api_key=os.environ.get("OPENAI_API_KEY", ""),
            health_check=False,
            timeout=120,
        )
        return config, [server]

    async def setup(self) -> None:
        with open(self.config.dataset_path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        self.items = [(r["prompt"], r["label"]) for r in rows]
        self.rng = random.Random(0)
        self.order: list[tuple[str, str]] = []

    async def get_next_item(self) -> tuple[str, str]:
        """The rows in a shuffled order, reshuffled at each pass."""
        if not self.order:
            self.order = list(self.items)
            self.rng.shuffle(self.order)
        return self.order.pop()

    async def collect_trajectories(self, item: tuple[str, str]):
        prompt, label = item
        prompt_tokens, outputs, logprobs, _ = await self.server.tokens_and_logprobs_completion(
            prompt=prompt,
            n=self.config.group_size,
            max_tokens=self.config.max_new_tokens,
            temperature=self.config.temperature,
        )
        group = {"tokens": [], "masks": [], "scores": [], "inference_logprobs": [], "messages": []}
        for out, lps in zip(outputs, logprobs):
            text = self.tokenizer.decode(out, skip_special_tokens=True)
            group["tokens"].append(prompt_tokens + out)
            group["masks"].append([IGNORED] * len(prompt_tokens) + out)
            group["scores"].append(1.0 if text.strip() == label else 0.0)
            # (Atropos's convention: one per token, 1.0 over the prompt)
            group["inference_logprobs"].append([1.0] * len(prompt_tokens) + lps)
            group["messages"].append([{"role": "user", "content": prompt}, {"role": "assistant", "content": text}])
        return group, []

    async def evaluate(self, *args, **kwargs) -> None:
        """The trainer evaluates the run on its held-out dataset."""


if __name__ == "__main__":
    ReverseEnv.cli()

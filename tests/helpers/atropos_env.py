"""A small environment written against the real atroposlib (its BaseEnv, its SGLang server
client), as an Atropos environment author writes one: the demo's task (reverse two
letters), generated on rlmesh's engine through its SGLang /generate, scored by exact match.
Nothing in it knows of rlmesh: it is pointed at the trajectory API by rollout_server_url."""

from __future__ import annotations

import asyncio
import random

from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig

LETTERS = "abcd"


def items() -> list[tuple[str, str]]:
    return [(f"rev {a}{b}=", f"{b}{a}") for a in LETTERS for b in LETTERS]


class ReverseEnv(BaseEnv):
    name = "reverse"

    @classmethod
    def make(
        cls,
        rollout_server_url: str,
        engine_url: str,
        tokenizer: str,
        api_key: str,
        group_size: int = 4,
        steps: int = 4,
        min_batch_allocation: float | None = None,
    ):
        """api_key: the engine's (the stack's token), sent as its bearer token."""
        config = BaseEnvConfig(
            tokenizer_name=tokenizer,
            group_size=group_size,
            use_wandb=False,
            rollout_server_url=rollout_server_url,
            total_steps=steps,
            wandb_name="reverse",
            max_token_length=64,
            max_num_workers=4,
            max_batches_offpolicy=2,
            steps_per_eval=0,
            ensure_scores_are_not_same=False,
            min_batch_allocation=min_batch_allocation,
        )
        server = APIServerConfig(
            server_type="sglang",
            base_url=f"{engine_url}/v1",
            model_name=tokenizer,
            api_key=api_key,
            health_check=False,
            timeout=60,
        )
        return cls(config, [server], testing=False)

    async def setup(self) -> None:
        self.items = items()
        self.rng = random.Random(0)

    async def get_next_item(self):
        return self.rng.choice(self.items)

    async def collect_trajectories(self, item):
        prompt, label = item
        results = await asyncio.gather(
            *(
                self.server.tokens_and_logprobs_completion(prompt=prompt, max_tokens=4, temperature=1.0)
                for _ in range(self.config.group_size)
            )
        )
        group = {"tokens": [], "masks": [], "scores": [], "inference_logprobs": [], "messages": []}
        for prompt_tokens, outputs, logprobs, _ in results:
            out, lps = outputs[0], logprobs[0]
            text = self.tokenizer.decode(out, skip_special_tokens=True)
            group["tokens"].append(prompt_tokens + out)
            group["masks"].append([-100] * len(prompt_tokens) + out)
            group["scores"].append(1.0 if text.strip() == label else 0.0)
            group["inference_logprobs"].append([1.0] * len(prompt_tokens) + lps)
            group["messages"].append([{"role": "user", "content": prompt}, {"role": "assistant", "content": text}])
        return group, []

    async def evaluate(self, *args, **kwargs):
        return None

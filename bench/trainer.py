"""Trainer throughput: tokens/s of an RL training step through the service against a
plain torch loop on the same model and the same batch, measured in the same run.

- service: a TrainStep call over gRPC to the trainer service, which leases the batch
  from the buffer service (gRPC, on a real Redis), converts it, runs the torch backend's
  step (old log-probs, GRPO advantages, PPO-clip loss, backward, AdamW) and acknowledges
  the batch. Putting the batch into the buffer is the rollout side's work and is not
  timed.
- baseline: the same step written as a plain torch loop, no service and no rlmesh code:
  pad the batch, a no-grad forward for the old log-probs (what every PPO-style trainer
  computes before its update), group-normalized advantages, then per micro-batch a
  forward, the clipped surrogate, backward, and one AdamW step with gradient clipping.
  Same model (loaded from the same directory), same micro-batch size, same hyper-
  parameters, same threads.

The model is a Llama built locally from a config (no download), larger than the test
model so that the step is dominated by compute as in real use. Each round runs one step of
each path, in alternating order. The headline figures are each path's best step (the one
least disturbed by other work on a shared machine); the median of the per-round ratios
(pairing cancels the drift of the machine) is printed beside it. Everything runs in this process:
Redis as its own process, the buffer and trainer servers on an event loop thread.

    python -m bench.trainer [--rounds 10] [--groups 4] [--samples 4] [--prompt-len 32] [--response-len 96]

It ends with its summary as a markdown table (the form docs/benchmarks.md keeps), then
one line: a JSON object with the results.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import AutoModelForCausalLM

from bench.report import print_table
from rlmesh.buffer.config import Settings as BufferSettings
from rlmesh.buffer.server import start as start_buffer
from rlmesh.cli.embedded_redis import start_redis
from rlmesh.cli.tiny_model import build_tiny_model
from rlmesh.common.auth import ensure_stack_token
from rlmesh.common.grpc_server import start_service, sync_channel
from rlmesh.common.run_config import TrainerRunConfig
from rlmesh.common.sample import Sample, SampleGroup, Status, group_from_proto, group_to_proto
from rlmesh.trainer.config import Settings as TrainerSettings
from rlmesh.trainer.server import build as build_trainer
from rlmesh.trainer.trainer import Trainer
from rlmesh.v1 import buffer_pb2, trainer_pb2
from rlmesh.v1.buffer_pb2_grpc import BufferStub
from rlmesh.v1.trainer_pb2_grpc import TrainerStub

RUN = "bench-trainer"
LR, EPS_CLIP, GRAD_CLIP, MICRO_BATCH = 1e-5, 0.2, 1.0, 8


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def run(self, coro, timeout: float = 600):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


# ---------------------------------------------------------------- the batch


def make_batch(
    groups: int, samples: int, prompt_len: int, response_len: int, vocab: int, seed: int
) -> list[SampleGroup]:
    """Random token sequences (ids 3.. below the vocabulary), 0/1 rewards, engine log-probs."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        group = SampleGroup(f"g{g}", g, [])
        for i in range(samples):
            response = [rng.randrange(3, vocab) for _ in range(response_len)]
            group.samples.append(
                Sample(
                    index=i,
                    tokens=prompt + response,
                    response_length=response_len,
                    reward=float(rng.random() < 0.5),
                    status=Status.COMPLETED,
                    loss_mask=[1] * response_len,
                    rollout_log_probs=[-rng.uniform(0.5, 5.0) for _ in range(response_len)],
                )
            )
        out.append(group)
    return out


def fill_buffer(buffer: BufferStub, template: list[SampleGroup]) -> None:
    """The template's samples into prompt groups the buffer handed out, as a rollout worker would."""
    handed = buffer.GetPrompts(buffer_pb2.GetPromptsRequest(run_id=RUN, num_groups=len(template))).groups
    done = []
    for msg, filled in zip(handed, template):
        group = group_from_proto(msg)
        for s, f in zip(group.samples, filled.samples):
            s.tokens, s.response_length, s.reward, s.status = f.tokens, f.response_length, f.reward, f.status
            s.loss_mask, s.rollout_log_probs = f.loss_mask, f.rollout_log_probs
        done.append(group_to_proto(group))
    buffer.PutGroups(buffer_pb2.PutGroupsRequest(run_id=RUN, groups=done))


# ---------------------------------------------------------------- the plain torch loop


class PlainLoop:
    """The baseline: one GRPO/PPO-clip step in plain torch."""

    def __init__(self, model_dir: Path, pad_id: int) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.pad_id = pad_id
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=0.0)  # the run config default

    def log_probs(self, ids, attention, starts, width):
        logits = self.model(input_ids=ids, attention_mask=attention, use_cache=False).logits
        index = (starts.unsqueeze(1) + torch.arange(width)).clamp(max=ids.shape[1] - 2)
        picked = logits.gather(1, index.unsqueeze(-1).expand(-1, -1, logits.shape[-1])).float()
        targets = ids.gather(1, index + 1)
        return torch.log_softmax(picked, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)

    def step(self, groups: list[SampleGroup]) -> None:
        samples = [s for g in groups for s in g.samples]
        ids = pad_sequence([torch.tensor(s.tokens) for s in samples], batch_first=True, padding_value=self.pad_id)
        lengths = torch.tensor([len(s.tokens) for s in samples])
        attention = (torch.arange(ids.shape[1]) < lengths.unsqueeze(1)).long()
        responses = torch.tensor([s.response_length for s in samples])
        width = int(responses.max())
        starts = lengths - responses - 1  # the logits at p - 1 predict token p
        mask = (torch.arange(width) < responses.unsqueeze(1)).float()
        micro = [range(i, min(i + MICRO_BATCH, len(samples))) for i in range(0, len(samples), MICRO_BATCH)]
        with torch.no_grad():
            old = torch.cat([self.log_probs(ids[m], attention[m], starts[m], width) for m in micro])
        rewards = torch.tensor([s.reward for s in samples]).view(len(groups), -1)
        centered = rewards - rewards.mean(1, keepdim=True)
        advantages = (centered / (rewards.std(1, keepdim=True) + 1e-6)).flatten().unsqueeze(1) * mask
        for m in micro:
            logp = self.log_probs(ids[m], attention[m], starts[m], width)
            ratio = torch.exp(logp - old[m])
            surrogate = torch.maximum(-advantages[m] * ratio, -advantages[m] * ratio.clamp(1 - EPS_CLIP, 1 + EPS_CLIP))
            per_seq = (surrogate * mask[m]).sum(1) / mask[m].sum(1)
            (per_seq.sum() / len(samples)).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), GRAD_CLIP)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


# ---------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="training steps of each path, paired")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4, help="samples per group")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--response-len", type=int, default=96)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    opts = parser.parse_args()
    ensure_stack_token()  # the servers here and the clients share it

    work = Path(tempfile.mkdtemp(prefix="bench-trainer-"))
    model_dir = build_tiny_model(
        work / "model",
        hidden_size=opts.hidden_size,
        num_layers=opts.layers,
        max_positions=opts.prompt_len + opts.response_len + 8,
    )
    redis_server = start_redis(work / "redis")
    loop = LoopThread()
    try:
        buffer_server, buffer_port = loop.run(
            start_buffer(BufferSettings(redis_url=redis_server.url, port=0, data_roots=[work]))
        )
        trainer = Trainer(
            TrainerSettings(work_dir=work / "trainer", port=0, buffer_address=f"127.0.0.1:{buffer_port}", device="cpu")
        )
        trainer_server, trainer_port = loop.run(
            start_service(functools.partial(build_trainer, trainer=trainer), trainer.settings)
        )
        buffer = BufferStub(sync_channel(f"127.0.0.1:{buffer_port}"))
        stub = TrainerStub(sync_channel(f"127.0.0.1:{trainer_port}"))

        dataset = work / "prompts.jsonl"
        total_groups = opts.groups * (opts.rounds + 1)
        dataset.write_text("".join(json.dumps({"prompt": f"q{i}", "label": "0"}) + "\n" for i in range(total_groups)))
        buffer.CreateRun(
            buffer_pb2.CreateRunRequest(
                run_id=RUN,
                n_samples_per_prompt=opts.samples,
                datasets=[buffer_pb2.DatasetSpec(name="train", path=str(dataset))],
            )
        )
        config = TrainerRunConfig(
            model_path=str(model_dir),
            micro_batch_size=MICRO_BATCH,
            device="cpu",
            optimizer={"lr": LR, "grad_clip": GRAD_CLIP},
            algorithm={"eps_clip": EPS_CLIP},
        )
        stub.InitRun(trainer_pb2.InitRunRequest(run_id=RUN, config_json=config.model_dump_json()))
        vocab = trainer._run.backend.vocab_size
        batch = make_batch(opts.groups, opts.samples, opts.prompt_len, opts.response_len, vocab, seed=0)
        tokens = sum(len(s.tokens) for g in batch for s in g.samples)
        baseline = PlainLoop(model_dir, trainer._run.backend.pad_token_id)

        def service_step() -> float:
            fill_buffer(buffer, batch)
            start = time.perf_counter()
            stub.TrainStep(trainer_pb2.TrainStepRequest(run_id=RUN, num_groups=opts.groups, wait_seconds=30))
            return time.perf_counter() - start

        def baseline_step() -> float:
            start = time.perf_counter()
            baseline.step(batch)
            return time.perf_counter() - start

        service_step(), baseline_step()  # warm-up: first-call allocations, lazy imports
        service_times, baseline_times, ratios = [], [], []
        for r in range(opts.rounds):
            if r % 2:  # alternate which path goes first, so neither always meets a warmer or busier machine
                b, s = baseline_step(), service_step()
            else:
                s, b = service_step(), baseline_step()
            service_times.append(s)
            baseline_times.append(b)
            ratios.append(s / b)
            print(
                f"round {r}: service {tokens / s:,.0f} tokens/s, plain torch loop {tokens / b:,.0f} tokens/s "
                f"(overhead {100 * (s / b - 1):+.1f}%)",
                flush=True,
            )

        # Best step of each path: the least disturbed by other work on a shared machine.
        best_service, best_plain = tokens / min(service_times), tokens / min(baseline_times)
        best_overhead = 100 * (min(service_times) / min(baseline_times) - 1)
        median_overhead = 100 * (statistics.median(ratios) - 1)
        print(
            f"batch: {opts.groups} groups x {opts.samples} samples x {opts.prompt_len}+{opts.response_len} tokens "
            f"= {tokens} tokens; model: Llama hidden {opts.hidden_size}, {opts.layers} layers; "
            f"{torch.get_num_threads()} torch threads; {opts.rounds} steps of each path"
        )
        print(
            f"service (TrainStep over gRPC, lease from the buffer): best {best_service:,.0f} tokens/s, "
            f"median {tokens / statistics.median(service_times):,.0f}"
        )
        print(
            f"plain torch loop, same model and batch:               best {best_plain:,.0f} tokens/s, "
            f"median {tokens / statistics.median(baseline_times):,.0f}"
        )
        print(
            f"service overhead: {best_overhead:+.1f}% best step against best step, {median_overhead:+.1f}% median of "
            "the paired steps' ratios (target at most 10%)"
        )
        print_table(
            [
                {
                    "path": "service (TrainStep over gRPC, lease from the buffer)",
                    "best tokens/s": f"{best_service:,.0f}",
                    "median tokens/s": f"{tokens / statistics.median(service_times):,.0f}",
                },
                {
                    "path": "plain torch loop, same model and batch (baseline)",
                    "best tokens/s": f"{best_plain:,.0f}",
                    "median tokens/s": f"{tokens / statistics.median(baseline_times):,.0f}",
                },
                {
                    "path": "service overhead (target at most 10%)",
                    "best tokens/s": f"{best_overhead:+.1f}%",
                    "median tokens/s": f"{median_overhead:+.1f}% (paired)",
                },
            ],
            f"python -m bench.trainer: {tokens} tokens/step, Llama hidden {opts.hidden_size}, {opts.layers} layers, "
            f"{torch.get_num_threads()} torch threads, {opts.rounds} steps of each path",
        )
        print(
            json.dumps(
                {
                    "benchmark": "trainer",
                    "tokens_per_step": tokens,
                    "steps": opts.rounds,
                    "service_tokens_per_s": round(best_service, 1),
                    "plain_torch_tokens_per_s": round(best_plain, 1),
                    "service_overhead_pct": round(best_overhead, 2),
                    "service_overhead_median_pct": round(median_overhead, 2),
                    "within_10pct": best_overhead <= 10.0,
                }
            )
        )
        loop.run(trainer.close())
        loop.run(trainer_server.stop(None))
        loop.run(buffer_server.stop(None))
    finally:
        redis_server.stop()


if __name__ == "__main__":
    main()

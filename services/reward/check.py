"""Conformance kit: `rlmesh reward check URL` runs a suite of checks against a remote
reward service (the contracts are in services/reward/remote.py) and prints a
pass/fail table; the exit status is 0 when every check passed, 1 otherwise, 2 when
the URL itself is not acceptable.

Checks: answers (one sample), shapes (a varied batch: one finite score or object of
named scores per sample, the same names for every sample), ordering (a batch scores
each sample as it is scored alone, in either order; assumes deterministic scores:
--skip ordering for a sampling judge), groups (whole groups in one call), errors (a
sample the service cannot judge does not fail the batch; a malformed request gets a
clear refusal, not a crash or a hang), latency (sequential single calls and one full
batch, all within the timeout).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx

from rlmesh.common import errors
from rlmesh.common.auth import credential_headers
from rlmesh.common.reward_service import RemoteServiceSpec, remote_service
from rlmesh.common.sample import Sample, SampleGroup, Status
from rlmesh.reward.registration import RemoteDefaults, resolve_registration
from rlmesh.reward.remote import (
    CallFailed,
    RemoteScore,
    SampleResult,
    Transport,
    Unit,
    grpc_target,
    make_transport,
)
from rlmesh.reward.url_policy import ANY_ADDRESS
from rlmesh.v1 import reward_pb2, reward_pb2_grpc

CHECKS = ("answers", "shapes", "ordering", "groups", "errors", "latency")


@dataclass
class CheckResult:
    name: str
    passed: bool
    detail: str


class CheckFailed(Exception):
    pass


def _sample(index: int, response: str, label: str, group_index: int | None = None, **kw) -> Sample:
    return Sample(
        index=index,
        group_index=index if group_index is None else group_index,
        prompt=kw.pop("prompt", "What is 6 * 7?"),
        tokens=[1, 2, 3, 4, 5],
        response=response,
        response_length=2,
        label=label,
        loss_mask=[1, 1],
        rollout_log_probs=[-0.5, -0.25],
        status=Status.COMPLETED,
        weight_versions=[1],
        **kw,
    )


def varied_samples() -> list[Sample]:
    """Right, wrong, empty, long, unicode and chat samples: what a run sends."""
    return [
        _sample(0, "6 * 7 = \\boxed{42}", "42"),
        _sample(1, "I think it is 41.", "42"),
        _sample(2, "", "42"),
        _sample(3, "Let me think. " * 200 + "The answer is 42.", "42"),
        _sample(4, "Die Antwort ist zweiundvierzig — 四十二 🙂", "42", metadata={"language": "de"}),
        _sample(
            5,
            "42",
            "42",
            messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 6 * 7?"}],
        ),
        _sample(6, "forty-two", "42", metadata={"dataset": "arith", "difficulty": 1}),
        _sample(7, "The answer is 24.", "42"),
    ]


def _describe(result: SampleResult) -> str:
    if isinstance(result, str):
        return result
    if result.total is not None and not result.named:
        return f"{result.total:g}"
    return ", ".join(f"{k}={v:g}" for k, v in result.named.items()) + (
        f" (total {result.total:g})" if result.total is not None else ""
    )


def _same(a: SampleResult, b: SampleResult) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return isinstance(a, str) and isinstance(b, str)

    def close(x, y):
        return (x is None and y is None) or (x is not None and y is not None and math.isclose(x, y, abs_tol=1e-6))

    return (
        close(a.total, b.total)
        and a.named.keys() == b.named.keys()
        and all(close(v, b.named[k]) for k, v in a.named.items())
    )


class Suite:
    def __init__(self, config: RemoteServiceSpec, batch_size: int, latency_calls: int) -> None:
        self.config = config
        self.batch_size = batch_size
        self.latency_calls = latency_calls
        self.transport: Transport | None = None  # made in run(): a gRPC channel needs the running loop

    async def call(self, units: list[Unit]) -> list[SampleResult]:
        assert self.transport is not None
        try:
            return await asyncio.wait_for(
                self.transport.call(units, self.config.timeout_seconds), self.config.timeout_seconds
            )
        except CallFailed as e:
            raise CheckFailed(e.reason) from None
        except asyncio.TimeoutError:
            raise CheckFailed(f"no answer within {self.config.timeout_seconds:g} s") from None

    async def call_samples(self, samples: list[Sample]) -> list[SampleResult]:
        return await self.call([Unit([s]) for s in samples])

    # ------------------------------------------------------------ the checks

    async def answers(self) -> str:
        started = time.perf_counter()
        [result] = await self.call_samples([_sample(0, "6 * 7 = \\boxed{42}", "42")])
        if isinstance(result, str):
            raise CheckFailed(f"a simple, well-formed sample was not scored: {result}")
        return f"scored a simple sample: {_describe(result)} in {1000 * (time.perf_counter() - started):.0f} ms"

    async def shapes(self) -> str:
        samples = varied_samples()
        results = await self.call_samples(samples)
        bad = [(s.index, r) for s, r in zip(samples, results) if isinstance(r, str) and "returned null" not in r]
        if bad:
            raise CheckFailed("; ".join(f"sample {i}: {r}" for i, r in bad))
        scored = [r for r in results if isinstance(r, RemoteScore)]
        if not scored:
            raise CheckFailed("every sample came back null: nothing was scored")
        names = {tuple(sorted(r.named)) for r in scored}
        if len(names) > 1:
            raise CheckFailed(
                f"the named scores differ between samples ({' / '.join(', '.join(n) for n in sorted(names))}); "
                "a run names them as '<service>/<name>', so every sample needs the same names"
            )
        kinds = {"a number" if r.total is not None and not r.named else "named scores" for r in scored}
        nulls = len(results) - len(scored)
        return (
            f"{len(samples)} samples -> {len(results)} results ({', '.join(sorted(kinds))}"
            + (f"; {nulls} null" if nulls else "")
            + ")"
        )

    async def ordering(self) -> str:
        samples = varied_samples()
        alone = [(await self.call_samples([s]))[0] for s in samples]
        forward = await self.call_samples(samples)
        backward = list(reversed(await self.call_samples(list(reversed(samples)))))
        for name, batch in (("in a batch", forward), ("in a reversed batch", backward)):
            for s, single, batched in zip(samples, alone, batch):
                if not _same(single, batched):
                    raise CheckFailed(
                        f"sample {s.index} scored {_describe(single)} alone but {_describe(batched)} {name}: scores must "
                        "come back in the order of the request (--skip ordering if the scores are random)"
                    )
        return f"{len(samples)} samples: same scores alone, in a batch and in a reversed batch"

    async def groups(self) -> str:
        units = []
        for g in range(2):
            members = [_sample(3 * g + i, f"answer {40 + i}", "42", group_index=g) for i in range(3)]
            units.append(Unit(members, SampleGroup(f"check-group-{g}", g, members)))
        results = await self.call(units)
        bad = [r for r in results if isinstance(r, str) and "returned null" not in r]
        if bad:
            raise CheckFailed("; ".join(bad))
        how = "ScoreGroups" if self.config.protocol == "grpc" else "one request"
        return f"2 groups x 3 samples in {how}: {len(results)} results"

    async def errors(self) -> str:
        unlabeled = _sample(1, "some answer", "")
        try:
            results = await self.call_samples([_sample(0, "\\boxed{42}", "42"), unlabeled])
        except CheckFailed as e:
            raise CheckFailed(
                f"a batch holding a sample without a label failed as a whole ({e}); score the others and answer "
                "null (HTTP) or mark it FAILED (gRPC) for a sample you cannot judge"
            ) from None
        detail = f"a sample without a label -> {_describe(results[1])}"
        if self.config.protocol == "grpc":
            return detail + "; " + await self._grpc_malformed()
        return detail + "; " + await self._http_malformed()

    async def _http_malformed(self) -> str:
        async with httpx.AsyncClient(timeout=self.config.timeout_seconds) as client:
            for body, what in (
                (b"this is not json", "a body that is not JSON"),
                (b'{"samples": "nope"}', "a body without a samples list"),
            ):
                try:
                    reply = await client.post(self.config.url, content=body, headers=self._headers())
                except httpx.HTTPError as e:
                    raise CheckFailed(f"{what}: no answer ({type(e).__name__}: {e})") from None
                if not 400 <= reply.status_code < 500:
                    raise CheckFailed(f"{what} got HTTP {reply.status_code}; expected a 4xx refusal")
        return "malformed requests refused with 4xx"

    def _headers(self) -> dict[str, str]:
        return {"content-type": "application/json", **credential_headers(self.config.bearer_token)}

    async def _grpc_malformed(self) -> str:
        async with grpc.aio.insecure_channel(grpc_target(self.config.url)) as channel:
            stub = reward_pb2_grpc.RewardStub(channel)
            try:
                await stub.ScoreGroups(
                    reward_pb2.ScoreGroupsRequest(),
                    timeout=self.config.timeout_seconds,
                    metadata=list(credential_headers(self.config.bearer_token).items()),
                )
            except grpc.aio.AioRpcError as e:
                if e.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise CheckFailed(f"an empty ScoreGroups request got {e.code().name}: {e.details()}") from None
                return f"an empty request refused with {e.code().name}"
        return "an empty request answered OK"

    async def latency(self) -> str:
        durations = []
        for i in range(self.latency_calls):
            started = time.perf_counter()
            await self.call_samples([_sample(i, f"\\boxed{{{i}}}", str(i))])
            durations.append(time.perf_counter() - started)
        batch = [_sample(i, f"\\boxed{{{i}}}", str(i)) for i in range(self.batch_size)]
        started = time.perf_counter()
        results = await self.call_samples(batch)
        batch_seconds = time.perf_counter() - started
        bad = [r for r in results if isinstance(r, str) and "returned null" not in r]
        if bad:
            raise CheckFailed(f"a batch of {self.batch_size}: {bad[0]}")
        quantiles = statistics.quantiles(durations, n=20) if len(durations) > 1 else durations * 19
        return (
            f"single sample p50 {1000 * statistics.median(durations):.0f} ms, p95 {1000 * quantiles[18]:.0f} ms; "
            f"a batch of {self.batch_size}: {1000 * batch_seconds:.0f} ms ({self.batch_size / batch_seconds:.0f} samples/s)"
        )

    async def run(self, skip: set[str]) -> list[CheckResult]:
        results = []
        # The operator's own machine and service: loopback and private addresses are fine here.
        self.transport = make_transport(self.config, 16 * 1024 * 1024, ANY_ADDRESS)
        try:
            for name in CHECKS:
                if name in skip:
                    continue
                check: Callable[[], Awaitable[str]] = getattr(self, name)
                try:
                    results.append(CheckResult(name, True, await check()))
                except CheckFailed as e:
                    results.append(CheckResult(name, False, str(e)))
                if name == "answers" and not results[-1].passed:
                    break  # nothing else can work
        finally:
            await self.transport.close()
        return results


def print_table(url: str, protocol: str, results: list[CheckResult]) -> None:
    print(f"reward service {url} ({protocol})")
    width = max(len(r.name) for r in results) if results else 5
    print(f"{'check':<{width}}  result  detail")
    for r in results:
        print(f"{r.name:<{width}}  {'PASS' if r.passed else 'FAIL':<6}  {r.detail}")
    failed = sum(not r.passed for r in results)
    print(f"{len(results) - failed} passed, {failed} failed")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="rlmesh reward check", description="Check that a remote reward service follows rlmesh's contract."
    )
    parser.add_argument("url", help="the URL you would register: http(s)://host:port/path or grpc://host:port")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds allowed per call [default: 30]")
    parser.add_argument("--batch-size", type=int, default=32, help="samples in the latency check's batch [default: 32]")
    parser.add_argument("--latency-calls", type=int, default=10, help="sequential single-sample calls [default: 10]")
    parser.add_argument("--skip", action="append", default=[], choices=CHECKS, help="leave out a check (repeatable)")
    parser.add_argument(
        "--token-file",
        type=Path,
        help="a file holding the service's bearer token, sent as "
        "'Authorization: Bearer <token>' (a file, so the token stays out of `ps`)",
    )
    args = parser.parse_args(argv)
    try:
        token = args.token_file.read_text().strip() if args.token_file else ""
        config = resolve_registration(
            remote_service(
                dict(
                    name="check",
                    url=args.url,
                    timeout_seconds=args.timeout,
                    max_batch_size=args.batch_size,
                    bearer_token=token,
                )
            ),
            RemoteDefaults(),
            reserved=set(),
        )
    except OSError as e:
        print(f"rlmesh reward check: cannot read --token-file {args.token_file}: {e.strerror}")
        return 2
    except errors.RlmeshError as e:
        print(f"rlmesh reward check: {e}")
        return 2
    config = config.model_copy(update={"max_concurrency": 1})
    results = asyncio.run(Suite(config, max(1, args.batch_size), max(1, args.latency_calls)).run(set(args.skip)))
    print_table(config.url, config.protocol, results)
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))

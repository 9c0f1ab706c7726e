"""The engine pool: every inference engine of the rollout service, through the one client of
SGLang's native HTTP API (`rlmesh.rollout.sglang_client`). Production engines are SGLang
servers (optionally behind the SGLang router); the reference engine serves the same API on
CPU, and the client cannot tell them apart."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable

import httpx

from rlmesh.common.auth import credential_headers
from rlmesh.common.errors import FailedPrecondition, InvalidArgument, Unavailable
from rlmesh.common.run_config import PAUSE_MODES
from rlmesh.common.weight_group import GPU_KEY, WEIGHT_DELTA_FORMAT
from rlmesh.rollout.metrics import RolloutMetrics
from rlmesh.rollout.sglang_client import (
    KEEPALIVE_EXPIRY_SECONDS,
    EngineBehind,
    EngineError,
    EnginesBehind,
    EngineState,
    GenerateHTTP,
    SGLangClient,
    TensorMeta,
    WeightDelta,
    version_number,
    weight_group_world_size,
)

# (what callers import from here, where it lives)
__all__ = [
    "PAUSE_MODES",
    "EngineBehind",
    "EngineError",
    "EnginePool",
    "EngineState",
    "EnginesBehind",
    "SGLangClient",
    "TensorMeta",
    "WeightDelta",
    "weight_group_world_size",
]

log = logging.getLogger(__name__)


class EnginePool:
    """All engines of the rollout service: generation spread over them (or sent to the
    router), control and weight calls sent to every engine that answers.

    Membership: an engine whose call broke (refused, reset, timed out, 5xx) leaves the
    generation rotation at once, so its samples are retried on the others and new ones
    are not sent to it. It rejoins once it answers again (states(), which ListEngines
    and so every weight push calls, probes every engine) AND holds the newest weights: a
    restarted engine, back on its base weights, first receives the trainer's next push
    (its weight group counts only the engines that answer). With no engine in the
    rotation, generation tries them all (the rollout waits and retries as for one engine)."""

    def __init__(
        self,
        engine_urls: list[str],
        router_url: str,
        timeout: float,
        weight_timeout: float,
        api_key: str = "",
        generate_timeout: float | None = None,
        seconds_per_token: float = 0.0,
        metrics: RolloutMetrics | None = None,
        dynamic: bool = False,
    ) -> None:
        """`dynamic`: discovery changes the engines while the service runs (set_members), so
        the pool may start with none and a weight group counted before a change is retried."""

        self.http = httpx.AsyncClient(
            limits=httpx.Limits(
                max_connections=256, max_keepalive_connections=64, keepalive_expiry=KEEPALIVE_EXPIRY_SECONDS
            ),
            headers=credential_headers(api_key) or None,
        )
        self.generate_http = GenerateHTTP(credential_headers(api_key))
        self.timeout, self.weight_timeout = timeout, weight_timeout
        self._generate_timeouts = (generate_timeout, seconds_per_token)
        self.metrics = metrics
        self.router = self._client(router_url) if router_url else None
        if self.router:
            self.router.batch_generate = False  # (it balances the engines request by request)
        self.engines = [self._client(u) for u in engine_urls]
        self._next = itertools.count()
        self._down: set[str] = set()  # urls whose last call broke or that did not answer a probe
        self._versions: dict[str, int] = {}  # url -> the weight version it last reported or received
        self._current: int | None = None  # the version of the last weight update (None: none yet)
        self._groups: dict[str, list[SGLangClient]] = {}  # weight group name -> the engines in it
        self._leaving: list[SGLangClient] = []  # dropped by discovery, requests still in flight there
        self.dynamic = dynamic or bool(router_url)
        if not self.engines and not self.dynamic:
            raise ValueError("the rollout service needs engine_urls or a router_url")

    # ---- membership ---------------------------------------------------------------------

    def mark_down(self, engine: SGLangClient) -> None:
        """An engine's call broke: out of the generation rotation until it answers again."""
        if engine is not self.router and not engine.retired and engine.url not in self._down:
            log.warning("engine %s left the pool (its samples are retried on the others)", engine.url)
            self._down.add(engine.url)

    def _set_up(self, engine: SGLangClient, version: str | int) -> None:
        if engine.retired:
            return  # (no longer a member: nothing to remember about it)
        if engine.url in self._down:
            log.info("engine %s answers again", engine.url)
        self._down.discard(engine.url)
        self._versions[engine.url] = engine.held_version = version_number(str(version))

    def in_rotation(self) -> list[SGLangClient]:
        """Engines that answer and hold the weights of the last update (any that answer
        when none holds them: say, every engine restarted before the trainer pushed again)."""
        up = [e for e in self.engines if e.url not in self._down]
        current = [e for e in up if self._versions.get(e.url, 0) == self._current]
        return current if self._current is not None and current else up

    async def refresh_workers(self) -> None:
        """Behind a router, the engines are the router's workers."""
        if self.router:
            self.set_members(await self.router.workers())

    def set_members(self, urls: list[str]) -> None:
        """The engines discovery found now. One that is new joins behind: it takes no
        generation until it holds the run's weights (the trainer's next push, which opens a
        new weight group with it, sends them whole); one that is gone takes no new request,
        and what it has in flight finishes there or, when it breaks, is retried on another."""
        urls = list(dict.fromkeys(u.rstrip("/") for u in urls))
        known = {e.url: e for e in self.engines}
        for url in [u for u in urls if u not in known]:
            self._down.discard(url)
            self._versions.pop(url, None)  # (an address seen before may be another engine now)
            log.info(
                "engine %s joined (%d engines): it generates once it holds the run's weights (version %s)",
                url,
                len(urls),
                self._current if self._current is not None else "of the next push",
            )
        kept = set(urls)
        for engine in [e for e in self.engines if e.url not in kept]:
            engine.retired = True
            self._leaving.append(engine)
            self._down.discard(engine.url)
            self._versions.pop(engine.url, None)
            log.info(
                "engine %s left (%d engines): no new requests; %d in flight finish there or are retried elsewhere",
                engine.url,
                len(urls),
                engine.in_flight,
            )
        self.engines = [known.get(u) or self._client(u) for u in urls]
        self._leaving = [e for e in self._leaving if e.in_flight and e.url not in kept]

    def leaving(self) -> list[EngineState]:
        """Engines discovery dropped that still have requests in flight."""
        self._leaving = [e for e in self._leaving if e.in_flight]
        return [
            EngineState(url=e.url, state="leaving", healthy=e.url not in self._down, **_counts(e))
            for e in self._leaving
        ]

    def _client(self, url: str) -> SGLangClient:
        client = SGLangClient(
            url,
            self.http,
            self.timeout,
            self.weight_timeout,
            *self._generate_timeouts,
            generate_http=self.generate_http,
        )
        client.metrics = self.metrics
        return client

    def for_generation(self) -> SGLangClient:
        if self.router:
            return self.router
        if not self.engines:
            raise EngineError("no engines: discovery has found none yet")  # (the caller waits and retries)
        engines = self.in_rotation() or self.engines  # none left: try them all (the caller retries)
        return engines[next(self._next) % len(engines)]

    async def engine_for(self, weight_version: int) -> SGLangClient:
        """The next engine in turn that holds at least `weight_version` (0: any, as
        for_generation). None known to: every engine is asked (a restarted one answers
        with its base weights); EngineError while none answers (the caller waits and
        retries), EnginesBehind when those that answer all hold older weights."""
        if not weight_version or self.router or not self.engines:
            return self.for_generation()  # (behind a router, the answer's version is checked)

        def holding() -> list[SGLangClient]:
            return [
                e for e in self.engines if e.url not in self._down and self._versions.get(e.url, 0) >= weight_version
            ]

        engines = holding()
        if not engines:
            states = await self.states()
            engines = holding()
            if not engines:
                answering = [s for s in states if s.healthy]
                if not answering:
                    raise EngineError(f"no engine answers: {', '.join(s.url for s in states)}")
                behind = ", ".join(f"{s.url} holds version {s.weight_version}" for s in answering)
                raise EnginesBehind(
                    f"the engines hold weights older than version {weight_version} ({behind}): "
                    "push the current weights to them first"
                )
        return engines[next(self._next) % len(engines)]

    def check_answer(self, engine: SGLangClient, weight_version: int) -> None:
        """EngineBehind when `engine` answered with weights older than `weight_version`."""
        answered = engine.answered_version
        if weight_version and answered is not None and answered < weight_version:
            if engine is self.router:  # (it cannot be told to send the sample elsewhere)
                raise EnginesBehind(
                    f"the router {engine.url} answered with weight version {answered}, older than "
                    f"{weight_version}: push the current weights to its engines first"
                )
            if not engine.retired:
                self._versions[engine.url] = engine.held_version = answered
            raise EngineBehind(
                f"engine {engine.url} answered with weight version {answered}, older than {weight_version} "
                "(it restarted?): generating the sample again"
            )

    async def states(self) -> list[EngineState]:
        return [s for _, s in await self.probe()]

    async def probe(self) -> list[tuple[SGLangClient, EngineState]]:
        """Every engine with its state now (pairs: discovery may change the members meanwhile)."""
        await self.refresh_workers()

        async def one(e: SGLangClient) -> EngineState:
            try:
                info, server = await asyncio.gather(e.model_info(), e.server_info())
            except Unavailable:
                self.mark_down(e)
                return EngineState(url=e.url, healthy=False, state="down", **_counts(e))
            e.weight_delta_format = str(server.get("rlmesh_weight_delta") or "")
            self._set_up(e, info.get("weight_version", "default"))
            return EngineState(
                url=e.url,
                tp_size=int(server.get("tp_size", 1)),
                weight_version=str(info.get("weight_version", "default")),
                model_path=info.get("model_path", ""),
                tokenizer_path=info.get("tokenizer_path", "") or info.get("model_path", ""),
                weight_delta_format=e.weight_delta_format,
                weight_file_format=str(server.get("rlmesh_weight_file") or ""),
                gpu_uuid=str(server.get(GPU_KEY) or ""),
                **_counts(e),
            )

        engines = list(self.engines)
        states = list(await asyncio.gather(*(one(e) for e in engines)))
        serving = {e.url for e in self.in_rotation()}
        for s in states:
            if s.healthy:
                s.state = "serving" if s.url in serving else "behind"
        if self.metrics is not None:
            self.metrics.engines_by_state([s.state for s in states + self.leaving()])
        return list(zip(engines, states))

    async def abort_all(self) -> None:
        await asyncio.gather(*(e.abort(abort_all=True) for e in self.engines), return_exceptions=True)

    # ---- control and weight updates: every engine, at once ------------------------------

    async def each_answering(self, call: Callable[[SGLangClient], Awaitable[object]]) -> None:
        """A control call to every engine (one thought down may still be finishing requests);
        one that does not answer leaves the pool (a dead engine generates nothing, so it
        needs no pausing). Fails only when no engine answered."""
        engines = list(self.engines)
        if not engines:
            return  # (none found yet: nothing generates)
        results = await asyncio.gather(*(call(e) for e in engines), return_exceptions=True)
        for engine, result in zip(engines, results):
            if isinstance(result, EngineError):
                self.mark_down(engine)
            elif isinstance(result, BaseException):
                raise result
        if all(isinstance(r, BaseException) for r in results):
            raise results[0]

    async def pause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise InvalidArgument(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        for engine in self.engines:
            engine.paused = True
        await self.each_answering(lambda e: e.pause(mode))

    async def resume(self) -> None:
        try:
            await self.each_answering(lambda e: e.resume())
        finally:
            for engine in self.engines:
                engine.paused = False

    async def init_weight_group(
        self, master_address: str, master_port: int, world_size: int, group_name: str, backend: str
    ) -> int:
        """Every engine that answers joins the trainer's weight-update group (the trainer is
        rank 0; an engine's TP ranks follow the ranks of the engines before it); one that is
        down is left out and joins the next group once it answers. Returns how many joined."""
        if world_size < 2:
            raise InvalidArgument("world_size must count the trainer (rank 0) and every engine rank")
        probed = await self.probe()
        everyone = [s for _, s in probed]
        members = [(e, s) for e, s in probed if s.healthy]
        if not members:
            raise Unavailable(f"engines not answering: {', '.join(s.url for s in everyone)}")
        states = [s for _, s in members]
        expected = weight_group_world_size(states)
        if world_size != expected:
            message = f"world_size {world_size} does not match the engines that answer: 1 + TP sizes = {expected}"
            if world_size > weight_group_world_size(everyone) and not self.dynamic:
                raise InvalidArgument(message)
            # Engines left or came back since the caller counted them (ListEngines): it asks again.
            raise Unavailable(message)
        self._groups[group_name] = [e for e, _ in members]
        offsets = itertools.accumulate((s.tp_size for s in states[:-1]), initial=1)
        await asyncio.gather(
            *(
                e.weight_call(
                    "/init_weights_update_group",
                    {
                        "master_address": master_address,
                        "master_port": master_port,
                        "rank_offset": rank_offset,
                        "world_size": world_size,
                        "group_name": group_name,
                        "backend": backend,
                    },
                )
                for e, rank_offset in zip(self._groups[group_name], offsets)
            )
        )
        return len(states)

    def _members(self, group_name: str) -> list[SGLangClient]:
        # A group this pool did not open (a rollout service restarted under the trainer):
        # every engine, as before; a failure makes the trainer open a new group.
        return self._groups.get(group_name, self.engines)

    async def update_weights(
        self,
        tensors: list[TensorMeta],
        group_name: str,
        weight_version: str,
        flush_cache: bool,
        load_format: str,
        delta: WeightDelta | None = None,
    ) -> None:
        """Every engine receives one bucket of the trainer's broadcast (in `tensors` order),
        whole or, with `delta`, only its changed elements."""
        if not tensors:
            raise InvalidArgument("a weight update needs at least one tensor")
        members = self._members(group_name)
        if delta is not None and not all(e.weight_delta_format == WEIGHT_DELTA_FORMAT for e in members):
            # Checked before any engine is called, so no rank waits on a broadcast that never comes.
            raise FailedPrecondition(f"not every engine accepts {WEIGHT_DELTA_FORMAT} delta updates; push in full")
        body = {
            "names": [t.name for t in tensors],
            "dtypes": [t.dtype for t in tensors],
            "shapes": [list(t.shape) for t in tensors],
            "group_name": group_name,
            "flush_cache": flush_cache,
            "abort_all_requests": False,
            "weight_version": weight_version or None,  # None: unchanged (earlier buckets)
            "load_format": load_format or None,
        }
        if delta is not None:
            body["rlmesh_delta"] = {
                "count": delta.count,
                "index_dtype": delta.index_dtype,
                "base_version": delta.base_version,
            }

        last = flush_cache or bool(weight_version)  # the push's last bucket (it carries the version)

        async def one(engine: SGLangClient) -> None:
            try:
                # One session per push, not per bucket: two round trips less per bucket.
                await engine.begin_weight_update()
                try:
                    await engine.weight_call("/update_weights_from_distributed", body)
                except BaseException:
                    await engine.end_weight_update()
                    raise
                if last:
                    await engine.end_weight_update()
            except EngineError:
                self.mark_down(engine)  # the trainer opens a new group without it
                raise

        await asyncio.gather(*(one(e) for e in members))
        if weight_version:  # the last bucket: these engines hold the new weights
            self.mark_updated(members, weight_version)

    def mark_updated(self, engines: list[SGLangClient], weight_version: str) -> None:
        self._current = version_number(weight_version)
        for e in engines:
            self._set_up(e, weight_version)

    async def destroy_weight_group(self, group_name: str) -> None:
        members = self._groups.pop(group_name, self.engines)
        # A member that died since has no group left to destroy.
        alive = [e for e in members if e.url not in self._down] or members
        results = await asyncio.gather(
            *(e.weight_call("/destroy_weights_update_group", {"group_name": group_name}) for e in alive),
            return_exceptions=True,
        )
        current = {e.url for e in self.engines}
        for engine, result in zip(alive, results):
            # (one that discovery dropped since may be gone with its group)
            if isinstance(result, BaseException) and (engine.url in current or not isinstance(result, EngineError)):
                raise result

    async def update_weights_from_disk(self, model_path: str, weight_version: str) -> None:
        if not model_path:
            raise InvalidArgument("model_path is required")
        members = [e for e, s in await self.probe() if s.healthy]
        if not members:
            raise Unavailable("engines not answering: weights not loaded")
        await asyncio.gather(
            *(
                e.weight_call(
                    "/update_weights_from_disk",
                    {"model_path": model_path, "weight_version": weight_version, "flush_cache": True},
                )
                for e in members
            )
        )
        self.mark_updated(members, weight_version)

    async def close(self) -> None:
        await asyncio.gather(self.http.aclose(), self.generate_http.close())


def _counts(e: SGLangClient) -> dict:
    return {
        "generate_requests": e.generate_requests,
        "in_flight": e.in_flight,
        "first_answer_version": e.first_answer_version,
    }

"""The one client for inference engines: SGLang's native HTTP API. Production engines
are SGLang servers (optionally behind the SGLang router); the reference engine serves
the same API on CPU, and this client cannot tell them apart."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

from rlmesh.common.auth import credential_headers
from rlmesh.common.errors import Aborted, FailedPrecondition, InvalidArgument, Unavailable
from rlmesh.common.weight_group import WEIGHT_DELTA_FORMAT
from rlmesh.rollout.metrics import RolloutMetrics

log = logging.getLogger(__name__)


@dataclass
class EngineState:
    url: str
    tp_size: int = 1
    weight_version: str = "default"
    healthy: bool = True
    model_path: str = ""
    tokenizer_path: str = ""
    weight_delta_format: str = ""  # the rlmesh delta-update format it accepts; "" = none (SGLang)
    weight_file_format: str = ""  # the rlmesh weight-file format it maps (colocated); "" = none (SGLang)


class EngineError(Unavailable):
    pass


class EngineBehind(EngineError):
    """An engine answered with weights older than the request needs (it restarted on its
    base weights since it was last asked): the sample is generated again elsewhere."""


class EnginesBehind(Aborted):
    """Every engine that answers holds weights older than the request needs: the caller
    pushes the current weights first, then asks again (an engine never generates on
    weights it should not have, and the rollout does not wait for a push that only its
    caller can start)."""


@dataclass(frozen=True)
class WeightDelta:
    """A delta bucket's announcement (the rlmesh extension, docs/engine-api.md)."""

    count: int
    index_dtype: str
    base_version: str


@dataclass(frozen=True)
class TensorMeta:
    """One tensor of a weight-update bucket, by its Hugging Face name."""

    name: str
    dtype: str
    shape: tuple[int, ...]


PAUSE_MODES = ("abort", "retract", "in_place")


def weight_group_world_size(states: list[EngineState]) -> int:
    """The trainer (rank 0) plus every engine's tensor-parallel ranks."""
    return 1 + sum(s.tp_size for s in states)


GENERATE_ATTEMPTS = 3
# Idle pooled connections are dropped before servers (uvicorn: 5 s by default) close them.
KEEPALIVE_EXPIRY_SECONDS = 2.0
# /generate calls are spread over this many connection pools. Each call holds a
# connection until its sample is done, and httpcore scans every connection of a pool for
# every request it places: with hundreds of samples in flight one pool spent most of the
# rollout service's CPU there (the rollout, not the engine, bounded generation).
GENERATE_CONNECTION_POOLS = 16


class SGLangClient:
    """Talks to one engine (or to a router, for /generate)."""

    def __init__(
        self,
        url: str,
        http: httpx.AsyncClient,
        timeout: float,
        weight_timeout: float,
        generate_timeout: float | None = None,
        seconds_per_token: float = 0.0,
        generate_http: list[httpx.AsyncClient] | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.http = http
        self.generate_http = generate_http or [http]  # /generate's pools, taken in turn
        self._next_pool = itertools.count()
        self.timeout = timeout
        self.weight_timeout = weight_timeout
        self.generate_timeout = generate_timeout or timeout
        self.seconds_per_token = seconds_per_token
        self._has_weight_session: bool | None = None  # SGLang >= 0.5.21 wants begin/end
        self._older_info_names = False  # SGLang < 0.5.10: /get_model_info, /get_server_info only
        self._in_session = False  # begun and not yet ended
        self.weight_delta_format = ""  # as its /server_info said when last asked (states())
        self._live_rids: dict[str, str] = {}  # rid a caller knows -> rid of the retry in flight
        self.metrics: RolloutMetrics | None = None  # counts tokens and requests (set by the pool)
        self.answered_version: int | None = None  # the weight version of its last /generate answer

    async def _post(self, path: str, body: dict, timeout: float | None = None) -> httpx.Response:
        try:
            return await self.http.post(self.url + path, json=body, timeout=timeout or self.timeout)
        except httpx.HTTPError as e:
            raise EngineError(f"engine {self.url}: POST {path} failed: {type(e).__name__}: {e}") from None

    async def _get_json(self, path: str, older_name: str = "") -> dict:
        """With `older_name`: the route's name before SGLang 0.5.10, which newer SGLang
        deprecates; asked (from then on) when an engine answers 404 to the new one."""
        if older_name and self._older_info_names:
            path = older_name
        try:
            r = await self.http.get(self.url + path, timeout=self.timeout)
        except httpx.HTTPError as e:
            raise EngineError(f"engine {self.url}: GET {path} failed: {type(e).__name__}: {e}") from None
        if r.status_code == 404 and older_name and path != older_name:
            self._older_info_names = True
            return await self._get_json(older_name)
        if r.status_code != 200:
            raise EngineError(f"engine {self.url}: GET {path} answered {r.status_code}: {r.text[:300]}")
        return r.json()

    async def generate(
        self, input_ids: list[int], sampling_params: dict, rid: str, return_logprob: bool = True
    ) -> dict:
        body = {
            "input_ids": input_ids,
            "sampling_params": sampling_params,
            "rid": rid,
            "return_logprob": return_logprob,
            "logprob_start_len": -1,
        }
        # Finite and sized from the work asked for: a frozen engine is noticed within it.
        timeout = self.generate_timeout + self.seconds_per_token * int(sampling_params.get("max_new_tokens") or 128)
        started = self.metrics.started() if self.metrics is not None else 0.0
        answer = None
        try:
            answer = await self._generate(body, rid, timeout)
            version = answer.get("meta_info", {}).get("weight_version") if isinstance(answer, dict) else None
            if version is not None:  # (SGLang before 0.4.10 does not say)
                self.answered_version = _version_number(str(version))
            return answer
        finally:
            if self.metrics is not None:
                self.metrics.finished(started, answer)

    async def _generate(self, body: dict, rid: str, timeout: float) -> dict:
        try:
            for attempt in range(GENERATE_ATTEMPTS):
                if attempt:
                    # A fresh rid: the broken one may still be in flight. abort(rid) follows it.
                    body["rid"] = self._live_rids[rid] = f"{rid}-retry{attempt}"
                try:
                    http = self.generate_http[next(self._next_pool) % len(self.generate_http)]
                    r = await http.post(self.url + "/generate", json=body, timeout=timeout)
                    break
                except (httpx.NetworkError, httpx.RemoteProtocolError) as e:
                    # The connection broke (a pooled connection closed under us, an engine
                    # restarting); timeouts are not retried. Abort the broken request so it
                    # cannot linger, then send it again.
                    if attempt + 1 == GENERATE_ATTEMPTS:
                        raise EngineError(
                            f"engine {self.url}: POST /generate failed {GENERATE_ATTEMPTS} times: "
                            f"{type(e).__name__}: {e}"
                        ) from None
                    await asyncio.sleep(0.1 * 2**attempt)
                    try:
                        await self.abort(rid)
                    except EngineError:
                        pass
                except httpx.HTTPError as e:
                    raise EngineError(f"engine {self.url}: POST /generate failed: {type(e).__name__}: {e}") from None
        finally:
            self._live_rids.pop(rid, None)
        if r.status_code == 400:
            raise InvalidArgument(f"engine {self.url} refused the request: {_error_message(r)}")
        if r.status_code != 200:
            raise EngineError(f"engine {self.url}: /generate answered {r.status_code}: {r.text[:300]}")
        return r.json()

    async def abort(self, rid: str = "", abort_all: bool = False) -> None:
        """Abort a request by the rid it was sent with (or the retry that replaced it)."""
        await self._post("/abort_request", {"rid": self._live_rids.get(rid, rid), "abort_all": abort_all})

    async def pause(self, mode: str = "abort") -> None:
        await self._check(await self._post("/pause_generation", {"mode": mode}), "/pause_generation")

    async def resume(self) -> None:
        await self._check(await self._post("/continue_generation", {}), "/continue_generation")

    async def model_info(self) -> dict:
        return await self._get_json("/model_info", "/get_model_info")

    async def server_info(self) -> dict:
        return await self._get_json("/server_info", "/get_server_info")

    async def workers(self) -> list[str]:
        """The router's workers (the router does not forward weight calls)."""
        return [w["url"] for w in (await self._get_json("/workers")).get("workers", [])]

    async def weight_call(self, path: str, body: dict) -> dict:
        r = await self._post(path, body, timeout=self.weight_timeout)
        return await self._check(r, path)

    async def begin_weight_update(self) -> None:
        """Open a weight-update session unless one is open: a push's buckets share one."""
        if self._has_weight_session is False or self._in_session:
            return
        self._in_session = True
        try:
            r = await self._post("/begin_weight_update", {"selector": "all"})
            self._has_weight_session = r.status_code != 404
            if self._has_weight_session:
                await self._check(r, "/begin_weight_update")
        except BaseException:
            self._in_session = False
            raise

    async def end_weight_update(self) -> None:
        if self._in_session:
            self._in_session = False
            if self._has_weight_session:
                await self._check(await self._post("/end_weight_update", {}), "/end_weight_update")

    async def _check(self, r: httpx.Response, path: str) -> dict:
        try:
            body = r.json() if r.content else {}
        except ValueError:
            body = {}
        if r.status_code != 200 or (isinstance(body, dict) and body.get("success") is False):
            msg = body.get("message") if isinstance(body, dict) else None
            raise FailedPrecondition(f"engine {self.url}: {path} failed ({r.status_code}): {msg or r.text[:300]}")
        return body if isinstance(body, dict) else {}


def _error_message(r: httpx.Response) -> str:
    try:
        body = r.json()
        return body.get("error", {}).get("message") or body.get("message") or r.text
    except ValueError:
        return r.text[:300]


def _version_number(version: str) -> int:
    try:
        return int(version)
    except (TypeError, ValueError):
        return 0  # "default": never updated


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
    ) -> None:
        def http_client(connections: int) -> httpx.AsyncClient:
            return httpx.AsyncClient(
                limits=httpx.Limits(
                    max_connections=connections,
                    max_keepalive_connections=connections // 4,
                    keepalive_expiry=KEEPALIVE_EXPIRY_SECONDS,
                ),
                headers=credential_headers(api_key) or None,
            )

        self.http = http_client(1024)
        self.generate_http = [http_client(1024 // GENERATE_CONNECTION_POOLS) for _ in range(GENERATE_CONNECTION_POOLS)]
        self.timeout, self.weight_timeout = timeout, weight_timeout
        self._generate_timeouts = (generate_timeout, seconds_per_token)
        self.metrics = metrics
        self.router = self._client(router_url) if router_url else None
        self.engines = [self._client(u) for u in engine_urls]
        self._next = itertools.count()
        self._down: set[str] = set()  # urls whose last call broke or that did not answer a probe
        self._versions: dict[str, int] = {}  # url -> the weight version it last reported or received
        self._current: int | None = None  # the version of the last weight update (None: none yet)
        self._groups: dict[str, list[SGLangClient]] = {}  # weight group name -> the engines in it
        if not self.engines and not self.router:
            raise ValueError("the rollout service needs engine_urls or a router_url")

    # ---- membership ---------------------------------------------------------------------

    def mark_down(self, engine: SGLangClient) -> None:
        """An engine's call broke: out of the generation rotation until it answers again."""
        if engine is not self.router and engine.url not in self._down:
            log.warning("engine %s left the pool (its samples are retried on the others)", engine.url)
            self._down.add(engine.url)

    def _set_up(self, engine: SGLangClient, version: str | int) -> None:
        if engine.url in self._down:
            log.info("engine %s answers again", engine.url)
        self._down.discard(engine.url)
        self._versions[engine.url] = _version_number(str(version))

    def in_rotation(self) -> list[SGLangClient]:
        """Engines that answer and hold the weights of the last update (any that answer
        when none holds them: say, every engine restarted before the trainer pushed again)."""
        up = [e for e in self.engines if e.url not in self._down]
        current = [e for e in up if self._versions.get(e.url, 0) == self._current]
        return current if self._current is not None and current else up

    async def refresh_workers(self) -> None:
        """Behind a router, the engines are the router's workers."""
        if self.router:
            urls = await self.router.workers()
            known = {e.url: e for e in self.engines}
            self.engines = [known.get(u.rstrip("/")) or self._client(u) for u in urls]

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
        engines = self.in_rotation() or self.engines  # none left: try them all (the caller retries)
        return engines[next(self._next) % len(engines)]

    async def engine_for(self, weight_version: int) -> SGLangClient:
        """The next engine in turn that holds at least `weight_version` (0: any, as
        for_generation). None known to: every engine is asked (a restarted one answers
        with its base weights); EngineError while none answers (the caller waits and
        retries), EnginesBehind when those that answer all hold older weights."""
        if not weight_version or self.router:
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
            self._versions[engine.url] = answered
            raise EngineBehind(
                f"engine {engine.url} answered with weight version {answered}, older than {weight_version} "
                "(it restarted?): generating the sample again"
            )

    async def states(self) -> list[EngineState]:
        await self.refresh_workers()

        async def one(e: SGLangClient) -> EngineState:
            try:
                info, server = await asyncio.gather(e.model_info(), e.server_info())
            except Unavailable:
                self.mark_down(e)
                return EngineState(url=e.url, healthy=False)
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
            )

        return list(await asyncio.gather(*(one(e) for e in self.engines)))

    async def abort_all(self) -> None:
        await asyncio.gather(*(e.abort(abort_all=True) for e in self.engines), return_exceptions=True)

    # ---- control and weight updates: every engine, at once ------------------------------

    async def each_answering(self, call: Callable[[SGLangClient], Awaitable[object]]) -> None:
        """A control call to every engine (one thought down may still be finishing requests);
        one that does not answer leaves the pool (a dead engine generates nothing, so it
        needs no pausing). Fails only when no engine answered."""
        engines = list(self.engines)
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
        await self.each_answering(lambda e: e.pause(mode))

    async def resume(self) -> None:
        await self.each_answering(lambda e: e.resume())

    async def init_weight_group(
        self, master_address: str, master_port: int, world_size: int, group_name: str, backend: str
    ) -> int:
        """Every engine that answers joins the trainer's weight-update group (the trainer is
        rank 0; an engine's TP ranks follow the ranks of the engines before it); one that is
        down is left out and joins the next group once it answers. Returns how many joined."""
        if world_size < 2:
            raise InvalidArgument("world_size must count the trainer (rank 0) and every engine rank")
        everyone = await self.states()
        members = [(e, s) for e, s in zip(self.engines, everyone) if s.healthy]
        if not members:
            raise Unavailable(f"engines not answering: {', '.join(s.url for s in everyone)}")
        states = [s for _, s in members]
        expected = weight_group_world_size(states)
        if world_size != expected:
            message = f"world_size {world_size} does not match the engines that answer: 1 + TP sizes = {expected}"
            if world_size > weight_group_world_size(everyone):
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
        self._current = _version_number(weight_version)
        for e in engines:
            self._set_up(e, weight_version)

    async def destroy_weight_group(self, group_name: str) -> None:
        members = self._groups.pop(group_name, self.engines)
        # A member that died since has no group left to destroy.
        alive = [e for e in members if e.url not in self._down] or members
        await asyncio.gather(
            *(e.weight_call("/destroy_weights_update_group", {"group_name": group_name}) for e in alive)
        )

    async def update_weights_from_disk(self, model_path: str, weight_version: str) -> None:
        if not model_path:
            raise InvalidArgument("model_path is required")
        members = [e for e, s in zip(self.engines, await self.states()) if s.healthy]
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
        await asyncio.gather(*(http.aclose() for http in (self.http, *self.generate_http)))

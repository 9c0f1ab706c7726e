"""The client of one inference engine: SGLang's native HTTP API. Production engines
are SGLang servers (optionally behind the SGLang router); the reference engine serves
the same API on CPU, and this client cannot tell them apart."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Hashable
from dataclasses import dataclass

import aiohttp
import httpx
from aiohttp.helpers import get_env_proxy_for_url
from yarl import URL

from rlmesh.common.errors import Aborted, FailedPrecondition, InvalidArgument, Unavailable
from rlmesh.rollout.generate_batches import BatchFailed, GenerateBatches
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
    gpu_uuid: str = ""  # the GPU it runs on, where it says ("" = CPU or unknown: SGLang)
    # "serving" (takes generation), "behind" (answers, but holds older weights than the run's
    # last push: a new or restarted engine until the next push reaches it), "down", or
    # "leaving" (discovery dropped it; requests it had in flight finish there).
    state: str = ""
    generate_requests: int = 0  # /generate calls sent to it since it joined the pool
    in_flight: int = 0  # of them, not answered yet
    first_answer_version: str = ""  # the weight version its first /generate answer reported ("": none yet)


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


def weight_group_world_size(states: list[EngineState]) -> int:
    """The trainer (rank 0) plus every engine's tensor-parallel ranks."""
    return 1 + sum(s.tp_size for s in states)


GENERATE_ATTEMPTS = 3
# Idle pooled connections are dropped before servers (uvicorn: 5 s by default) close them.
KEEPALIVE_EXPIRY_SECONDS = 2.0
GENERATE_CONNECTIONS = 1024  # /generate calls in flight at once, over all engines
# A /generate answer larger than this is refused (its logprobs for 32k tokens are ~2 MB).
MAX_GENERATE_ANSWER_BYTES = 64 * 1024 * 1024


class GenerateHTTP:
    """The connections /generate goes through, opened on first use (in the loop that uses
    them). /generate is the rollout's one hot call, a request per sample with hundreds in
    flight, so it has its own client: aiohttp costs about a fifth of httpx's CPU per request
    (0.2-0.3 against 1.2-1.3 ms here), and httpx, not the engine, bounded generation. The
    engine's other calls (weights, pause, info) are rare and go through httpx."""

    def __init__(self, headers: dict[str, str] | None = None, connections: int = GENERATE_CONNECTIONS) -> None:
        self.headers, self.connections = headers or {}, connections
        self._session: aiohttp.ClientSession | None = None
        # URL -> the proxy and its credentials (None: direct), as HTTP(S)_PROXY
        # and NO_PROXY say, as httpx takes them for the other calls. Looked up once per engine:
        # aiohttp's trust_env looks them up (and reads ~/.netrc) in a thread at every request,
        # which was a third of the rollout service's CPU in a fully_async run.
        self._proxies: dict[str, tuple[URL | None, aiohttp.BasicAuth | None]] = {}

    async def post(self, url: str, body: dict, timeout: float, answers: int = 1) -> tuple[int, bytes]:
        """The answer's status and body (`answers` requests' answers: a batch). Raises
        aiohttp's errors, and asyncio.TimeoutError past `timeout` seconds."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.connections, keepalive_timeout=KEEPALIVE_EXPIRY_SECONDS),
                headers=self.headers,
            )
        proxy, proxy_auth = self._proxy(url)
        limit = aiohttp.ClientTimeout(total=timeout)
        async with self._session.post(url, json=body, timeout=limit, proxy=proxy, proxy_auth=proxy_auth) as r:
            chunks, size = [], 0
            async for chunk in r.content.iter_chunked(1024 * 1024):
                size += len(chunk)
                if size > answers * MAX_GENERATE_ANSWER_BYTES:  # (not retried: the engine would answer the same)
                    raise EngineError(f"{url} answered more than {answers * MAX_GENERATE_ANSWER_BYTES} bytes")
                chunks.append(chunk)
            return r.status, b"".join(chunks)

    def _proxy(self, url: str) -> tuple[URL | None, aiohttp.BasicAuth | None]:
        if url not in self._proxies:  # (one /generate URL per engine)
            try:
                self._proxies[url] = get_env_proxy_for_url(URL(url))
            except LookupError:  # none set, or NO_PROXY names the host
                self._proxies[url] = (None, None)
        return self._proxies[url]

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def __aenter__(self) -> GenerateHTTP:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


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
        *,
        generate_http: GenerateHTTP,
    ) -> None:
        self.url = url.rstrip("/")
        self.http = http  # every call but /generate
        self.generate_http = generate_http  # /generate's connections (its owner closes them)
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
        self.held_version: int | None = None  # the weight version the pool last knew it to hold
        self.paused = False  # the pool paused it (for a weight push) and has not let it continue
        self.first_answer_version = ""  # the weight version its first /generate answer reported
        self.generate_requests = self.in_flight = 0
        self.retired = False  # discovery dropped it: a broken request is retried on another engine
        # Requests given one batch key (a prompt's samples) go out together (generate_batches.py).
        self.batch_generate = True
        self._batches = GenerateBatches(self._generate, self._generate_batch, lambda rid: self.abort(rid))

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
        self,
        input_ids: list[int],
        sampling_params: dict,
        rid: str,
        return_logprob: bool = True,
        batch_key: Hashable | None = None,
    ) -> dict:
        """One request's answer. Requests sent in the same turn of the event loop with the same
        `batch_key` (not None) travel to the engine as one batched /generate."""
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
        # Sent while paused, it starts once the engine continues, after the push: under the
        # version the engine will then hold, which is not known yet (None: not counted).
        sent_under = None if self.paused else self.held_version
        answer = None
        self.generate_requests += 1
        self.in_flight += 1
        try:
            if batch_key is not None and self.batch_generate:
                answer = await self._batches.generate(batch_key, body, rid, timeout)
            else:
                answer = await self._generate(body, rid, timeout)
            version = answer.get("meta_info", {}).get("weight_version") if isinstance(answer, dict) else None
            if version is not None:  # (SGLang before 0.4.10 does not say)
                self.answered_version = version_number(str(version))
                self.first_answer_version = self.first_answer_version or str(version)
                if sent_under is not None and sent_under != self.answered_version:
                    # Its weights changed under the request (a pause that kept it: in_place,
                    # retract): the first tokens came from the version it was sent under.
                    answer["meta_info"][BEGAN_UNDER_VERSION] = str(sent_under)
            return answer
        finally:
            self.in_flight -= 1
            if self.metrics is not None:
                self.metrics.finished(started, answer)

    async def _generate(self, body: dict, rid: str, timeout: float) -> dict:
        try:
            for attempt in range(GENERATE_ATTEMPTS):
                if attempt:
                    # A fresh rid: the broken one may still be in flight. abort(rid) follows it.
                    body["rid"] = self._live_rids[rid] = f"{rid}-retry{attempt}"
                try:
                    status, answer = await self.generate_http.post(self.url + "/generate", body, timeout)
                    break
                except asyncio.TimeoutError:  # (first: aiohttp's read timeout is a connection error too)
                    raise EngineError(f"engine {self.url}: POST /generate timed out after {timeout:.0f} s") from None
                except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
                    # The connection broke (a pooled connection closed under us, an engine
                    # restarting); timeouts are not retried. Abort the broken request so it
                    # cannot linger, then send it again (an engine that left the pool: the
                    # caller sends it to another).
                    if attempt + 1 == GENERATE_ATTEMPTS or self.retired:
                        raise EngineError(
                            f"engine {self.url}: POST /generate failed {attempt + 1} times: {type(e).__name__}: {e}"
                        ) from None
                    await asyncio.sleep(0.1 * 2**attempt)
                    try:
                        await self.abort(rid)
                    except EngineError:
                        pass
                except aiohttp.ClientError as e:
                    raise EngineError(f"engine {self.url}: POST /generate failed: {type(e).__name__}: {e}") from None
        finally:
            self._live_rids.pop(rid, None)
        if status == 400:
            raise InvalidArgument(f"engine {self.url} refused the request: {error_message(answer)}")
        if status != 200:
            raise EngineError(f"engine {self.url}: /generate answered {status}: {_text(answer)}")
        try:
            return decode_answer(answer, "/generate")
        except ValueError:
            raise EngineError(f"engine {self.url}: /generate answered something not JSON: {_text(answer)}") from None

    async def _generate_batch(self, body: dict, rids: list[str], timeout: float, count: int) -> list[dict]:
        """A batched /generate's answers, in order; BatchFailed when it has none to give (its
        requests are then sent one at a time, each to its own retry or error)."""
        try:
            status, answer = await self.generate_http.post(self.url + "/generate", body, timeout, answers=count)
        except asyncio.TimeoutError:
            raise EngineError(f"engine {self.url}: POST /generate timed out after {timeout:.0f} s") from None
        except aiohttp.ClientError as e:
            for rid in rids:  # (a broken connection: none of them may linger)
                with contextlib.suppress(EngineError):
                    await self.abort(rid)
            raise BatchFailed(f"{type(e).__name__}: {e}") from None
        if status != 200:  # (one request refused or failed: alone, each meets its own answer)
            raise BatchFailed(f"answered {status}")
        try:
            answers = decode_answer(answer, "/generate")
        except ValueError:
            raise BatchFailed("answered something not JSON") from None
        if not isinstance(answers, list) or len(answers) != count or not all(isinstance(a, dict) for a in answers):
            raise BatchFailed(f"answered no list of {count} answers")  # (an engine without the batch form)
        return answers

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


def decode_answer(answer: bytes, path: str) -> dict:
    """An engine's JSON answer to `path` (the SGLang fidelity test notes what is read of it)."""
    return json.loads(answer)


def error_message(answer: bytes) -> str:
    """The message of an engine's error answer (SGLang's OpenAI-style error, or its own)."""
    try:
        body = json.loads(answer)
        return body.get("error", {}).get("message") or body.get("message") or _text(answer)
    except (ValueError, AttributeError):
        return _text(answer)


def _text(answer: bytes) -> str:
    return answer[:300].decode("utf-8", "replace")


# Added to a /generate answer's meta_info (never sent by an engine): the weight version the
# request was sent under, when the engine answered under another.
BEGAN_UNDER_VERSION = "rlmesh_began_under_weight_version"


def version_number(version: str) -> int:
    try:
        return int(version)
    except (TypeError, ValueError):
        return 0  # "default": never updated

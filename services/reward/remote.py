"""Remote reward services: the two wire protocols and their transports (a registration is
checked by rlmesh.reward.registration and kept by rlmesh.reward.registry).

A remote reward service is registered by URL under a name; runs then use that name
as a reward component (`{"correctness": 1.0, "my_judge": 0.5}`). When the service
returns several named scores, each is also a component, `my_judge/<name>`.

HTTP JSON protocol (`http://` and `https://` URLs)
--------------------------------------------------
rlmesh POSTs a batch of samples to the URL exactly as registered (say
`http://judge:8000/score`) with `Content-Type: application/json`:

    {"samples": [SAMPLE, ...]}

SAMPLE is a sample as rlmesh.common.sample.sample_to_json writes it:

    {"index": 12, "group_index": 3, "prompt": "What is 2+3?", "messages": [],
     "tokens": [...], "response": "... \\boxed{5}", "response_length": 7,
     "label": "5", "reward": 0.0, "reward_components": {}, "loss_mask": [...],
     "status": "completed", "metadata": {...}, "rollout_log_probs": [...],
     "weight_versions": [3],
     "multimodal_inputs": [{"kind": "image", "uri": "...", "mime_type": "...", "data_base64": "..."}]}

A request holds whole groups (every sample of a prompt that asks for this service,
same `group_index`) up to the service's max_batch_size samples; a larger group is
sent alone. The service answers HTTP 200 with

    {"scores": [SCORE, ...]}

one SCORE per request sample, in the request's order, where SCORE is

- a number: the sample's score, e.g. `0.75`;
- an object of named numbers, e.g. `{"accuracy": 1.0, "style": 0.5}`: a run names one
  as `my_judge/accuracy` (or the whole service with the spec's reward_key);
- `null`: "I cannot score this sample"; that sample is marked FAILED.

Registration first sends one probe sample (its metadata holds `"rlmesh_probe": true`,
should a service want to answer it cheaply) and refuses a service that does not answer
it per this contract.

Numbers must be finite (JSON has no NaN or Infinity; Python's `json.dumps` writes
them anyway and they are rejected); booleans and strings are not numbers. What goes
wrong, and what rlmesh does (the samples concerned get status FAILED and the reason
in metadata["reward_error"]; nothing is ever scored 0 silently):

- no answer within the timeout, connection refused or reset, HTTP 5xx, 408 or 429:
  retried (bounded, exponential backoff with jitter), then the request's samples fail;
- another HTTP status, a body that is not JSON, has no "scores" list, holds the wrong
  number of scores, or is larger than max_reply_bytes: the request's samples fail;
- one score that is NaN, infinite, or not a number (or object of numbers): that
  sample alone fails.

The reasons never quote the remote's reply (its body, its error text, a score that is
not a number): they say what was wrong (HTTP status, "not valid JSON", "3 scores for 4
samples"), since whoever registered the URL reads them. A bounded excerpt goes to the
reward service's log at debug level. Which hosts may be called at all:
rlmesh.reward.url_policy (checked at registration and again before every call).

gRPC protocol (`grpc://host:port` URLs)
---------------------------------------
The remote serves rlmesh.v1.Reward (proto/rlmesh/v1/reward.proto), e.g. another
rlmesh reward service. rlmesh calls ScoreGroups with an empty RewardSpec (the
remote's own defaults); samples scored one by one travel as one-sample groups. The
reply must hold the same groups and samples in the same order; each reply sample's
`reward` is its score and its `reward_components` its named scores; a sample the
remote marks FAILED fails here too (its reason is logged, not passed on).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

import grpc
import httpx

from rlmesh.common.auth import credential_headers
from rlmesh.common.grpc_server import MAX_RECONNECT_BACKOFF_MS
from rlmesh.common.limits import MAX_ABS_REWARD
from rlmesh.common.reward_service import RemoteServiceSpec
from rlmesh.common.sample import (
    ConversionError,
    Sample,
    SampleGroup,
    Status,
    group_from_proto,
    group_to_proto,
    sample_to_json,
)
from rlmesh.reward.url_policy import Refused, Unresolvable, UrlPolicy
from rlmesh.v1 import reward_pb2, reward_pb2_grpc

log = logging.getLogger(__name__)

_EXCERPT_CHARS = 200


# ---------------------------------------------------------------- what a call returns


@dataclass(frozen=True)
class RemoteScore:
    """One sample's answer: a single score, named scores, or (gRPC) both."""

    total: float | None
    named: dict[str, float] = field(default_factory=dict)


# Per sample: a RemoteScore, or the reason this sample could not be scored.
SampleResult = RemoteScore | str


@dataclass
class Unit:
    """Samples that travel together: a group's samples (group set), or one sample."""

    samples: list[Sample]
    group: SampleGroup | None = None


class CallFailed(Exception):
    """A whole call failed. retryable: a timeout or an outage that a later try may not see."""

    def __init__(self, reason: str, retryable: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retryable = retryable


class Transport(Protocol):
    async def call(self, units: Sequence[Unit], timeout: float) -> list[SampleResult]: ...

    async def close(self) -> None: ...


def _excerpt(data: bytes | str) -> str:
    """A bounded, one-line excerpt of a remote's reply: for the debug log only, never for a reason."""
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    text = " ".join(text.split())
    return text[:_EXCERPT_CHARS] + ("..." if len(text) > _EXCERPT_CHARS else "")


def _finite(value: Any) -> float | str:
    """value as a float, or why it is not an acceptable score."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return f"a JSON {_json_type(value)}, not a number"
    try:
        result = float(value)
    except OverflowError:
        return "an integer too large for a float"
    if not math.isfinite(result):
        return f"{result} (scores must be finite numbers)"
    if abs(result) > MAX_ABS_REWARD:
        return f"{result:g}, outside ±{MAX_ABS_REWARD:g} (scale the scores down)"
    return result


def _json_type(value: Any) -> str:
    """What kind of JSON value this is (never the value itself)."""
    if isinstance(value, bool):
        return "boolean"
    return {str: "string", list: "array", dict: "object", type(None): "null"}.get(type(value), "number")


def parse_score(value: Any) -> SampleResult:
    """One entry of an HTTP reply's "scores" list."""
    if value is None:
        return "the service returned null: it could not score this sample"
    if isinstance(value, dict):
        if not value:
            return "the service returned an empty object instead of named scores"
        named: dict[str, float] = {}
        for key, item in value.items():
            checked = _finite(item)
            if isinstance(checked, str):
                return f"named score {key!r} is {checked}"
            named[str(key)] = checked
        return RemoteScore(None, named)
    checked = _finite(value)
    if isinstance(checked, str):
        return f"the score is {checked}"
    return RemoteScore(checked)


def parse_scores_reply(body: bytes, expected: int) -> list[SampleResult]:
    """An HTTP reply body -> one result per sample; CallFailed when the reply as a whole is unusable."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        log.debug("reply that is not JSON: %r", _excerpt(body))
        raise CallFailed("the reply is not valid JSON", retryable=False) from None
    except RecursionError:
        raise CallFailed("the reply is JSON nested too deeply to read", retryable=False) from None
    if not isinstance(data, dict) or not isinstance(data.get("scores"), list):
        log.debug("reply without a scores list: %r", _excerpt(body))
        got = 'an object without a "scores" list' if isinstance(data, dict) else f"a JSON {_json_type(data)}"
        raise CallFailed(
            f'the reply must be an object {{"scores": [...]}} with one score per sample, got {got}', retryable=False
        )
    scores = data["scores"]
    if len(scores) != expected:
        raise CallFailed(f"the reply has {len(scores)} scores for {expected} samples", retryable=False)
    return [parse_score(v) for v in scores]


# ---------------------------------------------------------------- HTTP JSON


def request_body(samples: Sequence[Sample]) -> bytes:
    return json.dumps({"samples": [sample_to_json(s) for s in samples]}).encode()


async def _checked_addresses(policy: UrlPolicy, url: str, timeout: float) -> list[str]:
    """The URL host's addresses, checked now (a name may resolve elsewhere than at registration)."""
    try:
        return await policy.resolve(url, timeout)
    except Refused as e:
        raise CallFailed(str(e), retryable=False) from None
    except Unresolvable as e:
        raise CallFailed(str(e), retryable=True) from None


class HttpJsonTransport:
    """POSTs to the registered URL, connected to an address of its host that the policy
    checked for this very call: the URL's host becomes that address, while the Host header
    and the TLS server name (SNI and the certificate check) stay the registered name."""

    def __init__(
        self, url: str, max_concurrency: int, max_reply_bytes: int, policy: UrlPolicy, bearer_token: str = ""
    ) -> None:
        self.url = url
        self.policy = policy
        self._parsed = httpx.URL(url)
        self.headers = {
            "content-type": "application/json",
            "host": self._parsed.netloc.decode("ascii"),
            **credential_headers(bearer_token),
        }
        self._extensions = {"sni_hostname": self._parsed.host}
        self.max_reply_bytes = max_reply_bytes
        limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
        # trust_env=False: a proxy from the environment would reach addresses the policy never checked.
        self.client = httpx.AsyncClient(limits=limits, follow_redirects=False, trust_env=False)

    async def call(self, units: Sequence[Unit], timeout: float) -> list[SampleResult]:
        samples = [s for u in units for s in u.samples]
        addresses = await _checked_addresses(self.policy, self.url, timeout)
        content = request_body(samples)
        for i, address in enumerate(addresses):
            try:
                async with self.client.stream(
                    "POST",
                    self._parsed.copy_with(host=address),
                    content=content,
                    headers=self.headers,
                    extensions=self._extensions,
                    timeout=httpx.Timeout(timeout),
                ) as reply:
                    body = await self._read_capped(reply)
            except httpx.ConnectError as e:
                if i + 1 < len(addresses):
                    continue  # nothing was sent: try the host's next address
                raise CallFailed(f"cannot connect to {self.url}: {e or 'connection refused'}", retryable=True) from None
            except httpx.TimeoutException:
                raise CallFailed(f"no answer within {timeout:g} s", retryable=True) from None
            except httpx.HTTPError as e:  # reset mid-reply, protocol errors: the service may be restarting
                # The error's text may quote what the remote sent (a malformed status line): logged only.
                log.debug("HTTP error talking to %s: %r", self.url, _excerpt(str(e)))
                raise CallFailed(f"HTTP error talking to {self.url}: {type(e).__name__}", retryable=True) from None
            break
        if reply.status_code != 200:
            log.debug("HTTP %d from %s: %r", reply.status_code, self.url, _excerpt(body))
            retryable = reply.status_code >= 500 or reply.status_code in (408, 429)
            raise CallFailed(f"HTTP {reply.status_code} from {self.url}", retryable)
        return parse_scores_reply(body, len(samples))

    async def _read_capped(self, reply: httpx.Response) -> bytes:
        declared = reply.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_reply_bytes:
            raise CallFailed(
                f"the reply is {int(declared)} bytes, larger than max_reply_bytes ({self.max_reply_bytes})",
                retryable=False,
            )
        chunks, size = [], 0
        async for chunk in reply.aiter_bytes():
            size += len(chunk)
            if size > self.max_reply_bytes:
                raise CallFailed(f"the reply is larger than max_reply_bytes ({self.max_reply_bytes})", retryable=False)
            chunks.append(chunk)
        return b"".join(chunks)

    async def close(self) -> None:
        await self.client.aclose()


# ---------------------------------------------------------------- gRPC (rlmesh's reward contract)

_RETRYABLE_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
}


def grpc_target(url: str) -> str:
    parts = urlsplit(url)
    host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname
    return f"{host}:{parts.port}"


def pinned_target(addresses: Sequence[str], port: int) -> str:
    """A gRPC target naming checked addresses, so gRPC does not resolve the name itself. One
    family per target (gRPC's ipv4:/ipv6: schemes); IPv4 when there is one, as a name like
    localhost is more often served on 127.0.0.1 than on ::1."""
    v4 = [a for a in addresses if ":" not in a]
    if v4:
        return "ipv4:" + ",".join(f"{a}:{port}" for a in v4)
    return "ipv6:" + ",".join(f"[{a}]:{port}" for a in addresses)


class GrpcTransport:
    """Calls ScoreGroups over a channel to addresses of the URL's host that the policy checked
    for this very call; when the host's addresses change, a new channel is made and the old
    one closes once the calls on it are done."""

    def __init__(self, url: str, max_reply_bytes: int, policy: UrlPolicy, bearer_token: str = "") -> None:
        self.url = url
        self.policy = policy
        self.metadata = list(credential_headers(bearer_token).items())
        self.max_reply_bytes = max_reply_bytes
        self.port = urlsplit(url).port
        self._target = ""
        self._channel: grpc.aio.Channel | None = None
        self._stub: reward_pb2_grpc.RewardStub | None = None
        self._retired: list[grpc.aio.Channel] = []
        self._closing: set[asyncio.Future] = set()

    def _stub_for(self, addresses: list[str], grace: float) -> reward_pb2_grpc.RewardStub:
        target = pinned_target(addresses, self.port)
        if target != self._target or self._stub is None:
            if self._channel is not None:
                self._retired.append(self._channel)
                closing = asyncio.ensure_future(self._channel.close(grace))
                self._closing.add(closing)
                closing.add_done_callback(self._closing.discard)
            self._channel = grpc.aio.insecure_channel(
                target,
                options=[
                    ("grpc.max_receive_message_length", self.max_reply_bytes),
                    ("grpc.max_send_message_length", 256 * 1024 * 1024),
                    ("grpc.default_authority", grpc_target(self.url)),  # the registered name, not the address
                    ("grpc.enable_http_proxy", 0),  # connect only to the address just checked
                    ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
                ],
            )
            self._stub = reward_pb2_grpc.RewardStub(self._channel)
            self._target = target
        return self._stub

    async def call(self, units: Sequence[Unit], timeout: float) -> list[SampleResult]:
        stub = self._stub_for(await _checked_addresses(self.policy, self.url, timeout), timeout)
        groups = [
            SampleGroup(u.group.group_id, u.group.group_index, u.samples, u.group.dataset)
            if u.group is not None
            else SampleGroup(f"sample-{u.samples[0].index}", u.samples[0].group_index, u.samples)
            for u in units
        ]
        request = reward_pb2.ScoreGroupsRequest(groups=[group_to_proto(g) for g in groups])
        try:
            reply = await stub.ScoreGroups(request, timeout=timeout, metadata=self.metadata)
        except grpc.aio.AioRpcError as e:
            code, details = e.code(), e.details() or ""
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise CallFailed(f"no answer within {timeout:g} s", retryable=True) from None
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details:
                raise CallFailed(
                    f"the reply is larger than max_reply_bytes ({self.max_reply_bytes})", retryable=False
                ) from None
            log.debug("%s from %s: %r", code.name, self.url, _excerpt(details))  # the remote's text: logged only
            raise CallFailed(f"{code.name} from {self.url}", code in _RETRYABLE_CODES) from None
        return self._results(groups, reply)

    @staticmethod
    def _results(sent: list[SampleGroup], reply: reward_pb2.ScoreGroupsResponse) -> list[SampleResult]:
        if len(reply.groups) != len(sent):
            raise CallFailed(f"the reply has {len(reply.groups)} groups for {len(sent)} sent", retryable=False)
        results: list[SampleResult] = []
        for position, (group, answer) in enumerate(zip(sent, reply.groups)):
            try:
                scored = group_from_proto(answer)
            except ConversionError as e:
                log.debug("malformed reply group: %s", _excerpt(str(e)))
                raise CallFailed("the reply holds a malformed sample", retryable=False) from None
            if scored.group_id != group.group_id or len(scored.samples) != len(group.samples):
                raise CallFailed(
                    f"the reply's group {position} is not group {group.group_id!r} with its {len(group.samples)} "
                    "samples: groups and samples must come back as sent, in the order sent",
                    retryable=False,
                )
            for mine, theirs in zip(group.samples, scored.samples):
                if theirs.index != mine.index:
                    raise CallFailed(
                        f"the reply has sample {theirs.index} where sample {mine.index} was sent (order must be kept)",
                        retryable=False,
                    )
                results.append(_grpc_sample_result(theirs))
        return results

    async def close(self) -> None:
        for channel in (*self._retired, self._channel):
            if channel is not None:
                await channel.close()


def _grpc_sample_result(sample: Sample) -> SampleResult:
    if sample.status == Status.FAILED:
        log.debug(
            "the remote could not score sample %d: %r",
            sample.index,
            _excerpt(str(sample.metadata.get("reward_error", ""))),
        )
        return "the remote marked it FAILED (its reason is in the remote's own logs and stats)"
    total = _finite(sample.reward)
    if isinstance(total, str):
        return f"the score is {total}"
    named: dict[str, float] = {}
    for key, value in sample.reward_components.items():
        checked = _finite(value)
        if isinstance(checked, str):
            return f"named score {key!r} is {checked}"
        named[key] = checked
    return RemoteScore(total, named)


def make_transport(config: RemoteServiceSpec, max_reply_bytes: int, policy: UrlPolicy) -> Transport:
    if config.protocol == "grpc":
        return GrpcTransport(config.url, max_reply_bytes, policy, config.bearer_token)
    return HttpJsonTransport(config.url, config.max_concurrency, max_reply_bytes, policy, config.bearer_token)


def probe_sample() -> Sample:
    """What registration and the conformance kit send first: a small, valid, scoreable sample."""
    return Sample(
        index=0,
        group_index=0,
        prompt="What is 1 + 1?",
        tokens=[1, 2, 3, 4],
        response="1 + 1 = \\boxed{2}",
        response_length=2,
        label="2",
        loss_mask=[1, 1],
        status=Status.COMPLETED,
        metadata={"rlmesh_probe": True},
    )

"""The registered remote reward services: kept in Redis (one hash, name -> JSON record)
so that they survive a restart and every reward-service replica sees the same set;
kept in memory when the service runs without Redis.

Each replica keeps its own RemoteCaller per service (connections, breaker, counters)
and re-reads the hash before each scoring request, so a registration made through
one replica is used by all of them.

A name is replaced only when the registration says so (replace=True); otherwise a taken
name is refused with ALREADY_EXISTS. Whether a running run uses the name is the
coordinator's to check (it knows the runs; this service does not).
"""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from rlmesh.common import errors
from rlmesh.common.net import redacted
from rlmesh.common.reward_service import RemoteServiceSpec
from rlmesh.reward.registration import RemoteDefaults, record_from_json, record_to_json, resolve_registration
from rlmesh.reward.remote import CallFailed, RemoteScore, Unit, make_transport, probe_sample
from rlmesh.reward.resilience import CallPolicy, RemoteCaller
from rlmesh.reward.url_policy import UrlPolicy

log = logging.getLogger(__name__)

REDIS_KEY = "rlmesh:reward:remote_services"


class RemoteRegistry:
    def __init__(
        self, redis_url: str, defaults: RemoteDefaults, policy: CallPolicy, reserved: set[str], url_policy: UrlPolicy
    ) -> None:
        self.redis_url = redis_url
        self.defaults = defaults
        self.policy = policy
        self.url_policy = url_policy
        self.reserved = set(reserved)
        # Bounded waits: an unreachable Redis must not stall scoring (the last known set is used).
        self._redis = (
            aioredis.Redis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=5) if redis_url else None
        )
        self._configs: dict[str, RemoteServiceSpec] = {}  # last known (the store when there is no Redis)
        self._callers: dict[str, RemoteCaller] = {}
        self._retired: list[tuple[asyncio.TimerHandle, RemoteCaller]] = []
        self._lock = asyncio.Lock()

    # ------------------------------------------------------------ register / unregister / list

    async def register(self, proposed: RemoteServiceSpec, replace: bool = False) -> RemoteServiceSpec:
        """Check the URL against the policy, probe the service, save it. A taken name is
        refused (AlreadyExists) unless `replace`."""
        config = resolve_registration(proposed, self.defaults, self.reserved)
        if not replace and config.name in await self.configs():
            raise _taken(config.name)  # early, before anything is sent
        await self.url_policy.resolve(config.url, config.timeout_seconds)  # refused: nothing is sent
        await probe(config, self.policy.max_reply_bytes, self.url_policy)
        if self._redis is not None:
            try:
                if replace:
                    await self._redis.hset(REDIS_KEY, config.name, record_to_json(config))
                elif not await self._redis.hsetnx(REDIS_KEY, config.name, record_to_json(config)):
                    raise _taken(config.name)  # registered meanwhile, maybe through another replica
            except RedisError as e:
                raise errors.Unavailable(
                    f"cannot save the registration: Redis at {redacted(self.redis_url)} failed: {e}"
                ) from None
        elif not replace and config.name in self._configs:
            raise _taken(config.name)
        self._configs[config.name] = config
        await self.callers()  # replace the caller now if the URL or limits changed
        log.info("registered remote reward service %s at %s (%s)", config.name, config.url, config.protocol)
        return config

    async def unregister(self, name: str) -> bool:
        if self._redis is not None:
            try:
                removed = bool(await self._redis.hdel(REDIS_KEY, name))
            except RedisError as e:
                raise errors.Unavailable(
                    f"cannot remove the registration: Redis at {redacted(self.redis_url)} failed: {e}"
                ) from None
        else:
            removed = name in self._configs
        self._configs.pop(name, None)
        await self.callers()
        return removed

    async def configs(self) -> dict[str, RemoteServiceSpec]:
        """The registered services, from Redis; the last known set when Redis is unreachable."""
        if self._redis is None:
            return dict(self._configs)
        try:
            raw = await self._redis.hgetall(REDIS_KEY)
        except RedisError as e:
            log.warning(
                "Redis at %s unreachable (%s): using the last known remote reward services", redacted(self.redis_url), e
            )
            return dict(self._configs)
        configs = {}
        for name, record in raw.items():
            try:
                configs[name.decode()] = record_from_json(record)
            except (ValueError, TypeError) as e:
                log.warning("ignoring an unreadable registration %r in Redis: %s", name, e)
        self._configs = configs
        return dict(configs)

    # ------------------------------------------------------------ callers

    async def callers(self) -> dict[str, RemoteCaller]:
        """One caller per registered service, rebuilt when its registration changed."""
        configs = await self.configs()
        async with self._lock:
            stale = [n for n, c in self._callers.items() if configs.get(n) != c.config]
            for name in stale:
                caller = self._callers.pop(name)
                # Calls in flight keep using it; close it once they are surely done.
                delay = caller.config.timeout_seconds * (self.policy.max_retries + 2) + self.policy.backoff_max_seconds
                handle = asyncio.get_running_loop().call_later(delay, _close_later, caller)
                self._retired.append((handle, caller))
            for name, config in configs.items():
                if name not in self._callers:
                    transport = make_transport(config, self.policy.max_reply_bytes, self.url_policy)
                    self._callers[name] = RemoteCaller(config, self.policy, transport)
            return dict(self._callers)

    def known_callers(self) -> dict[str, RemoteCaller]:
        return dict(self._callers)

    async def close(self) -> None:
        for handle, caller in self._retired:
            handle.cancel()
            await caller.close()
        for caller in self._callers.values():
            await caller.close()
        self._retired.clear()
        self._callers.clear()
        if self._redis is not None:
            await self._redis.aclose()


def _taken(name: str) -> errors.AlreadyExists:
    return errors.AlreadyExists(
        f"a reward service named '{name}' is already registered; register with replace=true to replace it "
        "(or choose another name)"
    )


_closing: set[asyncio.Future] = set()  # strong references until the close finishes


def _close_later(caller: RemoteCaller) -> None:
    task = asyncio.ensure_future(caller.close())
    _closing.add(task)
    task.add_done_callback(_closing.discard)


async def probe(config: RemoteServiceSpec, max_reply_bytes: int, url_policy: UrlPolicy) -> RemoteScore | str:
    """Send one small sample (the contract's POST of {"samples": [...]}, never anything else);
    refuse the registration unless the service answers per the contract. (A service that
    answers null for the probe does answer.) The reason never quotes the reply."""
    transport = make_transport(config, max_reply_bytes, url_policy)
    try:
        results = await asyncio.wait_for(
            transport.call([Unit([probe_sample()])], config.timeout_seconds), config.timeout_seconds
        )
    except CallFailed as e:
        raise errors.FailedPrecondition(
            f"registration of '{config.name}' refused: the {config.protocol} service at {config.url} did not "
            f"answer a probe call correctly: {e.reason}. Check that it is running and serves the contract "
            "(see `rlmesh reward check URL`)"
        ) from None
    except asyncio.TimeoutError:
        raise errors.FailedPrecondition(
            f"registration of '{config.name}' refused: the service at {config.url} did not answer a probe call "
            f"within {config.timeout_seconds:g} s"
        ) from None
    finally:
        await transport.close()
    return results[0]

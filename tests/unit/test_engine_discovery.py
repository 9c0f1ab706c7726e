"""Engine discovery's plain logic: a DNS name's addresses become engine URLs (the resolver
injected: DNS cannot be changed here), a router's worker list is read in both of SGLang's
shapes, every lookup has a deadline and a bound, a failed one keeps the engines found
before and says why, and a configuration that cannot work is refused with the reason."""

from __future__ import annotations

import asyncio
import socket

import pytest
from pydantic import ValidationError

from rlmesh.rollout.config import Settings
from rlmesh.rollout.discovery import DiscoveryConfig, DiscoveryFailed, EngineDiscovery, watch, worker_urls


def dns(answers: dict[str, list[str] | BaseException]) -> EngineDiscovery:
    async def resolver(host: str, port: int) -> list[str]:
        answer = answers[host]
        if isinstance(answer, BaseException):
            raise answer
        return answer

    config = DiscoveryConfig(source="dns", dns_address="engine:30000", timeout_seconds=0.5, max_engines=3)
    return EngineDiscovery(config, [], resolver=resolver)


def test_every_address_of_the_name_is_an_engine_once():
    discovery = dns({"engine": ["10.0.0.2", "10.0.0.1", "10.0.0.2", "fd00::5"]})
    urls = asyncio.run(discovery.lookup())
    assert urls == ["http://10.0.0.2:30000", "http://10.0.0.1:30000", "http://[fd00::5]:30000"]
    assert discovery.status.error == "" and discovery.status.looked_up_at > 0


def test_a_name_without_records_is_no_engine_not_a_failure():
    # A headless Service with no ready pod has no record.
    discovery = dns({"engine": socket.gaierror(socket.EAI_NONAME, "Name or service not known")})
    assert asyncio.run(discovery.lookup()) == []


def test_a_failed_lookup_says_why():
    discovery = dns({"engine": socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")})
    with pytest.raises(DiscoveryFailed, match="Temporary failure"):
        asyncio.run(discovery.lookup())
    assert "Temporary failure" in discovery.status.error


def test_a_lookup_has_a_deadline():
    async def hangs(host, port):
        await asyncio.sleep(60)

    config = DiscoveryConfig(source="dns", dns_address="engine:30000", timeout_seconds=0.05)
    discovery = EngineDiscovery(config, [], resolver=hangs)
    with pytest.raises(DiscoveryFailed, match="no answer within 0.05 s"):
        asyncio.run(discovery.lookup())


def test_more_engines_than_the_bound_are_refused():
    discovery = dns({"engine": [f"10.0.0.{i}" for i in range(1, 5)]})
    with pytest.raises(DiscoveryFailed, match=r"found 4 engines, more than max_engines \(3\)"):
        asyncio.run(discovery.lookup())


def test_watching_keeps_the_engines_found_before_through_a_failed_lookup():
    answers: dict = {"engine": ["10.0.0.1"]}
    discovery = dns(answers)
    discovery.config.interval_seconds = 0.01
    applied: list[list[str]] = []

    async def scenario():
        task = asyncio.create_task(watch(discovery, applied.append))
        while not applied:
            await asyncio.sleep(0.01)
        answers["engine"] = OSError("resolver unreachable")
        while "resolver unreachable" not in discovery.status.error:
            await asyncio.sleep(0.01)
        failed_at = len(applied)
        answers["engine"] = ["10.0.0.1", "10.0.0.2"]
        while applied[-1] != ["http://10.0.0.1:30000", "http://10.0.0.2:30000"]:
            await asyncio.sleep(0.01)
        task.cancel()
        return failed_at

    failed_at = asyncio.run(scenario())
    # While the lookup failed nothing was applied: the pool kept what it had.
    assert all(urls == ["http://10.0.0.1:30000"] for urls in applied[:failed_at])
    assert discovery.status.error == ""


def test_the_static_list_is_engine_urls():
    discovery = EngineDiscovery(DiscoveryConfig(), ["http://a:1/", "http://b:2", "http://a:1"])
    assert not discovery.dynamic
    assert asyncio.run(discovery.lookup()) == ["http://a:1", "http://b:2"]


LIST_WORKERS = b'{"urls": ["http://10.0.0.1:30000", "http://10.0.0.2:30000"]}'
WORKERS = b'{"workers": [{"url": "http://10.0.0.1:30000", "model_id": "m"}, {"url": "http://10.0.0.2:30000"}]}'


@pytest.mark.parametrize("body", [LIST_WORKERS, WORKERS], ids=["list_workers", "workers"])
def test_a_routers_worker_list_in_either_shape(body):
    assert worker_urls(body) == ["http://10.0.0.1:30000", "http://10.0.0.2:30000"]


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"<html>", "not JSON"),
        (b'{"items": []}', 'neither "urls" nor "workers"'),
        (b'{"urls": ["file:///etc/passwd"]}', "not an http"),
        (b'{"urls": [3]}', "not an http"),
    ],
)
def test_a_worker_list_that_is_not_one_is_refused(body, reason):
    with pytest.raises(DiscoveryFailed, match=reason):
        worker_urls(body)


@pytest.mark.parametrize(
    ("discovery", "reason"),
    [
        ({"source": "dns"}, "needs dns_address as host:port"),
        ({"source": "dns", "dns_address": "engine"}, "needs dns_address as host:port"),
        ({"source": "dns", "dns_address": "engine:99999"}, "needs dns_address as host:port"),
        ({"source": "router"}, "needs list_url"),
        ({"source": "router", "list_url": "router:30000"}, "needs list_url"),
        ({"source": "consul"}, "source"),
        ({"source": "dns", "dns_address": "engine:30000", "max_engines": 0}, "max_engines"),
    ],
)
def test_a_configuration_that_cannot_work_is_refused(discovery, reason):
    with pytest.raises(ValidationError, match=reason):
        Settings(engine_discovery=discovery)


def test_a_router_url_and_discovery_are_one_or_the_other():
    with pytest.raises(ValidationError, match="cannot be used with it"):
        Settings(router_url="http://router:30000", engine_discovery={"source": "dns", "dns_address": "engine:30000"})

"""The URL policy of remote reward services: which addresses the reward service may call.
Link-local and metadata addresses never; loopback and private ones only where the operator
allows them; every address a name resolves to is judged. Names resolve through the
system's resolver (localhost from /etc/hosts); made-up names go through a stand-in
resolver, the one thing faked here."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from rlmesh.reward.config import Settings
from rlmesh.reward.url_policy import Refused, Unresolvable, UrlPolicy
from tests.helpers.dns import fake_dns

NEVER = (
    "http://169.254.169.254/latest/meta-data/",  # cloud metadata (link-local)
    "http://169.254.170.2/v2/credentials",
    "http://[fe80::1]:8000/score",
    "http://[fd00:ec2::254]/latest/meta-data/",  # AWS IPv6 metadata
    "http://100.100.100.200/latest/meta-data/",  # Alibaba metadata
    "http://metadata.google.internal/computeMetadata/v1/",
    "http://METADATA.google.internal./computeMetadata/v1/",
    "http://0.0.0.0:8000/score",
    "http://[::]:8000/score",
    "http://0.1.2.3/score",
    "http://224.0.0.1/score",  # multicast
    "http://[ff02::1]/score",
    "http://255.255.255.255/score",
    "http://[::ffff:169.254.169.254]/score",  # IPv4-mapped
    "http://[2002:a9fe:a9fe::1]/score",  # 6to4 around 169.254.169.254
    "grpc://169.254.169.254:50053",
)
PRIVATE = (
    "http://127.0.0.1:8000/score",
    "http://127.1.2.3/score",
    "http://[::1]:8000/score",
    "http://localhost:8000/score",
    "http://10.1.2.3/score",
    "http://172.16.0.1/score",
    "http://192.168.1.1/score",
    "http://100.64.0.1/score",
    "http://[fc00::1]/score",
    "http://[::ffff:127.0.0.1]:8000/score",
    "http://2130706433/score",  # 127.0.0.1 as one number
    "grpc://10.0.0.5:50053",
)


def resolve(policy: UrlPolicy, url: str, timeout: float = 5.0) -> list[str]:
    return asyncio.run(policy.resolve(url, timeout))


@pytest.mark.parametrize("url", NEVER)
def test_link_local_and_metadata_addresses_are_never_called(url):
    for policy in (UrlPolicy(), UrlPolicy(["0.0.0.0/0", "::/0", "169.254.0.0/16", "metadata.google.internal"])):
        with pytest.raises(Refused, match="never calls"):
            resolve(policy, url)


@pytest.mark.parametrize("url", PRIVATE)
def test_loopback_and_private_addresses_only_where_allowed(url):
    with pytest.raises(Refused, match="remote_allowed_networks"):
        resolve(UrlPolicy(), url)
    assert resolve(
        UrlPolicy(["127.0.0.0/8", "::1", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "fc00::/7"]),
        url,
    )


def test_an_allowance_covers_what_it_names_only():
    policy = UrlPolicy(["10.0.0.0/24"])
    assert resolve(policy, "http://10.0.0.7/score") == ["10.0.0.7"]
    with pytest.raises(Refused, match="a private"):
        resolve(policy, "http://10.0.1.7/score")
    with pytest.raises(Refused, match="a loopback address"):
        resolve(policy, "http://127.0.0.1/score")
    assert resolve(UrlPolicy(["127.0.0.1"]), "http://[::ffff:127.0.0.1]/score")  # a mapped address is its IPv4 one


def test_public_addresses_need_no_allowance():
    assert resolve(UrlPolicy(), "http://8.8.8.8/score") == ["8.8.8.8"]
    assert resolve(UrlPolicy(), "grpc://[2606:4700::1111]:50053") == ["2606:4700::1111"]


@pytest.fixture
def dns(monkeypatch):
    return fake_dns(monkeypatch)


def test_a_name_is_judged_by_every_address_it_resolves_to(dns):
    dns["judge.example"] = ["93.184.216.34"]
    dns["sneaky.example"] = ["93.184.216.34", "169.254.169.254"]  # one bad address refuses the name
    dns["internal.example"] = ["10.0.0.9"]
    assert resolve(UrlPolicy(), "https://judge.example/score") == ["93.184.216.34"]
    with pytest.raises(Refused, match="sneaky.example resolves to a link-local address"):
        resolve(UrlPolicy(["0.0.0.0/0"]), "https://sneaky.example/score")
    with pytest.raises(Refused, match="internal.example resolves to a private"):
        resolve(UrlPolicy(), "http://internal.example/score")
    with pytest.raises(Refused, match="a loopback address"):
        resolve(UrlPolicy(), "http://localhost:8000/score")  # /etc/hosts: 127.0.0.1


def test_a_host_name_allowance_allows_that_name_only(dns):
    dns["judge.internal"] = ["10.0.0.9"]
    dns["other.internal"] = ["10.0.0.9"]
    dns["rebound.internal"] = ["169.254.169.254"]
    policy = UrlPolicy(["judge.internal", "rebound.internal"])
    assert resolve(policy, "http://Judge.Internal:8000/score") == ["10.0.0.9"]
    with pytest.raises(Refused):
        resolve(policy, "http://other.internal:8000/score")
    with pytest.raises(Refused, match="never calls"):  # an allowed name still never reaches link-local
        resolve(policy, "http://rebound.internal:8000/score")


def test_a_name_that_does_not_resolve():
    with pytest.raises(Unresolvable, match="cannot resolve no-such-host.invalid"):
        resolve(UrlPolicy(), "http://no-such-host.invalid/score")


def test_the_setting_is_checked_when_the_service_starts():
    assert Settings(remote_allowed_networks=["10.0.0.0/8", "::1", "judge.internal"]).remote_allowed_networks
    with pytest.raises(ValidationError, match="neither a network"):
        Settings(remote_allowed_networks=["10.0.0.0/33"])
    with pytest.raises(ValidationError, match="neither a network"):
        Settings(remote_allowed_networks=["not a host"])
    assert Settings().remote_allowed_networks == []  # default: public addresses only

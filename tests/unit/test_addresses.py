"""Address forms (one, a list, commas, dns:///) and rendezvous placement; no daemon needed."""

from __future__ import annotations

import socket
from collections import Counter

import pytest
from support.cluster import inject_dns

from loaderd.errors import LoaderdError
from loaderd.server.config.schema import DEFAULT_LISTEN
from loaderd.wire.addresses import ADDRESS_ENV, DEFAULT_ADDRESS, parse_target, single_address
from loaderd.wire.rendezvous import rendezvous

pytestmark = pytest.mark.timeout(30)


def test_one_address_as_before() -> None:
    target = parse_target("tcp://127.0.0.1:7070")
    assert target.fixed == ("127.0.0.1:7070",) and not target.dynamic
    assert parse_target("unix:///tmp/x.sock").fixed == ("unix:///tmp/x.sock",)
    assert parse_target("[::1]:7070").fixed == ("[::1]:7070",)


def test_lists_and_commas_are_the_same_and_deduplicated() -> None:
    a = parse_target(["10.0.0.1:7070", "10.0.0.2:7070,10.0.0.1:7070"])
    b = parse_target(" 10.0.0.1:7070 , 10.0.0.2:7070,")
    assert a.fixed == b.fixed == ("10.0.0.1:7070", "10.0.0.2:7070")


def test_environment_takes_the_same_forms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ADDRESS_ENV, "dns:///loaderd.ns.svc:7070,10.0.0.9:7070")
    target = parse_target(None)
    assert target.names == (("loaderd.ns.svc", 7070),) and target.fixed == ("10.0.0.9:7070",)
    monkeypatch.delenv(ADDRESS_ENV)
    # Neither: where `loaderd serve` listens when its config has no listen:.
    assert parse_target(None).fixed == parse_target("").fixed == (DEFAULT_ADDRESS,) == DEFAULT_LISTEN


@pytest.mark.parametrize("text", ["dns:///name", "dns:///name:0", "dns:///:7070", "dns:///name:http", ","])
def test_malformed_addresses_are_refused(text: str) -> None:
    with pytest.raises(LoaderdError):
        parse_target(text)


def test_dns_names_resolve_to_every_record_each_time() -> None:
    answer = ["127.0.0.2"]
    with inject_dns("svc.test.invalid", lambda: list(answer)):
        target = parse_target("dns:///svc.test.invalid:7070")
        assert target.dynamic
        assert target.resolve().addresses == ("127.0.0.2:7070",)
        answer.append("127.0.0.3")
        assert target.resolve().addresses == ("127.0.0.2:7070", "127.0.0.3:7070")
        answer.clear()
        resolved = target.resolve()
        assert resolved.addresses == () and "did not resolve" in resolved.problems[0]
        assert parse_target("dns://8.8.8.8/svc.test.invalid:7070").names == (("svc.test.invalid", 7070),)


def test_ipv6_records_are_bracketed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        socket, "getaddrinfo", lambda *a, **k: [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fd00::5", 7070, 0, 0))]
    )
    assert parse_target("dns:///v6.test:7070").resolve().addresses == ("[fd00::5]:7070",)


def test_single_address_for_tools() -> None:
    assert single_address("a:1,b:2") == "a:1"
    with inject_dns("one.test.invalid", lambda: ["127.0.0.5"]):
        assert single_address("dns:///one.test.invalid:9") == "127.0.0.5:9"


def test_rendezvous_agrees_everywhere_and_moves_only_what_it_must() -> None:
    addresses = [f"10.0.0.{i}:7070" for i in range(1, 5)]
    keys = [f"share-{i}" for i in range(400)]
    placed = {k: rendezvous(k, addresses) for k in keys}
    assert placed == {k: rendezvous(k, list(reversed(addresses))) for k in keys}  # order does not matter
    spread = Counter(placed.values())
    assert min(spread.values()) > 60, spread  # 100 each on average
    gone = addresses[1]
    after = {k: rendezvous(k, [a for a in addresses if a != gone]) for k in keys}
    moved = [k for k in keys if after[k] != placed[k]]
    assert moved and all(placed[k] == gone for k in moved)


@pytest.mark.parametrize("text", ["http://127.0.0.1:7070", "https://loaderd.example:443/", "grpc://h:1", "127.0.0.1:1,HTTP://h:2"])
def test_a_scheme_loaderd_does_not_speak_is_refused_at_once(text: str) -> None:
    with pytest.raises(LoaderdError, match=r"loaderd speaks gRPC, not (http|https|grpc|HTTP); write [^ ]+ \(host:port"):
        parse_target(text)
    assert parse_target("tcp://h:1,unix:///x.sock").fixed == ("h:1", "unix:///x.sock")

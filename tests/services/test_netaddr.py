"""services/netaddr.py: endpoints, loopback, the route towards etcd, interface addresses,
and the advertised host's default (never loopback with a remote etcd)."""

import pytest

from services import netaddr


def test_endpoints_parse_and_refuse_naming_the_value():
    assert netaddr.split_endpoint("10.0.0.1:2379") == ("10.0.0.1", 2379)
    assert netaddr.split_endpoint("[::1]:2379") == ("::1", 2379)
    assert netaddr.split_endpoints("h1:2379, h2:2379,h3:2380") == [("h1", 2379), ("h2", 2379), ("h3", 2380)]
    for bad in ("h1", "h1:", ":2379", "h1:99999", "h1:x"):
        with pytest.raises(ValueError, match="expected host:port"):
            netaddr.split_endpoint(bad)
    with pytest.raises(ValueError, match="expected host:port"):
        netaddr.split_endpoints(" , ")


def test_loopback_and_wildcard():
    assert all(netaddr.is_loopback(h) for h in ("127.0.0.1", "127.0.0.3", "localhost", "::1", "[::1]"))
    assert not any(netaddr.is_loopback(h) for h in ("10.0.0.1", "etcd.example", "0.0.0.0"))
    assert netaddr.is_wildcard("0.0.0.0") and netaddr.is_wildcard("::") and not netaddr.is_wildcard("127.0.0.1")


def test_route_source_and_interfaces_on_loopback():
    # Linux routes all of 127/8 through lo, whose address is 127.0.0.1.
    assert netaddr.route_source_address("127.0.0.5") == "127.0.0.1"
    assert netaddr.interface_address("lo") == "127.0.0.1"
    assert netaddr.interface_of("127.0.0.1") == "lo"
    assert netaddr.interface_of("127.0.0.2") is None  # routed to lo, not an address of it
    with pytest.raises(ValueError, match="interface 'nosuch0' has no IPv4 address.*interfaces here: .*lo"):
        netaddr.interface_address("nosuch0")


def test_default_advertise_host_with_a_local_etcd():
    assert netaddr.default_advertise_host("0.0.0.0", ["127.0.0.1"]) == "127.0.0.1"
    assert netaddr.default_advertise_host("127.0.0.2", ["127.0.0.1"]) == "127.0.0.2"


def test_default_advertise_host_with_a_remote_etcd_is_the_route_source(monkeypatch):
    asked = []
    monkeypatch.setattr(netaddr, "route_source_address", lambda host: asked.append(host) or "10.0.0.7")
    assert netaddr.default_advertise_host("0.0.0.0", ["127.0.0.1", "10.0.0.1"]) == "10.0.0.7"
    assert asked == ["10.0.0.1"]  # the first remote endpoint
    assert netaddr.default_advertise_host("10.0.0.9", ["10.0.0.1"]) == "10.0.0.9"  # a specific bind wins


def test_default_advertise_host_is_never_loopback_with_a_remote_etcd(monkeypatch):
    with pytest.raises(ValueError, match="etcd at '10.0.0.1' is on another host.*loopback address '127.0.0.1'"):
        netaddr.default_advertise_host("127.0.0.1", ["10.0.0.1"])
    monkeypatch.setattr(netaddr, "route_source_address", lambda host: "127.0.0.1")  # only lo is up
    with pytest.raises(ValueError, match="loopback address '127.0.0.1', which peers cannot reach"):
        netaddr.default_advertise_host("0.0.0.0", ["10.0.0.1"])

    def no_route(host):
        raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(netaddr, "route_source_address", no_route)
    with pytest.raises(ValueError, match="towards etcd host '10.0.0.1'.*unreachable.*pass --advertise-host"):
        netaddr.default_advertise_host("0.0.0.0", ["10.0.0.1"])

"""Every role's address flags (services/settings.MemberConfig): --bind-host (alias of --host),
--advertise-host and their defaults, several etcd endpoints, and the errors that name the value."""

import pytest

from expert_svc.config import ExpertConfig
from router_svc.config import RouterConfig
from services import netaddr, settings
from services.settings import MemberConfig


def parse(*argv, cls=RouterConfig):
    return settings.parse_config(cls, ["--member-id", "m0", *argv], env={})


def test_bind_host_is_an_alias_of_host_and_both_advertise_the_bound_address():
    assert parse("--bind-host", "127.0.0.2").host == "127.0.0.2"
    config = parse("--host", "127.0.0.3")
    assert (config.host, config.advertise_host, config.address(5)) == ("127.0.0.3", "127.0.0.3", "127.0.0.3:5")
    assert settings.parse_config(RouterConfig, ["--member-id", "m0"], env={"MOEMESH_HOST": "127.0.0.4"}).host \
        == "127.0.0.4"


def test_defaults_with_a_local_etcd_stay_on_loopback():
    config = parse()
    assert (config.host, config.advertise_host) == ("127.0.0.1", "127.0.0.1")
    assert parse("--host", "0.0.0.0").address(7) == "127.0.0.1:7"


def test_defaults_with_a_remote_etcd_bind_everything_and_advertise_the_route_to_etcd(monkeypatch):
    monkeypatch.setattr(netaddr, "route_source_address", lambda host: {"10.0.0.1": "10.0.0.7"}[host])
    config = parse("--etcd", "10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379")
    assert (config.host, config.advertise_host, config.address(9)) == ("0.0.0.0", "10.0.0.7", "10.0.0.7:9")
    explicit = parse("--etcd", "10.0.0.1:2379", "--advertise-host", "10.0.0.8")
    assert (explicit.host, explicit.advertise_host) == ("0.0.0.0", "10.0.0.8")


def test_an_advertised_non_loopback_host_binds_every_interface_even_with_a_local_etcd():
    config = parse("--advertise-host", "192.0.2.10")
    assert (config.host, config.public_host) == ("0.0.0.0", "192.0.2.10")
    assert parse("--advertise-host", "::1").public_host == "[::1]"


@pytest.mark.parametrize("argv,needle", [
    (["--etcd", "10.0.0.1:2379", "--bind-host", "127.0.0.1"],
     "host (--bind-host) '127.0.0.1' is a loopback address but etcd at '10.0.0.1' is on another host"),
    (["--etcd", "10.0.0.1:2379", "--advertise-host", "127.0.0.1"],
     "advertise_host '127.0.0.1' is a loopback address but etcd at '10.0.0.1' is on another host"),
    (["--etcd", "h1:2379,h2"], "etcd must be host:port[,host:port...], got 'h1:2379,h2'"),
    (["--etcd-connect-timeout-s", "0"], "etcd_connect_timeout_s must be > 0, got 0.0"),
])
def test_bad_addresses_are_usage_errors_naming_the_value(argv, needle, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse(*argv)
    assert exit_info.value.code == 2
    assert needle in capsys.readouterr().err


def test_every_role_config_has_the_flags():
    for cls in (RouterConfig, ExpertConfig):
        text = settings.build_parser(cls, env={}).format_help()
        assert "--bind-host" in text and "--host" in text and "--advertise-host" in text
    assert issubclass(ExpertConfig, MemberConfig)

"""What an expert service registers for the scheduler's compatibility check, and its
collective interface (--ep-interface)."""

import dataclasses
import inspect
import os

import pytest

from expert_svc import config as expert_config
from expert_svc import rendezvous
from expert_svc.config import ExpertConfig
from services.model.config import ModelConfig
from services.model.make_model import PRESETS


def _tiny() -> ModelConfig:
    return PRESETS["tiny"]


def test_every_field_that_must_match_across_ranks_is_in_the_group_settings():
    source = inspect.getsource(ExpertConfig)
    noted = set()
    pending = ""
    for line in source.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            pending += " " + stripped
        elif ":" in stripped and pending:
            if "same on every rank" in pending.lower():
                noted.add(stripped.split(":")[0])
            pending = ""
    assert noted and noted <= set(expert_config.SAME_ON_EVERY_RANK)


def test_group_settings_differ_with_the_model_and_the_flags():
    base = ExpertConfig(member_id="e0", model="m")
    mc = _tiny()
    settings = base.group_settings(mc)
    assert settings["backend"] == "gloo" and settings["dtype"] == "float32"
    assert settings == ExpertConfig(member_id="e1", model="other/path", kv_blocks=9).group_settings(mc)
    assert settings != ExpertConfig(member_id="e0", model="m", max_fixed_capacity_tokens=16).group_settings(mc)
    other = dataclasses.replace(mc, num_experts=mc.num_experts * 2)
    assert settings["model_config"] != base.group_settings(other)["model_config"]


def test_ep_interface_gives_the_advertised_host_and_the_collective_interface():
    config = ExpertConfig(member_id="e0", model="m", ep_interface="lo")
    assert (config.advertise_host, config.collective_interface) == ("127.0.0.1", "lo")
    assert ExpertConfig(member_id="e0", model="m").collective_interface is None  # loopback: the libraries' choice
    bound = ExpertConfig(member_id="e0", model="m", ep_interface="lo", host="127.0.0.3")
    assert (bound.advertise_host, bound.collective_interface) == ("127.0.0.3", "lo")  # a specific bind host wins
    with pytest.raises(ValueError, match="interface 'nosuch0' has no IPv4 address"):
        ExpertConfig(member_id="e0", model="m", ep_interface="nosuch0")


def test_use_interface_sets_gloo_and_nccl_unless_the_operator_did(monkeypatch):
    # Set, then deleted: monkeypatch restores only what it saw, and use_interface sets both.
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "unset")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    rendezvous.use_interface("eth1", override=False)
    assert (os.environ["GLOO_SOCKET_IFNAME"], os.environ["NCCL_SOCKET_IFNAME"]) == ("eth1", "ib0")
    rendezvous.use_interface("eth2", override=True)  # --ep-interface wins
    assert (os.environ["GLOO_SOCKET_IFNAME"], os.environ["NCCL_SOCKET_IFNAME"]) == ("eth2", "eth2")

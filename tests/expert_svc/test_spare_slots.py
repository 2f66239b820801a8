"""--num-spare-expert-slots: explicit counts, and `auto` sized from the KV budget and capped by the policy."""

import pytest

import math

from expert_svc.config import ExpertConfig
from expert_svc.spare_slots import HOT_EXPERTS, KV_SHARE, MAX_COPIES, auto_spare_slots, parse_setting, slots_cap
from moemesh import cli, launcher
from router_svc.config import RouterConfig

MIB = 2**20


def test_settings_parse_auto_or_a_count_and_quote_a_bad_value():
    assert parse_setting("auto") is None and parse_setting("AUTO") is None
    assert parse_setting("0") == 0 and parse_setting("3") == 3
    for bad in ("-1", "two", ""):
        with pytest.raises(ValueError, match=f"got {bad!r}"):
            parse_setting(bad)


def test_expert_config_defaults_to_auto_and_keeps_explicit_counts():
    assert ExpertConfig(member_id="e", model="m").fixed_spare_slots is None
    assert ExpertConfig(member_id="e", model="m", num_spare_expert_slots="2").fixed_spare_slots == 2
    with pytest.raises(ValueError, match="num_spare_expert_slots"):
        ExpertConfig(member_id="e", model="m", num_spare_expert_slots="-1")


def test_one_rank_gets_none_whatever_the_memory():
    chosen = auto_spare_slots(num_experts=128, num_ranks=1, kv_budget_bytes=10**12, slot_bytes=MIB)
    assert chosen.num_slots == 0 and "one rank" in chosen.reason


@pytest.mark.parametrize("num_experts, num_ranks, cap", [(8, 2, 4), (128, 2, 5), (128, 4, 5), (128, 8, 3)])
def test_the_cap_covers_the_default_policy(num_experts, num_ranks, cap):
    # 9 experts above 10%, each at most 3 copies (one a rank), spread over the ranks;
    # never more than the experts the rank does not hold.
    assert slots_cap(num_experts, num_ranks) == cap


def test_auto_takes_at_most_its_share_of_the_kv_budget():
    # Qwen3-30B-A3B in bf16: 48 layers x 3 x 2048 x 768 x 2 bytes a slot.
    slot = 48 * 3 * 2048 * 768 * 2
    roomy = auto_spare_slots(num_experts=128, num_ranks=2, kv_budget_bytes=80 * 2**30, slot_bytes=slot)
    assert roomy.num_slots == slots_cap(128, 2)
    tight = auto_spare_slots(num_experts=128, num_ranks=2, kv_budget_bytes=10 * 2**30, slot_bytes=slot)
    assert tight.num_slots == int(10 * 2**30 * KV_SHARE) // slot == 2
    assert tight.num_slots * slot <= KV_SHARE * 10 * 2**30
    assert auto_spare_slots(num_experts=128, num_ranks=2, kv_budget_bytes=0, slot_bytes=slot).num_slots == 0


def test_the_router_defaults_are_the_documented_thresholds_and_the_cap_follows_them():
    cfg = RouterConfig(member_id="r")
    assert (cfg.scale_up_hit_rate, cfg.scale_up_window_s, cfg.max_replicas) == (0.10, 300.0, 3)
    assert (cfg.scale_down_hit_rate, cfg.scale_down_window_s) == (0.03, 600.0)
    assert HOT_EXPERTS == math.ceil(1 / cfg.scale_up_hit_rate) - 1 and MAX_COPIES == cfg.max_replicas


def test_moemesh_up_passes_auto_unless_told_otherwise(tiny_model_dir):
    args = cli.build_parser().parse_args(["up"])
    assert args.num_spare_expert_slots == "auto"
    assert cli.build_parser().parse_args(["up", "--num-spare-expert-slots", "0"]).num_spare_expert_slots == "0"
    assert launcher.MeshSpec(model_dir=str(tiny_model_dir)).num_spare_expert_slots == "auto"
    with pytest.raises(ValueError, match="num-spare-expert-slots"):
        launcher.MeshSpec(model_dir=str(tiny_model_dir), num_spare_expert_slots="lots")


class _Comm:
    def __init__(self, world_size: int):
        self.world_size = world_size


@pytest.mark.parametrize("kv_memory_bytes, world_size, expected", [
    (256 * MIB, 2, 4),  # the CPU default: the cap (the 4 experts rank 0 does not hold)
    (20 * 3 * (3 * 64 * 32 * 4), 2, 2),  # 10% of it holds two tiny slots (3 MoE layers of 3 x 64 x 32 fp32)
    (256 * MIB, 1, 0),
])
def test_the_builder_sizes_auto_from_the_cpu_kv_memory(kv_memory_bytes, world_size, expected, caplog):
    from expert_svc.model_builder import ModelBuilder
    from services.model.random_weights import RandomWeights

    builder = ModelBuilder(ExpertConfig(member_id="e", random_weights="tiny", kv_memory_bytes=kv_memory_bytes))
    experts = range(8 // world_size)
    weights = RandomWeights(builder.model_config, experts, 0, dtype=builder.dtype)
    assert builder.slot_bytes(weights, experts) == 3 * 3 * 64 * 32 * 4
    with caplog.at_level("INFO", logger="expert_svc"):
        assert builder.spare_slots(weights, experts, _Comm(world_size)) == expected
    assert f"--num-spare-expert-slots auto: {expected} spare slots" in caplog.text
    explicit = ModelBuilder(ExpertConfig(member_id="e", random_weights="tiny", num_spare_expert_slots="1"))
    assert explicit.spare_slots(weights, experts, _Comm(world_size)) == 1

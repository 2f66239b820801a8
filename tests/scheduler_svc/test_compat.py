"""Which experts may share a group (scheduler_svc/compat.py) and how the planner applies it:
mismatched model or settings, and a group size that does not divide the experts, are refused
with messages naming the members and both values."""

from scheduler_svc import compat
from scheduler_svc.planner import RepairPolicy, plan_groups
from services.cluster import GroupAssignment, Member, RankInfo

SETTINGS = {"model_config": "aaaa", "backend": "gloo", "max_fixed_capacity_tokens": 256}


def expert(member_id: str, num_experts: int = 8, **changes) -> Member:
    info = {"rendezvous_port": 29500, "num_experts": num_experts, "group_settings": {**SETTINGS, **changes}}
    return Member(member_id, "expert", f"10.0.0.{member_id[-1]}:9000", info)


def gateway(member_id: str = "w0") -> Member:
    return Member(member_id, "gateway", "10.0.1.1:8000")


def test_mismatched_settings_are_not_grouped_and_the_refusal_names_both_values():
    members = [expert("e0"), expert("e1", max_fixed_capacity_tokens=16), gateway()]
    plan = plan_groups(members, [], group_size=2, term=1)
    assert plan.put == []
    [refusal] = plan.refusals
    assert refusal == ("experts e1 cannot share a group with e0: their model or settings differ: "
                       "max_fixed_capacity_tokens 256 (e0) != 16 (e1)")


def test_a_different_model_is_named_too():
    a, b = expert("e0"), expert("e1", model_config="bbbb")
    assert compat.difference(a, b) == "model_config 'aaaa' (e0) != 'bbbb' (e1)"


def test_compatible_experts_group_around_an_odd_one():
    members = [expert("e0"), expert("e1", model_config="bbbb"), expert("e2"), gateway()]
    plan = plan_groups(members, [], group_size=2, term=1)
    assert [[r.member_id for r in g.ranks] for g in plan.put] == [["e0", "e2"]]
    assert plan.refusals == ["experts e1 cannot share a group with e0: their model or settings differ: "
                             "model_config 'aaaa' (e0) != 'bbbb' (e1)"]


def test_a_group_size_that_does_not_divide_the_experts_is_refused():
    members = [expert("e0", num_experts=8), expert("e1", num_experts=8), expert("e2", num_experts=8), gateway()]
    plan = plan_groups(members, [], group_size=3, term=1)
    assert plan.put == []
    assert plan.refusals[0] == ("expert e0 cannot join a group: the group size 3 does not divide its model's 8 "
                                "experts (--group-size of the schedulers, --ranks of `moemesh up`)")
    assert len(plan.refusals) == 3


def test_a_standby_with_other_settings_does_not_replace_a_rank():
    e0, e1 = expert("e0"), expert("e1")
    group = GroupAssignment(group_id="g0", epoch=1, term=1, world_size=2, rendezvous_address="10.0.0.0:29500",
                            ranks=[RankInfo(0, "e0", e0.address), RankInfo(1, "e1", e1.address)], gateway_id="w0")
    odd, good = expert("e2", backend="nccl"), expert("e3")
    plan = plan_groups([e0, odd, gateway()], [group], group_size=2, term=2, repair=RepairPolicy(now=0.0))
    assert plan.put == [] and plan.waiting_since == {"g0": 0.0}  # waits rather than take e2
    plan = plan_groups([e0, odd, good, gateway()], [group], group_size=2, term=2, repair=RepairPolicy(now=0.0))
    assert [r.member_id for r in plan.put[0].ranks] == ["e0", "e3"]


def test_experts_without_settings_still_group_with_each_other():
    plain = [Member(f"e{i}", "expert", f"10.0.0.{i}:9000", {"rendezvous_port": 29500}) for i in range(2)]
    plan = plan_groups([*plain, gateway()], [], group_size=2, term=1)
    assert [r.member_id for r in plan.put[0].ranks] == ["e0", "e1"] and plan.refusals == []

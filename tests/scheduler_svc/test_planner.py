"""The group planner: pure, no etcd."""

import dataclasses

import pytest

from scheduler_svc.planner import RepairPolicy, plan_groups
from services.cluster import GroupAssignment, Member, RankInfo


def expert(member_id: str, port: int = 9000, rendezvous_port: int | None = 29500) -> Member:
    info = {} if rendezvous_port is None else {"rendezvous_port": rendezvous_port}
    return Member(member_id, "expert", f"10.0.0.{member_id[-1]}:{port}", info)


def gateway(member_id: str) -> Member:
    return Member(member_id, "gateway", f"10.0.1.{member_id[-1]}:8000")


def group_of(group_id: str, experts: list[Member], gateway_id: str | None, term: int = 5) -> GroupAssignment:
    return GroupAssignment(
        group_id=group_id, epoch=1, term=term, world_size=len(experts),
        rendezvous_address=f"{experts[0].host}:29500",
        ranks=[RankInfo(i, m.member_id, m.address) for i, m in enumerate(experts)],
        gateway_id=gateway_id,
    )


def test_forms_group_of_first_experts_by_id_with_rank0_rendezvous():
    members = [expert("e2"), expert("e0", rendezvous_port=29600), expert("e1"), gateway("w0")]
    plan = plan_groups(members, [], group_size=2, term=7)
    assert plan.delete == []
    [group] = plan.put
    assert group.group_id == "g0"
    assert group.epoch == 1 and group.term == 7 and group.world_size == 2
    assert [(r.rank, r.member_id, r.address) for r in group.ranks] == [
        (0, "e0", "10.0.0.0:9000"), (1, "e1", "10.0.0.1:9000")]
    assert group.rendezvous_address == "10.0.0.0:29600"
    assert group.gateway_id == "w0"


def test_no_group_without_enough_experts_or_without_gateway():
    assert plan_groups([expert("e0"), gateway("w0")], [], group_size=2, term=1).is_empty
    assert plan_groups([expert("e0"), expert("e1")], [], group_size=2, term=1).is_empty


def test_forms_as_many_groups_as_gateways_allow():
    members = [expert(f"e{i}") for i in range(5)] + [gateway("w1"), gateway("w0")]
    plan = plan_groups(members, [], group_size=2, term=3)
    assert [(g.group_id, g.gateway_id, [r.member_id for r in g.ranks]) for g in plan.put] == [
        ("g0", "w0", ["e0", "e1"]), ("g1", "w1", ["e2", "e3"])]


def test_stable_state_plans_nothing():
    e0, e1 = expert("e0"), expert("e1")
    existing = [group_of("g0", [e0, e1], "w0")]
    assert plan_groups([e0, e1, gateway("w0")], existing, group_size=2, term=9).is_empty


def test_rank_gone_without_standby_waits_then_deletes_group_and_frees_the_rest():
    e0, e1, e2 = expert("e0"), expert("e1"), expert("e2")
    existing = [group_of("g0", [e0, e1], "w0")]
    members = [e0, gateway("w0")]
    plan = plan_groups(members, existing, group_size=2, term=9, repair=RepairPolicy(now=100.0))
    assert plan.is_empty and plan.waiting_since == {"g0": 100.0}
    waiting = RepairPolicy(now=129.0, reform_wait_s=30.0, waiting_since=plan.waiting_since)
    assert plan_groups(members, existing, group_size=2, term=9, repair=waiting).is_empty
    expired = RepairPolicy(now=130.0, reform_wait_s=30.0, waiting_since=plan.waiting_since)
    plan = plan_groups(members, existing, group_size=2, term=9, key_epochs=[("g0", 1)], repair=expired)
    assert plan.delete == ["g0"] and plan.put == [] and plan.waiting_since == {}
    assert plan.stale_epochs == [("g0", 1)]
    # Once enough experts are back, a new group forms; the id is not reused in
    # the same plan (one transaction cannot both delete and put a key).
    plan = plan_groups([e0, e2, gateway("w0")], existing, group_size=2, term=9, repair=expired)
    assert plan.delete == []  # e2 is a standby: g0 is re-formed instead
    plan = plan_groups([e0, expert("e2", rendezvous_port=None), expert("e3", rendezvous_port=None),
                        gateway("w0")], existing, group_size=2, term=9, repair=expired)
    assert plan.delete == ["g0"] and plan.put == []


def test_deleted_id_is_reused_in_a_later_plan():
    members = [expert("e0"), expert("e2"), gateway("w0")]
    [group] = plan_groups(members, [], group_size=2, term=9).put
    assert group.group_id == "g0"


def test_rank_gone_is_filled_by_a_standby_in_a_new_epoch():
    e0, e1, e2 = expert("e0"), expert("e1", rendezvous_port=29501), expert("e2", rendezvous_port=29502)
    existing = [group_of("g0", [e0, e1], "w0")]
    plan = plan_groups([e1, e2, gateway("w0")], existing, group_size=2, term=9,
                       key_epochs=[("g0", 1)], repair=RepairPolicy(now=5.0))
    [group] = plan.put
    assert (group.group_id, group.epoch, group.term, group.gateway_id) == ("g0", 2, 9, "w0")
    # The survivor keeps rank 1; the standby takes rank 0 and hosts the rendezvous.
    assert [(r.rank, r.member_id) for r in group.ranks] == [(0, "e2"), (1, "e1")]
    assert group.rendezvous_address == "10.0.0.2:29502"
    assert plan.delete == [] and plan.stale_epochs == [("g0", 1)] and plan.waiting_since == {}


def test_standbys_go_by_member_id_and_each_fills_one_rank():
    e = [expert(f"e{i}") for i in range(6)]
    existing = [group_of("g0", e[0:2], "w0"), group_of("g1", e[2:4], "w1")]
    plan = plan_groups([e[0], e[3], e[5], e[4], gateway("w0"), gateway("w1")], existing, group_size=2, term=9)
    assert [[r.member_id for r in g.ranks] for g in plan.put] == [["e0", "e4"], ["e5", "e3"]]
    assert [g.epoch for g in plan.put] == [2, 2]


def test_restarted_rank_at_new_address_refills_its_own_rank():
    e0, e1, e2 = expert("e0"), expert("e1"), expert("e2")
    existing = [group_of("g0", [e0, e1], "w0")]
    restarted = expert("e1", port=9999)
    plan = plan_groups([e0, restarted, e2, gateway("w0")], existing, group_size=2, term=9)
    [group] = plan.put
    assert group.epoch == 2 and group.ranks[1] == RankInfo(1, "e1", restarted.address)
    assert group.rendezvous_address == existing[0].rendezvous_address


def test_failure_report_with_every_rank_present_reforms_after_the_settle_time():
    e0, e1 = expert("e0"), expert("e1")
    existing = [group_of("g0", [e0, e1], "w0")]
    members = [e0, e1, gateway("w0")]
    first = plan_groups(members, existing, group_size=2, term=9, failed=[("g0", 1)],
                        key_epochs=[("g0", 1)], repair=RepairPolicy(now=10.0, reform_settle_s=3.0))
    assert first.is_empty and first.waiting_since == {"g0": 10.0}
    later = RepairPolicy(now=13.0, reform_settle_s=3.0, waiting_since=first.waiting_since)
    plan = plan_groups(members, existing, group_size=2, term=9, failed=[("g0", 1)], key_epochs=[("g0", 1)],
                       repair=later)
    [group] = plan.put
    assert group.epoch == 2 and group.ranks == existing[0].ranks and plan.stale_epochs == [("g0", 1)]
    # The failure of an old epoch does not break the re-formed group.
    assert plan_groups(members, [group], group_size=2, term=9, failed=[("g0", 1)], repair=later).put == []


def test_a_rank_left_and_the_other_reported_a_failure_reforms_without_waiting():
    e0, e1, e2 = expert("e0"), expert("e1"), expert("e2")
    existing = [group_of("g0", [e0, e1], "w0")]
    plan = plan_groups([e0, e2, gateway("w0")], existing, group_size=2, term=9, failed=[("g0", 1)],
                       repair=RepairPolicy(now=0.0, reform_settle_s=100.0))
    assert [r.member_id for r in plan.put[0].ranks] == ["e0", "e2"]


def test_stale_keys_of_unknown_groups_and_old_epochs_are_deleted():
    e0, e1 = expert("e0"), expert("e1")
    existing = [dataclasses.replace(group_of("g0", [e0, e1], "w0"), epoch=3)]
    plan = plan_groups([e0, e1, gateway("w0")], existing, group_size=2, term=9,
                       key_epochs=[("g0", 2), ("g0", 3), ("g7", 1)])
    assert plan.put == [] and plan.stale_epochs == [("g0", 2), ("g7", 1)] and not plan.is_empty


def test_gateway_gone_keeps_ranks_and_a_free_gateway_takes_over():
    e0, e1 = expert("e0"), expert("e1")
    existing = [group_of("g0", [e0, e1], "w0", term=5)]
    plan = plan_groups([e0, e1], existing, group_size=2, term=9)
    [group] = plan.put
    assert group.gateway_id is None and group.ranks == existing[0].ranks
    assert group.epoch == 1 and group.term == 9

    plan = plan_groups([e0, e1, gateway("w1")], existing, group_size=2, term=9)
    [group] = plan.put
    assert group.gateway_id == "w1" and group.term == 9 and plan.delete == []


def test_unassigned_gateway_goes_to_group_without_one():
    e0, e1 = expert("e0"), expert("e1")
    existing = [group_of("g0", [e0, e1], None)]
    [group] = plan_groups([e0, e1, gateway("w3")], existing, group_size=2, term=9).put
    assert group.group_id == "g0" and group.gateway_id == "w3"


def test_expert_without_rendezvous_port_is_not_placed():
    members = [expert("e0", rendezvous_port=None), expert("e1"), expert("e2"), gateway("w0")]
    plan = plan_groups(members, [], group_size=2, term=1)
    assert plan.unplaceable_ids == ["e0"]
    assert [r.member_id for r in plan.put[0].ranks] == ["e1", "e2"]


def test_bad_group_size_rejected():
    with pytest.raises(ValueError, match="group_size must be >= 1, got 0"):
        plan_groups([], [], group_size=0, term=1)


def _applied(groups: list[GroupAssignment], plan) -> list[GroupAssignment]:
    """The groups after the plan's transaction."""
    by_id = {g.group_id: g for g in groups if g.group_id not in plan.delete}
    by_id.update((g.group_id, g) for g in plan.put)
    return [by_id[i] for i in sorted(by_id)]


E = [expert(f"e{i}") for i in range(5)]
W = [gateway(f"w{i}") for i in range(3)]


@pytest.mark.parametrize("members, groups", [
    ([*E[:4], *W[:2]], []),                                    # two groups form
    ([*E, W[0]], []),                                          # one group, spare experts
    ([*E[:3], expert("e9", rendezvous_port=None), *W], []),   # an unplaceable expert, spare gateways
    ([*E[:4], W[1]], [group_of("g0", E[:2], "w0"), group_of("g1", E[2:4], None)]),  # a gateway left
    ([E[0], E[2], E[3], W[0]], [group_of("g0", E[:2], "w0")]),  # a rank left: a standby fills it
    ([E[0], W[0]], [group_of("g0", E[:2], "w0")]),  # a rank left: the group waits
])
def test_a_new_leader_replans_nothing_once_the_old_one_converged(members, groups):
    """Failover must not touch a healthy group: after the old leader's plan
    (term 5) is written, a new leader (term 9) on the same membership plans
    nothing, so no group is deleted, re-epoched or even rewritten."""
    groups = _applied(groups, plan_groups(members, groups, group_size=2, term=5))
    assert groups, "the scenario should leave at least one group"
    assert plan_groups(members, groups, group_size=2, term=9).is_empty

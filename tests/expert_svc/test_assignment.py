"""A rank's answer to a changed assignment (expert_svc/assignment.py): join once placed at its own
address, ignore a new term, rejoin a new epoch at the same rank where it can, give up otherwise."""

import pytest

from expert_svc.assignment import Action, AssignmentLostError, joined_placement, next_action
from services.cluster import GroupAssignment, RankInfo

ME, ADDRESS = "e1", "10.0.0.2:50051"


def group(epoch: int = 1, *, term: int = 1, world_size: int = 2, address: str = ADDRESS, rank: int = 1,
          group_id: str = "g0") -> GroupAssignment:
    ranks = [RankInfo(r, ME if r == rank else f"x{r}", address if r == rank else f"10.0.1.{r}:1")
             for r in range(world_size)]
    return GroupAssignment(group_id=group_id, epoch=epoch, term=term, world_size=world_size,
                           rendezvous_address="10.0.1.0:29500", ranks=ranks, gateway_id="gw0")


def act(assignment, *, joined=None, loaded=None, can_rejoin=True, num_experts=8) -> Action:
    return next_action(assignment, member_id=ME, address=ADDRESS, num_experts=num_experts, joined=joined,
                       loaded=loaded, can_rejoin=can_rejoin)


def test_a_new_rank_joins_once_placed_at_its_own_address():
    assert act(None) is Action.WAIT
    assert act(group(address="10.0.0.9:50051")) is Action.WAIT  # an earlier process of this member id
    assert act(group()) is Action.JOIN


def test_a_failed_join_is_not_tried_again_in_the_same_epoch_but_in_the_next():
    joined = joined_placement(group(1), ME)
    assert act(group(1, term=2), joined=joined) is Action.WAIT
    assert act(group(2), joined=joined) is Action.JOIN


def test_a_loaded_rank_ignores_a_new_term_and_rejoins_a_new_epoch_where_it_can():
    loaded, joined = ("g0", 1, 2), joined_placement(group(1), ME)
    assert act(group(1, term=5), joined=joined, loaded=loaded) is Action.WAIT
    assert act(group(2), joined=joined, loaded=loaded) is Action.REJOIN
    with pytest.raises(AssignmentLostError):
        act(group(2), joined=joined, loaded=loaded, can_rejoin=False)


@pytest.mark.parametrize("changed", [None, group(2, rank=0), group(2, world_size=4), group(2, group_id="g1"),
                                     group(2, address="10.0.0.9:50051")])
def test_a_loaded_rank_gives_up_when_its_place_is_gone_or_changed(changed):
    with pytest.raises(AssignmentLostError, match="deleted or changed"):
        act(changed, joined=joined_placement(group(1), ME), loaded=("g0", 1, 2))


def test_a_group_size_that_does_not_divide_the_experts_is_refused():
    with pytest.raises(ValueError, match="3 ranks, which does not divide the model's 8 experts"):
        act(group(world_size=3))

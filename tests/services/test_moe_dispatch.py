"""gate -> dispatch -> experts -> combine against a per-token loop over all experts, in both
dispatch modes (host splits and fixed capacity), on one rank and over 2 and 4 gloo processes
(ranks sending, receiving or holding nothing; every token routed to one rank's experts).
With spare slots holding replicas the outputs equal those without, bit for bit."""

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from services.model.expert_map import EMPTY, Placement, SlotMap
from services.model.moe import (
    ExpertComm, MoELayer, combine, dispatch, experts, gate, grouped_mm, local_expert_ids, step_capacity,
)

HIDDEN, WIDTH, NUM_EXPERTS, TOP_K = 16, 8, 8, 2


def _all_experts(seed: int = 0):
    """The gate and every expert's weights, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    w_gate_ED = torch.randn(NUM_EXPERTS, HIDDEN, generator=g)
    w_gate_up_EGD = torch.randn(NUM_EXPERTS, 2 * WIDTH, HIDDEN, generator=g) * 0.3
    w_down_EDF = torch.randn(NUM_EXPERTS, HIDDEN, WIDTH, generator=g) * 0.3
    return w_gate_ED, w_gate_up_EGD, w_down_EDF


def _reference(x_TD, ids_TK, weights_TK, w_gate_up_EGD, w_down_EDF):
    """Token by token, expert by expert."""
    out_TD = torch.zeros_like(x_TD)
    for t in range(x_TD.shape[0]):
        for e, w in zip(ids_TK[t].tolist(), weights_TK[t]):
            gate_F, up_F = (w_gate_up_EGD[e] @ x_TD[t]).chunk(2)
            out_TD[t] += w * (w_down_EDF[e] @ (F.silu(gate_F) * up_F))
    return out_TD


def _routing(num_tokens: int, allowed_experts: list[int], seed: int):
    """Distinct top-k experts per token drawn from allowed_experts, weights summing to one."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor(allowed_experts)
    picks = [allowed[torch.randperm(len(allowed), generator=g)[:TOP_K]] for _ in range(num_tokens)]
    ids_TK = torch.stack(picks) if picks else torch.empty(0, TOP_K, dtype=torch.int64)
    weights_TK = torch.softmax(torch.randn(num_tokens, TOP_K, generator=g), dim=-1)
    counts_E = torch.bincount(ids_TK.flatten(), minlength=NUM_EXPERTS)
    return ids_TK, weights_TK, counts_E


def _capacities(comm: ExpertComm, max_tokens: int) -> list[int | None]:
    """Host splits, the tightest safe capacity, and the bucketed one of step_capacity."""
    num_local = NUM_EXPERTS // comm.world_size
    return [None, max(1, max_tokens * min(TOP_K, num_local)),
            step_capacity(max_tokens, TOP_K, num_local, max_fixed_tokens=256)]


def _check_rank(comm: ExpertComm, num_tokens: int, allowed_experts: list[int], max_tokens: int) -> None:
    """One rank's checks in every mode: the explicit routing, then the whole layer with its own gate.

    `max_tokens` is the largest num_tokens of any rank (what every rank sizes the capacity by).
    """
    w_gate_ED, w_gate_up_EGD, w_down_EDF = _all_experts()
    local = list(local_expert_ids(NUM_EXPERTS, comm.rank, comm.world_size))
    x_TD = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(100 + comm.rank))
    ids_TK, weights_TK, counts_E = _routing(num_tokens, allowed_experts, seed=comm.rank)
    expected_TD = _reference(x_TD, ids_TK, weights_TK, w_gate_up_EGD, w_down_EDF)

    outputs = []
    for capacity in _capacities(comm, max_tokens):
        x_PD, meta = dispatch(x_TD, ids_TK, weights_TK, counts_E, comm, capacity)
        assert meta.capacity == capacity
        y_PD = experts(x_PD, meta.offsets_L, w_gate_up_EGD[local], w_down_EDF[local])
        outputs.append(combine(y_PD, meta, comm))
        torch.testing.assert_close(outputs[-1], expected_TD)
    assert all(torch.equal(out, outputs[0]) for out in outputs), "the modes must agree bit for bit"

    probs_TE = torch.softmax(x_TD @ w_gate_ED.T, dim=-1)
    top_TK, ids_TK = probs_TE.topk(TOP_K, dim=-1)
    expected_TD = _reference(x_TD, ids_TK, top_TK / top_TK.sum(dim=-1, keepdim=True), w_gate_up_EGD, w_down_EDF)
    for capacity in _capacities(comm, max_tokens):
        hit_counts_E = torch.zeros(NUM_EXPERTS, dtype=torch.int64)
        layer = MoELayer(w_gate_ED, w_gate_up_EGD[local], w_down_EDF[local], top_k=TOP_K,
                         norm_topk_prob=True, comm=comm, hit_counts_E=hit_counts_E)
        torch.testing.assert_close(layer(x_TD, capacity), expected_TD)
        assert torch.equal(hit_counts_E, torch.bincount(ids_TK.flatten(), minlength=NUM_EXPERTS))
    _check_replicas(comm, x_TD, max_tokens)


NUM_SPARES = 2


def _replica_placement(world_size: int) -> Placement:
    """Each rank's spares hold the first experts of the next ranks (none with one rank)."""
    per_rank = NUM_EXPERTS // world_size
    spares = [EMPTY] * (world_size * NUM_SPARES)
    if world_size > 1:
        for r in range(world_size):
            others = [e for e in range(NUM_EXPERTS) if e // per_rank != r]
            spares[r * NUM_SPARES:(r + 1) * NUM_SPARES] = others[:NUM_SPARES]
    return Placement(NUM_EXPERTS, world_size, NUM_SPARES, {0: tuple(spares)})


def _hub_weights(w_gate_up_EGD, w_down_EDF) -> dict:
    """Per-expert tensors under the hub's names (prefix `experts.E.`)."""
    out = {}
    for e in range(NUM_EXPERTS):
        out[f"experts.{e}.gate_proj.weight"], out[f"experts.{e}.up_proj.weight"] = w_gate_up_EGD[e].chunk(2)
        out[f"experts.{e}.down_proj.weight"] = w_down_EDF[e]
    return out


def _check_replicas(comm: ExpertComm, x_TD, max_tokens: int) -> None:
    """The whole layer with spare slots (empty, then holding replicas) gives the
    outputs of the layer without, bit for bit, in every mode; replicas get rows."""
    w_gate_ED, w_gate_up_EGD, w_down_EDF = _all_experts()
    local = list(local_expert_ids(NUM_EXPERTS, comm.rank, comm.world_size))
    plain = MoELayer(w_gate_ED, w_gate_up_EGD[local], w_down_EDF[local], top_k=TOP_K, norm_topk_prob=True,
                     comm=comm, hit_counts_E=torch.zeros(NUM_EXPERTS, dtype=torch.int64))
    plain_TD = plain(x_TD, None)
    hub = _hub_weights(w_gate_up_EGD, w_down_EDF)
    placement = _replica_placement(comm.world_size)
    slot_map = SlotMap(NUM_EXPERTS, comm.world_size, NUM_SPARES, comm.rank, "cpu")
    layer = MoELayer.from_weights({"gate.weight": w_gate_ED, **hub}, "", local, num_spare_slots=NUM_SPARES,
                                  top_k=TOP_K, norm_topk_prob=True, comm=comm,
                                  hit_counts_E=torch.zeros(NUM_EXPERTS, dtype=torch.int64), slot_map=slot_map)
    num_slots = NUM_EXPERTS // comm.world_size + NUM_SPARES
    capacities = [None, step_capacity(max_tokens, TOP_K, num_slots, max_fixed_tokens=256)]
    expected_TD = layer(x_TD, None)  # spares empty
    torch.testing.assert_close(expected_TD, plain_TD)  # CPU products in row blocks: the same up to rounding
    for capacity in capacities:
        assert torch.equal(layer(x_TD, capacity), expected_TD)
    for s, expert in enumerate(placement.spares(0)[comm.rank * NUM_SPARES:(comm.rank + 1) * NUM_SPARES]):
        if expert != EMPTY:
            layer.load_slot(len(local) + s, hub, f"experts.{expert}.")
    slot_map.update(placement, 0)
    for capacity in capacities:
        assert torch.equal(layer(x_TD, capacity), expected_TD), f"replicas changed the output ({capacity=})"
    # Rows that the spare slots of this rank computed, summed over the ranks.
    ids_TK, weights_TK, counts_E = gate(x_TD, w_gate_ED, TOP_K, norm_topk_prob=True)
    _, meta = dispatch(x_TD, ids_TK, weights_TK, counts_E, comm, None, slot_map)
    spare_rows = torch.tensor([int(meta.offsets_L[-1] - meta.offsets_L[len(local) - 1])])
    if comm.group is not None:
        dist.all_reduce(spare_rows, group=comm.group)
        assert spare_rows.item() > 0, "no token went to a replica"


def test_world_size_one_matches_per_token_loop():
    comm = ExpertComm.local()
    _check_rank(comm, num_tokens=11, allowed_experts=list(range(NUM_EXPERTS)), max_tokens=11)
    _check_rank(comm, num_tokens=0, allowed_experts=list(range(NUM_EXPERTS)), max_tokens=0)
    _check_rank(comm, num_tokens=5, allowed_experts=[6, 7], max_tokens=5)


def test_grouped_mm_in_row_blocks_gives_each_row_the_same_bits_whatever_the_group_size():
    g = torch.Generator().manual_seed(4)
    w_LOI, x_PI = torch.randn(1, 96, 256, generator=g), torch.randn(40, 256, generator=g)
    full_PO = grouped_mm(x_PI, w_LOI, torch.tensor([40], dtype=torch.int32), row_block=32)
    for rows in (1, 2, 7, 33):
        part = grouped_mm(x_PI[:rows], w_LOI, torch.tensor([rows], dtype=torch.int32), row_block=32)
        assert torch.equal(part, full_PO[:rows])
    torch.testing.assert_close(full_PO, x_PI @ w_LOI[0].T)


def test_grouped_mm_equals_per_expert_matmuls_bit_exactly():
    g = torch.Generator().manual_seed(3)
    w_LOI = torch.randn(4, 24, 16, generator=g)
    x_PI = torch.randn(10, 16, generator=g)
    offsets_L = torch.tensor([3, 3, 8, 10], dtype=torch.int32)  # expert 1 gets no rows
    expected = torch.cat([x_PI[s:e] @ w_LOI[i].T for i, (s, e) in enumerate(zip([0, 3, 3, 8], [3, 3, 8, 10]))])
    assert torch.equal(grouped_mm(x_PI, w_LOI, offsets_L), expected)


def test_step_capacity_buckets_decode_steps_and_leaves_big_steps_to_host_splits():
    # Power-of-two buckets of the largest rank batch, times min(top_k, local experts).
    assert [step_capacity(t, 8, 32, 256) for t in (0, 1, 2, 3, 32, 33, 256)] == [8, 8, 16, 32, 256, 512, 2048]
    assert step_capacity(5, 8, 4, 256) == 8 * 4  # a token sends at most 4 rows to a peer with 4 experts
    assert step_capacity(257, 8, 32, 256) is None
    assert step_capacity(1, 8, 32, 0) is None  # 0 turns the mode off


def test_slot_map_spreads_an_experts_tokens_over_its_replicas_local_first():
    # 2 ranks, 4 experts each, one spare each: rank 1's spare holds expert 0 (slot 9), rank 0's holds 5 (slot 4).
    placement = Placement(NUM_EXPERTS, 2, 1, {3: (5, 0)})
    assert placement.replica_slots(3)[0] == [0, 9] and placement.replica_slots(3)[5] == [4, 6]
    assert placement.rank_loads(3, [4] + [0] * 7) == [2.0, 2.0]
    ids_TK = torch.tensor([[0, 5], [0, 1], [0, 2], [0, 6], [0, 3]])
    counts_E = torch.bincount(ids_TK.flatten(), minlength=NUM_EXPERTS)
    for rank, (local_0, remote_0) in enumerate([(0, 9), (9, 0)]):
        slot_map = SlotMap(NUM_EXPERTS, 2, 1, rank, "cpu")
        unreplicated = slot_map.route(ids_TK, counts_E)
        assert unreplicated[:, 1].tolist() == [6, 1, 2, 7, 3]  # rank 1's experts 5, 6 sit in slots 6, 7
        slot_map.update(placement, 3)
        slots_TK = slot_map.route(ids_TK, counts_E)
        # Expert 0's five copies alternate, this rank's replica first (three local, two remote).
        assert slots_TK[:, 0].tolist() == [local_0, remote_0, local_0, remote_0, local_0]
        assert slots_TK[1:, 1].tolist() == [1, 2, 7, 3]


def test_placement_refuses_a_rank_holding_an_expert_twice_and_round_trips():
    with pytest.raises(ValueError, match="rank 0 holds an expert twice"):
        Placement(NUM_EXPERTS, 2, 1, {0: (2, EMPTY)})
    with pytest.raises(ValueError, match="expert 8 outside"):
        Placement(NUM_EXPERTS, 2, 1, {0: (8, EMPTY)})
    placement = Placement(NUM_EXPERTS, 2, 2, {1: (4, EMPTY, 0, 1)}, epoch=3)
    assert Placement.from_dict(__import__("json").loads(placement.to_json())) == placement
    assert placement.loads_needed(Placement(NUM_EXPERTS, 2, 2, {1: (5, EMPTY, 0, EMPTY)}), 0) == {1: [(0, 5)]}


def test_fixed_capacity_that_could_overflow_is_refused():
    x_TD = torch.randn(4, HIDDEN)
    ids_TK, weights_TK, counts_E = _routing(4, list(range(NUM_EXPERTS)), seed=0)
    with pytest.raises(ValueError, match="capacity of 7 slots"):
        dispatch(x_TD, ids_TK, weights_TK, counts_E, ExpertComm.local(), capacity=4 * TOP_K - 1)


def test_fixed_capacity_mode_reads_nothing_back_to_the_host():
    """On the meta device every host read raises: the fixed-capacity layer has none
    (it can be captured in a CUDA graph), the host-split dispatch has some."""
    w_gate_ED, w_gate_up_EGD, w_down_EDF = (w.to("meta", torch.bfloat16) for w in _all_experts())
    x_TD = torch.empty(6, HIDDEN, device="meta", dtype=torch.bfloat16)
    ids_TK, weights_TK, counts_E = gate(x_TD, w_gate_ED, TOP_K, norm_topk_prob=True)
    comm = ExpertComm.local()
    x_PD, meta = dispatch(x_TD, ids_TK, weights_TK, counts_E, comm, capacity=6 * TOP_K)
    y_PD = experts(x_PD, meta.offsets_L, w_gate_up_EGD, w_down_EDF)
    assert combine(y_PD, meta, comm).shape == (6, HIDDEN)
    with pytest.raises(NotImplementedError):
        dispatch(x_TD, ids_TK, weights_TK, counts_E, comm)


# Per world size, scenarios of (tokens, experts the tokens may pick) per rank.
# E=8 over 4 ranks, first scenario: rank 0 sends nothing to ranks 2 and 3, rank 1
# has no tokens, nobody picks experts 6 and 7 so rank 3 receives nothing. The
# second: every token goes to rank 0's experts, filling the capacity exactly.
SCENARIOS = {
    2: [[(6, [0, 1, 2, 3]), (0, list(range(NUM_EXPERTS)))],
        [(5, [0, 1, 2, 3]), (3, [0, 1, 2, 3])]],
    4: [[(5, [0, 1, 2, 3]), (0, list(range(NUM_EXPERTS))), (3, list(range(6))), (4, list(range(6)))],
        [(2, [0, 1]), (4, [0, 1]), (0, [0, 1]), (1, [0, 1])]],
}


def _worker(rank: int, world_size: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        torch.set_num_threads(1)
        comm = ExpertComm(dist.group.WORLD)
        for scenario in SCENARIOS[world_size]:
            max_tokens = max(num_tokens for num_tokens, _ in scenario)
            assert comm.max_over_ranks(scenario[rank][0], "cpu") == max_tokens
            _check_rank(comm, *scenario[rank], max_tokens=max_tokens)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, 4])
def test_gloo_ranks_match_per_token_loop(tmp_path, world_size):
    torch.multiprocessing.spawn(_worker, args=(world_size, str(tmp_path / "rendezvous")), nprocs=world_size)

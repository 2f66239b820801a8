"""gate -> dispatch -> experts -> combine against a per-token loop over all experts, in both
dispatch modes (host splits and fixed capacity), on one rank and over 2 and 4 gloo processes
(ranks sending, receiving or holding nothing; every token routed to one rank's experts).
Each token's row goes at most once to each rank, and one fp32 partial comes back per row.
With spare slots holding replicas the outputs equal those without, bit for bit at top-2
(fp32 additions of two partials commute); at top-4 (partials regroup the additions) they
equal the one-rank layer's within fp32 rounding."""

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from services.model.expert_map import SlotMap
from services.placement import EMPTY, Placement
from services.model.exchange.comm import ExpertComm
from services.model.moe import MoELayer
from services.model.moe_dispatch import combine, dispatch, gate, local_expert_ids, step_capacity
from services.model.moe_experts import experts, grouped_mm
from tests.gloo_ranks import leave_rank

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
    return [None, max(1, max_tokens) * min(TOP_K, num_local),
            step_capacity(max_tokens, TOP_K, num_local, max_fixed_tokens=256)]


class _RecordingComm(ExpertComm):
    """An ExpertComm that records each all_to_all's input shape and dtype and its splits."""

    def __init__(self, group):
        super().__init__(group)
        self.sent = []

    def all_to_all(self, out, inp, out_splits=None, in_splits=None) -> None:
        splits = [None if x is None else tuple(x) for x in (in_splits, out_splits)]
        self.sent.append((tuple(inp.shape), inp.dtype, *splits))
        super().all_to_all(out, inp, out_splits, in_splits)


def _check_one_row_per_token_and_rank(sent: list, ids_TK, num_ranks: int, capacity: int | None) -> None:
    """A dispatch + combine sent each token's row once to each rank holding one of its experts
    (with its K ids and K fp32 weights), and got one fp32 partial back per row sent; at fixed
    capacity C, messages of C / min(K, L) rows."""
    num_local = NUM_EXPERTS // num_ranks
    dest_TK = ids_TK // num_local
    tokens_to_N = tuple(int((dest_TK == n).any(dim=1).sum()) for n in range(num_ranks))
    if capacity is None:
        counts, rows, partials = sent
        assert counts[0] == (num_ranks, 2)
        assert rows[0][0] == sum(tokens_to_N) and rows[2] == tokens_to_N
        assert partials[3] == tokens_to_N and partials[2] == rows[3]
    else:
        rows, partials = sent
        assert rows[0][0] == partials[0][0] == num_ranks * capacity // min(ids_TK.shape[1], num_local)
    assert rows[0][1] == HIDDEN + 2 * ids_TK.shape[1] and rows[1] == torch.float32
    assert partials[0][1] == HIDDEN and partials[1] == torch.float32


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
        recording = _RecordingComm(comm.group)
        x_PD, meta = dispatch(x_TD, ids_TK, weights_TK, counts_E, recording, capacity)
        assert meta.capacity == capacity
        y_PD = experts(x_PD, meta.offsets_L, w_gate_up_EGD[local], w_down_EDF[local])
        y_PD[int(meta.offsets_L[-1]):] = float("nan")  # padding rows: the GPU's grouped GEMM leaves them unset
        outputs.append(combine(y_PD, meta, recording))
        torch.testing.assert_close(outputs[-1], expected_TD)
        _check_one_row_per_token_and_rank(recording.sent, ids_TK, comm.world_size, capacity)
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


def _load_replicas(layer: MoELayer, slot_map: SlotMap, hub: dict, comm: ExpertComm) -> None:
    """Loads this rank's spares of _replica_placement and points the slot map at them."""
    placement, num_local = _replica_placement(comm.world_size), NUM_EXPERTS // comm.world_size
    for s, expert in enumerate(placement.spares(0)[comm.rank * NUM_SPARES:(comm.rank + 1) * NUM_SPARES]):
        if expert != EMPTY:
            layer.load_slot(num_local + s, hub, f"experts.{expert}.")
    slot_map.update(placement, 0)


def _check_replicas(comm: ExpertComm, x_TD, max_tokens: int) -> None:
    """The whole layer with spare slots (empty, then holding replicas) gives the
    outputs of the layer without, bit for bit, in every mode; replicas get rows."""
    w_gate_ED, w_gate_up_EGD, w_down_EDF = _all_experts()
    local = list(local_expert_ids(NUM_EXPERTS, comm.rank, comm.world_size))
    plain = MoELayer(w_gate_ED, w_gate_up_EGD[local], w_down_EDF[local], top_k=TOP_K, norm_topk_prob=True,
                     comm=comm, hit_counts_E=torch.zeros(NUM_EXPERTS, dtype=torch.int64))
    plain_TD = plain(x_TD, None)
    hub = _hub_weights(w_gate_up_EGD, w_down_EDF)
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
    _load_replicas(layer, slot_map, hub, comm)
    for capacity in capacities:
        assert torch.equal(layer(x_TD, capacity), expected_TD), f"replicas changed the output ({capacity=})"
    # Rows that the spare slots of this rank computed, summed over the ranks.
    ids_TK, weights_TK, counts_E = gate(x_TD, w_gate_ED, TOP_K, norm_topk_prob=True)
    _, meta = dispatch(x_TD, ids_TK, weights_TK, counts_E, comm, None, slot_map)
    spare_rows = torch.tensor([int(meta.offsets_L[-1] - meta.offsets_L[len(local) - 1])])
    if comm.group is not None:
        dist.all_reduce(spare_rows, group=comm.group)
        assert spare_rows.item() > 0, "no token went to a replica"


def _check_top4_against_one_rank(comm: ExpertComm, num_tokens: int, max_tokens: int) -> None:
    """At top-4 the partials regroup a token's fp32 additions: the layer over the ranks, with
    replicas or without, equals the one-rank layer within fp32 rounding, and its two modes
    agree bit for bit."""
    top_k, (w_gate_ED, w_gate_up_EGD, w_down_EDF) = 4, _all_experts(seed=1)
    x_TD = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(200 + comm.rank))
    common = dict(top_k=top_k, norm_topk_prob=True, hit_counts_E=torch.zeros(NUM_EXPERTS, dtype=torch.int64))
    one_rank = MoELayer(w_gate_ED, w_gate_up_EGD, w_down_EDF, comm=ExpertComm.local(), **common)
    expected_TD = one_rank(x_TD, None)
    local = list(local_expert_ids(NUM_EXPERTS, comm.rank, comm.world_size))
    hub = {"gate.weight": w_gate_ED, **_hub_weights(w_gate_up_EGD, w_down_EDF)}
    slot_map = SlotMap(NUM_EXPERTS, comm.world_size, NUM_SPARES, comm.rank, "cpu")
    replicated = MoELayer.from_weights(hub, "", local, num_spare_slots=NUM_SPARES, comm=comm,
                                       slot_map=slot_map, **common)
    _load_replicas(replicated, slot_map, hub, comm)
    plain = MoELayer(w_gate_ED, w_gate_up_EGD[local], w_down_EDF[local], comm=comm, **common)
    for layer in (plain, replicated):
        host_TD = layer(x_TD, None)
        torch.testing.assert_close(host_TD, expected_TD)
        capacity = step_capacity(max_tokens, top_k, len(layer.w_down_LDF), max_fixed_tokens=256)
        assert torch.equal(layer(x_TD, capacity), host_TD)


def test_world_size_one_matches_per_token_loop():
    comm = ExpertComm.local()
    _check_rank(comm, num_tokens=11, allowed_experts=list(range(NUM_EXPERTS)), max_tokens=11)
    _check_rank(comm, num_tokens=0, allowed_experts=list(range(NUM_EXPERTS)), max_tokens=0)
    _check_rank(comm, num_tokens=5, allowed_experts=[6, 7], max_tokens=5)
    _check_top4_against_one_rank(comm, num_tokens=9, max_tokens=9)


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
    assert step_capacity(5, 8, 4, 256) == 8 * 4  # a token routes at most 4 copies to a peer with 4 experts
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
    with pytest.raises(ValueError, match="capacity of 7 copies per peer holds 3 tokens of up to 2 copies each, not 4"):
        dispatch(x_TD, ids_TK, weights_TK, counts_E, ExpertComm.local(), capacity=4 * TOP_K - 1)
    with pytest.raises(ValueError, match="holds 0 tokens of up to 2 copies each, not 1"):  # an idle rank too
        dispatch(x_TD[:0], ids_TK[:0], weights_TK[:0], counts_E * 0, ExpertComm.local(), capacity=1)


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


def _worker(rank: int, init_file: str) -> None:
    """Four gloo ranks: the four-rank scenarios on all of them, then the two-rank ones on ranks 0 and 1
    (one spawn for both world sizes: a spawn costs more than the scenarios)."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=4,
                            timeout=datetime.timedelta(seconds=60))
    try:
        torch.set_num_threads(1)
        pair = dist.new_group([0, 1])  # every rank takes part in making it
        for world_size, group in ((4, dist.group.WORLD), (2, pair)):
            if rank >= world_size:
                continue
            comm = ExpertComm(group)
            assert (comm.rank, comm.world_size) == (rank, world_size)
            for scenario in SCENARIOS[world_size]:
                max_tokens = max(num_tokens for num_tokens, _ in scenario)
                assert comm.max_over_ranks(scenario[rank][0], "cpu") == max_tokens
                _check_rank(comm, *scenario[rank], max_tokens=max_tokens)
                _check_top4_against_one_rank(comm, scenario[rank][0], max_tokens)
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_rank()


def test_gloo_ranks_match_per_token_loop(tmp_path):
    torch.multiprocessing.spawn(_worker, args=(str(tmp_path / "rendezvous"),), nprocs=4)

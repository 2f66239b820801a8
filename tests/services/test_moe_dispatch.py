"""gate -> dispatch -> experts -> combine against a per-token loop over all experts,
on one rank and over 2 and 4 gloo processes (ranks sending, receiving or holding nothing)."""

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from services.model.moe import (
    ExpertComm, MoELayer, combine, dispatch, experts, grouped_mm, local_expert_ids,
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


def _check_rank(comm: ExpertComm, num_tokens: int, allowed_experts: list[int]) -> None:
    """One rank's checks: the explicit routing, then the whole layer with its own gate."""
    w_gate_ED, w_gate_up_EGD, w_down_EDF = _all_experts()
    local = list(local_expert_ids(NUM_EXPERTS, comm.rank, comm.world_size))
    x_TD = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(100 + comm.rank))

    ids_TK, weights_TK, counts_E = _routing(num_tokens, allowed_experts, seed=comm.rank)
    x_PD, meta = dispatch(x_TD, ids_TK, weights_TK, counts_E, comm)
    out_TD = combine(experts(x_PD, meta.offsets_L, w_gate_up_EGD[local], w_down_EDF[local]), meta, comm)
    torch.testing.assert_close(out_TD, _reference(x_TD, ids_TK, weights_TK, w_gate_up_EGD, w_down_EDF))

    hit_counts_E = torch.zeros(NUM_EXPERTS, dtype=torch.int64)
    layer = MoELayer(w_gate_ED, w_gate_up_EGD[local], w_down_EDF[local], top_k=TOP_K,
                     norm_topk_prob=True, comm=comm, hit_counts_E=hit_counts_E)
    out_TD = layer(x_TD)
    probs_TE = torch.softmax(x_TD @ w_gate_ED.T, dim=-1)
    top_TK, ids_TK = probs_TE.topk(TOP_K, dim=-1)
    weights_TK = top_TK / top_TK.sum(dim=-1, keepdim=True)
    torch.testing.assert_close(out_TD, _reference(x_TD, ids_TK, weights_TK, w_gate_up_EGD, w_down_EDF))
    assert torch.equal(hit_counts_E, torch.bincount(ids_TK.flatten(), minlength=NUM_EXPERTS))


def test_world_size_one_matches_per_token_loop():
    comm = ExpertComm.local()
    _check_rank(comm, num_tokens=11, allowed_experts=list(range(NUM_EXPERTS)))
    _check_rank(comm, num_tokens=0, allowed_experts=list(range(NUM_EXPERTS)))


def test_grouped_mm_equals_per_expert_matmuls_bit_exactly():
    g = torch.Generator().manual_seed(3)
    w_LOI = torch.randn(4, 24, 16, generator=g)
    x_PI = torch.randn(10, 16, generator=g)
    offsets_L = torch.tensor([3, 3, 8, 10], dtype=torch.int32)  # expert 1 gets no rows
    expected = torch.cat([x_PI[s:e] @ w_LOI[i].T for i, (s, e) in enumerate(zip([0, 3, 3, 8], [3, 3, 8, 10]))])
    assert torch.equal(grouped_mm(x_PI, w_LOI, offsets_L), expected)


# Per world size: (tokens, experts the tokens may pick) per rank. E=8 over 4
# ranks: rank 0 sends nothing to ranks 2 and 3, rank 1 has no tokens, nobody
# picks experts 6 and 7 so rank 3 receives nothing.
SCENARIOS = {
    2: [(6, [0, 1, 2, 3]), (0, list(range(NUM_EXPERTS)))],
    4: [(5, [0, 1, 2, 3]), (0, list(range(NUM_EXPERTS))), (3, list(range(6))), (4, list(range(6)))],
}


def _worker(rank: int, world_size: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        torch.set_num_threads(1)
        num_tokens, allowed = SCENARIOS[world_size][rank]
        _check_rank(ExpertComm(dist.group.WORLD), num_tokens, allowed)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, 4])
def test_gloo_ranks_match_per_token_loop(tmp_path, world_size):
    torch.multiprocessing.spawn(_worker, args=(world_size, str(tmp_path / "rendezvous")), nprocs=world_size)

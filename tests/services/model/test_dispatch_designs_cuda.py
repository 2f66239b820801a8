"""The two exchange designs on two GPUs through NCCL (skipped without two CUDA GPUs): the Triton MoE
backend's gather (kernels/moe_ep.py) and its deduplicated all-to-all (moe_dispatch.py with
moe_gemm.sorted_experts), forced through the group's plan (exchange/cost_model.py).

1. The layer at decode sizes (fixed capacity) and above --max-fixed-capacity-tokens (host splits
   for the all-to-all): the designs agree within bf16 rounding (their GEMMs tile differently), and
   the all-to-all's host splits send fewer rows than the gather when tokens miss a rank.
2. The all-to-all at a fixed capacity captured in a CUDA graph (the decode graphs' path) replays
   the eager layer's bits on new inputs.
3. "auto" on one host of two ranks picks the gather at every size (p = 1 - 2^-K of a token's rows
   reach the other rank: nothing to save).

Run on a machine with two GPUs: python -m pytest -q tests/services/model/test_dispatch_designs_cuda.py
"""

import datetime
import os

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs two CUDA GPUs")

HIDDEN, WIDTH, NUM_EXPERTS, TOP_K = 512, 256, 16, 4
MAX_FIXED = 64


def _plan(setting: str, world_size: int):
    from services.model.exchange.cost_model import LinkCosts, RowShape, Topology
    from services.model.exchange.plan import DispatchPlan

    return DispatchPlan(setting, Topology(("host",) * world_size), RowShape(HIDDEN, TOP_K, 2),
                        LinkCosts.for_device("cuda"), MAX_FIXED)


class _Counting:
    """Wraps ExpertComm's collectives to count the rows each moves."""

    def __init__(self, comm):
        self.comm, self.rows = comm, []
        for name in ("all_to_all", "all_gather", "reduce_scatter"):
            original = getattr(comm, name)

            def counted(out, inp, *args, _original=original, _name=name):
                self.rows.append((_name, inp.shape[0]))
                return _original(out, inp, *args)
            setattr(comm, name, counted)


def _layer(comm, device):
    from services.model.moe import MoELayer

    g = torch.Generator(device=device).manual_seed(0)
    w_gate_ED = torch.randn(NUM_EXPERTS, HIDDEN, generator=g, device=device).bfloat16()
    w_gate_up_EGD = (torch.randn(NUM_EXPERTS, 2 * WIDTH, HIDDEN, generator=g, device=device) * 0.05).bfloat16()
    w_down_EDF = (torch.randn(NUM_EXPERTS, HIDDEN, WIDTH, generator=g, device=device) * 0.05).bfloat16()
    per_rank = NUM_EXPERTS // comm.world_size
    mine = slice(comm.rank * per_rank, (comm.rank + 1) * per_rank)
    return MoELayer(w_gate_ED, w_gate_up_EGD[mine].contiguous(), w_down_EDF[mine].contiguous(), top_k=TOP_K,
                    norm_topk_prob=True, comm=comm, backend="triton",
                    hit_counts_E=torch.zeros(NUM_EXPERTS, dtype=torch.int64, device=device))


def _capacity(num_tokens: int, num_local: int) -> int:
    from services.model.moe_dispatch import step_capacity

    # as Qwen3MoeModel.dispatch_capacity on CUDA: a bucket up to MAX_FIXED, else exactly the tokens
    return step_capacity(num_tokens, TOP_K, num_local, MAX_FIXED) or num_tokens * min(TOP_K, num_local)


def _worker(rank: int, init_file: str) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120), device_id=device)
    try:
        from services.model.exchange.comm import ExpertComm

        comm = ExpertComm(dist.group.WORLD)
        counting = _Counting(comm)
        layer = _layer(comm, device)
        num_local = NUM_EXPERTS // 2
        for num_tokens in (1, 7, 48, 300):  # 300 > MAX_FIXED: host splits for the all-to-all
            x_TD = torch.randn(num_tokens, HIDDEN, device=device, generator=torch.Generator(device).manual_seed(
                num_tokens + rank)).bfloat16()
            capacity = _capacity(num_tokens, num_local)
            outputs = {}
            for setting in ("gather", "alltoall"):
                comm.plan = _plan(setting, 2)
                counting.rows.clear()
                outputs[setting] = layer(x_TD, capacity)
                kinds = {name for name, _ in counting.rows}
                assert kinds == ({"all_gather", "reduce_scatter"} if setting == "gather" else {"all_to_all"}), kinds
                if setting == "alltoall":
                    assert len(counting.rows) == (3 if num_tokens > MAX_FIXED else 2), counting.rows
            torch.testing.assert_close(outputs["alltoall"], outputs["gather"], atol=2e-2, rtol=2e-2)
            comm.plan = _plan("auto", 2)
            assert {comm.plan.design(t) for t in (1, 64, 300, 4096)} == {"gather"}

        # The all-to-all at a fixed capacity in a CUDA graph: the decode graphs' path.
        comm.plan = _plan("alltoall", 2)
        static_TD = torch.randn(8, HIDDEN, device=device).bfloat16()
        capacity = _capacity(8, num_local)
        torch.cuda.synchronize()
        layer(static_TD, capacity)  # compile the kernels before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out_TD = layer(static_TD, capacity)
        for seed in (1, 2):
            new_TD = torch.randn(8, HIDDEN, device=device, generator=torch.Generator(device).manual_seed(
                seed * 10 + rank)).bfloat16()
            static_TD.copy_(new_TD)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out_TD, layer(new_TD, capacity))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_gather_and_all_to_all_agree_on_two_gpus_and_the_all_to_all_captures(tmp_path):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.multiprocessing.spawn(_worker, args=(str(tmp_path / "rendezvous"),), nprocs=2)

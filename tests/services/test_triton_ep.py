"""The expert-parallel MoE by gather and reduce-scatter (services/model/triton_ep.py) against
moe.py's layer, on the CPU through Triton's interpreter: the kernels with the ranks simulated in
one process, and the whole layer over two gloo processes.

TRITON_INTERPRET=1 must be set before the kernels are defined, so this file sets it first.
"""

import datetime
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from services.model.moe import ExpertComm, MoELayer  # noqa: E402
from tests.triton_interpreter import interpreted  # noqa: E402

HIDDEN, WIDTH, NUM_EXPERTS = 48, 40, 8


@pytest.fixture(scope="module")
def tep():
    """services.model.triton_ep under the interpreter, or a skip without triton."""
    with interpreted("triton_ep") as module:
        yield module


def _weights(dtype, seed=5, coarse=False):
    """The gate and every expert's weights; coarse: gate and up products exact in any order and
    each down output one activation times a power of two, so only the roundings can differ."""
    generator = torch.Generator().manual_seed(seed)
    w_gate_ED = torch.randn(NUM_EXPERTS, HIDDEN, generator=generator)
    w_gate_up_EGD = torch.randn(NUM_EXPERTS, 2 * WIDTH, HIDDEN, generator=generator) / HIDDEN ** 0.5
    w_down_EDF = torch.randn(NUM_EXPERTS, HIDDEN, WIDTH, generator=generator) / WIDTH ** 0.5
    if coarse:
        w_gate_ED, w_gate_up_EGD = ((w * 256).round() / 256 for w in (w_gate_ED, w_gate_up_EGD))
        column_ED1 = torch.randint(WIDTH, (NUM_EXPERTS, HIDDEN, 1), generator=generator)
        scale_ED1 = 2.0 ** torch.randint(-2, 2, (NUM_EXPERTS, HIDDEN, 1), generator=generator)
        w_down_EDF = torch.zeros_like(w_down_EDF).scatter_(2, column_ED1, scale_ED1)
    return tuple(w.to(dtype) for w in (w_gate_ED, w_gate_up_EGD, w_down_EDF))


def _layer(weights, top_k: int, comm: ExpertComm | None = None) -> MoELayer:
    """The layer of comm's rank (all experts for None) over the given weights."""
    comm = comm or ExpertComm.local()
    w_gate_ED, w_gate_up_EGD, w_down_EDF = weights
    per_rank = NUM_EXPERTS // comm.world_size
    experts = slice(comm.rank * per_rank, (comm.rank + 1) * per_rank)
    return MoELayer(w_gate_ED, w_gate_up_EGD[experts].contiguous(), w_down_EDF[experts].contiguous(), top_k=top_k,
                    norm_topk_prob=True, comm=comm, hit_counts_E=torch.zeros(NUM_EXPERTS, dtype=torch.int64))


def _tokens(num_tokens: int, dtype, seed: int) -> torch.Tensor:
    x_TD = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(seed))
    return ((x_TD * 64).round() / 64).to(dtype)


def _config(tep):
    """Small tiles (the interpreter is slow) that still split D and F."""
    moe = tep.triton_moe
    return moe.MoEConfig(16, moe.GemmBlocks(16, 16, 4, 2), moe.GemmBlocks(32, 16, 4, 2))


def test_pack_lays_out_rows_ids_and_weights(tep):
    x_TD = _tokens(3, torch.float32, seed=0)
    ids_TK = torch.tensor([[0, 2, 7], [1, 3, 4], [5, 6, 7]])
    weights_TK = torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.2, 0.7], [1.0, 0.0, 0.0]])
    send_BW = tep.pack(x_TD, ids_TK, weights_TK, rows_per_rank=5)
    assert send_BW.shape == (5, tep.row_width(HIDDEN, 3, torch.float32)) == (5, HIDDEN + 6)
    assert torch.equal(send_BW[:3, :HIDDEN], x_TD)
    meta_BM = send_BW[:, HIDDEN:].view(torch.int32)
    assert torch.equal(meta_BM[:3, :3], ids_TK.int() + 1) and not meta_BM[3:, :3].any()  # padding: no expert
    assert torch.equal(meta_BM[:3, 3:].view(torch.float32), weights_TK)
    with pytest.raises(ValueError, match="3 tokens do not fit 2 rows per rank"):
        tep.pack(x_TD, ids_TK, weights_TK, rows_per_rank=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens, rows_per_rank, top_k", [(5, 7, 3), (4, 4, 2), (0, 3, 3)])
def test_route_pack_is_route_then_pack(tep, dtype, num_tokens, rows_per_rank, top_k):
    """One kernel, the same send rows (hidden part of each token, ids + 1 and fp32 weights of every
    row, padding rows' ids 0) and the same hit counts as route then pack."""
    x_TD = _tokens(num_tokens, dtype, seed=3)
    logits_TE = torch.randn(num_tokens, NUM_EXPERTS, generator=torch.Generator().manual_seed(4)).to(dtype)
    hits_E, expected_hits_E = (torch.zeros(NUM_EXPERTS, dtype=torch.int64) for _ in range(2))
    ids_TK, weights_TK = tep.triton_fused.route(logits_TE, top_k, True, expected_hits_E, dtype)[:2]
    expected_BW = tep.pack(x_TD, ids_TK, weights_TK, rows_per_rank)
    send_BW = tep.route_pack(logits_TE, x_TD, top_k, True, hits_E, rows_per_rank)
    assert send_BW.shape == expected_BW.shape
    assert torch.equal(send_BW[:num_tokens, :HIDDEN], expected_BW[:num_tokens, :HIDDEN])
    assert torch.equal(send_BW[:, HIDDEN:].view(torch.int32), expected_BW[:, HIDDEN:].view(torch.int32))
    assert torch.equal(hits_E, expected_hits_E) and hits_E.sum() == num_tokens * top_k
    with pytest.raises(ValueError, match="do not fit"):
        tep.route_pack(logits_TE, x_TD, top_k, True, hits_E, num_tokens - 1)


def test_align_places_only_local_experts(tep):
    """Gathered ids (+ 1, 0 for padding) offset to one rank's experts: the others and the padding
    get no position and count nowhere."""
    ids_JK = torch.tensor([[1, 4, 6], [0, 0, 0], [2, 5, 8], [3, 5, 7]], dtype=torch.int32)
    a = tep.triton_moe.align(ids_JK, 4, 1, id_offset=5)  # local experts 0..3 = global 4..7, ids + 1 5..8
    assert a.counts_E.tolist() == [2, 1, 1, 1]
    # Routed rows j * 3 + k by local expert: (2, 1), (3, 1); (0, 2); (3, 2); (2, 2).
    assert a.sorted_ids_P[:5].tolist() == [7, 10, 2, 11, 8]


def _simulated(tep, weights, top_k: int, tokens_N: list[int], dtype) -> list[torch.Tensor]:
    """Each simulated rank's output: its tokens routed, packed, every rank's rows gathered, each
    rank's local partials, summed over the ranks per rank's block and rounded."""
    num_ranks, num_local = len(tokens_N), NUM_EXPERTS // len(tokens_N)
    reference = _layer(weights, top_k)
    rows_per_rank = max(tokens_N)
    xs = [_tokens(n, dtype, seed=10 + rank) for rank, n in enumerate(tokens_N)]
    sends = []
    for x_TD in xs:
        ids_TK, weights_TK = tep.triton_fused.route(torch.nn.functional.linear(x_TD, reference.w_gate_ED), top_k,
                                                    True, torch.zeros(NUM_EXPERTS, dtype=torch.int64), dtype)[:2]
        sends.append(tep.pack(x_TD, ids_TK, weights_TK, rows_per_rank))
    recv_JW = torch.cat(sends)
    partials = [tep.local_partials(recv_JW, HIDDEN, top_k, 1 + rank * num_local, layer.w_gate_up_LGD,
                                   layer.w_down_LDF, _config(tep))
                for rank in range(num_ranks)
                for layer in [_layer(weights, top_k, _FakeComm(rank, num_ranks))]]
    summed_JD = torch.stack(partials).sum(0)
    return [(summed_JD[rank * rows_per_rank:][:n].to(dtype), reference(xs[rank]))
            for rank, n in enumerate(tokens_N)]


class _FakeComm(ExpertComm):
    """A rank's place in a group that is never talked to."""

    def __init__(self, rank: int, world_size: int):
        super().__init__(None)
        self.rank, self.world_size = rank, world_size


@pytest.mark.parametrize("tokens_N", [[5, 3], [0, 7], [4, 0, 9, 1]])
@pytest.mark.parametrize("top_k", [2, 3])
def test_simulated_ranks_match_the_one_rank_layer(tep, tokens_N, top_k):
    for out_TD, expected_TD in _simulated(tep, _weights(torch.float32), top_k, tokens_N, torch.float32):
        torch.testing.assert_close(out_TD, expected_TD, atol=1e-5, rtol=1e-5)


def test_simulated_ranks_round_like_torch(tep):
    """fp16 with every sum exact: the roundings of gate, up, SiLU, the product, the down output,
    the weighted output and the final one are moe.py's, bit for bit."""
    for out_TD, expected_TD in _simulated(tep, _weights(torch.float16, coarse=True), 3, [6, 2], torch.float16):
        assert torch.equal(out_TD, expected_TD)


class _GlooExchange:
    """symm_exchange.SymmetricExchange's interface over gloo collectives into its own buffers:
    gathered_moe's use of an exchange (its buffers, the model-dtype sum) on the CPU, where
    symmetric memory is not."""

    def __init__(self, max_rows_per_rank: int, row_width: int, dtype):
        self.rows = torch.full((max_rows_per_rank, row_width), float("nan"), dtype=dtype)
        self.partials = torch.full((2 * max_rows_per_rank, HIDDEN), float("nan"))
        self.calls = []

    def fits(self, rows_per_rank: int, row_width: int) -> bool:
        return rows_per_rank <= self.rows.shape[0] and row_width == self.rows.shape[1]

    def send_rows(self, rows_per_rank: int):
        return self.rows[:rows_per_rank]

    def partial_rows(self, num_rows: int):
        return self.partials[:num_rows]

    def owns(self, tensor) -> bool:
        return tensor.data_ptr() in (self.rows.data_ptr(), self.partials.data_ptr())

    def all_gather(self, out_JW, send_BW) -> None:
        assert send_BW.data_ptr() == self.rows.data_ptr()
        self.calls.append("all_gather")
        dist.all_gather_into_tensor(out_JW, send_BW)

    def reduce_scatter(self, out_BD, partial_JD) -> None:
        assert partial_JD.data_ptr() == self.partials.data_ptr()
        self.calls.append("reduce_scatter")
        total_BD = torch.empty(out_BD.shape)
        dist.reduce_scatter_tensor(total_BD, partial_JD)
        out_BD.copy_(total_BD)


def _gloo_worker(rank: int, init_file: str, tokens_N: list[int], top_k: int, exchange: bool) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    try:
        torch.set_num_threads(1)
        with interpreted("triton_ep") as tep:
            tep.triton_moe.default_config = lambda _num_tokens: _config(tep)
            weights = _weights(torch.float32)
            comm = ExpertComm(dist.group.WORLD)
            rows_per_rank = max(tokens_N) + 1
            if exchange:  # buffers for this step exactly: a bigger one takes the collectives
                comm.exchange = _GlooExchange(rows_per_rank, tep.row_width(HIDDEN, top_k, torch.float32),
                                              torch.float32)
            layer = _layer(weights, top_k, comm)
            reference = _layer(weights, top_k)
            x_TD = _tokens(tokens_N[rank], torch.float32, seed=rank)
            out_TD = tep.gathered_moe(layer, x_TD, rows_per_rank=rows_per_rank)
            torch.testing.assert_close(out_TD, reference(x_TD), atol=1e-5, rtol=1e-5)
            assert torch.equal(layer.hit_counts_E, reference.hit_counts_E)  # this rank's tokens' experts
            if exchange:
                assert comm.exchange.calls == ["all_gather", "reduce_scatter"]
                out_TD = tep.gathered_moe(layer, x_TD, rows_per_rank=rows_per_rank + 1)
                assert comm.exchange.calls == ["all_gather", "reduce_scatter"]  # did not fit: collectives
                torch.testing.assert_close(out_TD, reference(x_TD), atol=1e-5, rtol=1e-5)
        dist.barrier()  # both ranks past their last collective before either tears gloo down
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tokens_N,exchange", [([5, 3], False), ([0, 4], False), ([5, 3], True)])
def test_gathered_moe_over_two_gloo_ranks(tmp_path, tokens_N, exchange):
    """The whole layer with its all_gather and reduce_scatter (an idle rank too, and a padding row);
    through an exchange's buffers where the step fits them."""
    pytest.importorskip("triton")
    torch.multiprocessing.spawn(_gloo_worker, args=(str(tmp_path / "rendezvous"), tokens_N, 2, exchange), nprocs=2)


def test_expert_parallel_steps_on_cuda_take_a_fixed_capacity(monkeypatch):
    """Where triton_ep takes the layers (moe.gathers_on), a step bigger than the decode buckets
    gets a capacity too (its largest rank batch, not rounded), never host splits; one rank, or
    the CPU path, keeps host splits for big steps."""
    from services.model import qwen3_moe
    from services.model.config import ModelConfig
    from services.model.make_model import random_weights

    config = ModelConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, intermediate_size=48, moe_intermediate_size=16,
                         num_experts=4, num_experts_per_tok=3, max_position_embeddings=64, dtype=torch.float32)
    weights = random_weights(config, seed=1)
    two_ranks = qwen3_moe.Qwen3MoeModel(config, weights, expert_ids=range(2, 4), comm=_FakeComm(1, 2),
                                        max_fixed_capacity_tokens=8)
    one_rank = qwen3_moe.Qwen3MoeModel(config, weights, expert_ids=range(4), max_fixed_capacity_tokens=8)
    assert two_ranks.dispatch_capacity(5) == 8 * 2 and two_ranks.dispatch_capacity(300) is None  # the CPU
    monkeypatch.setattr(qwen3_moe, "gathers_on", lambda device: True)
    assert two_ranks.dispatch_capacity(5) == 8 * 2  # a decode bucket, as before: min(K, L) = 2 copies per token
    assert two_ranks.dispatch_capacity(300) == 300 * 2
    assert one_rank.dispatch_capacity(300) is None

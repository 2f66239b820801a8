"""The expert-parallel MoE by gather and reduce-scatter (services/model/kernels/moe_ep.py) against
the torch MoE layer, on the CPU through Triton's interpreter: the kernels with the ranks simulated in
one process, and the whole layer over two gloo processes.

TRITON_INTERPRET=1 must be set before the kernels are defined, so this file sets it first.
"""

import datetime
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from services.model.exchange.comm import ExpertComm  # noqa: E402
from services.model.layers import AddNorm  # noqa: E402
from services.model.moe import MoELayer  # noqa: E402
from tests.triton_interpreter import interpreted  # noqa: E402
from tests.gloo_ranks import leave_rank  # noqa: E402

HIDDEN, WIDTH, NUM_EXPERTS = 48, 40, 8


@pytest.fixture(scope="module")
def tep():
    """services.model.kernels.moe_ep under the interpreter, or a skip without triton."""
    with interpreted("kernels.moe_ep") as module:
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
    moe = tep.moe_gemm
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
    ids_TK, weights_TK = tep.routing.route(logits_TE, top_k, True, expected_hits_E, dtype)[:2]
    expected_BW = tep.pack(x_TD, ids_TK, weights_TK, rows_per_rank)
    send_BW = tep.route_pack(logits_TE, x_TD, top_k, True, hits_E, rows_per_rank)
    assert send_BW.shape == expected_BW.shape
    assert torch.equal(send_BW[:num_tokens, :HIDDEN], expected_BW[:num_tokens, :HIDDEN])
    assert torch.equal(send_BW[:, HIDDEN:].view(torch.int32), expected_BW[:, HIDDEN:].view(torch.int32))
    assert torch.equal(hits_E, expected_hits_E) and hits_E.sum() == num_tokens * top_k
    with pytest.raises(ValueError, match="do not fit"):
        tep.route_pack(logits_TE, x_TD, top_k, True, hits_E, num_tokens - 1)


@pytest.mark.parametrize("slot_map", [False, True])
def test_packed_rows_go_to_every_destination_from_its_first_row(tep, slot_map):
    """Push (the symmetric exchange): the rows written into each buffer of the pointer table, in slot
    first_row.., the same bits as a local send buffer; the rest of each buffer untouched."""
    num_tokens, rows_per_rank, top_k, first_row = 3, 4, 2, 4
    x_TD = _tokens(num_tokens, torch.float16, seed=6)
    logits_TE = torch.randn(num_tokens, NUM_EXPERTS, generator=torch.Generator().manual_seed(7)).half()
    width = tep.row_width(HIDDEN, top_k, torch.float16)
    buffers = [torch.full((2 * rows_per_rank, width), -7.0, dtype=torch.float16) for _ in range(3)]
    pointers = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    hits_E = torch.zeros(NUM_EXPERTS, dtype=torch.int64)
    if slot_map:
        ids_TK, weights_TK = tep.routing.route(logits_TE, top_k, True, hits_E, torch.float16)[:2]
        expected_BW = tep.pack(x_TD, ids_TK, weights_TK, rows_per_rank)
        tep.pack(x_TD, ids_TK, weights_TK, rows_per_rank, buffers[0][first_row:], (pointers, first_row))
    else:
        expected_BW = tep.route_pack(logits_TE, x_TD, top_k, True, hits_E, rows_per_rank)
        tep.route_pack(logits_TE, x_TD, top_k, True, hits_E, rows_per_rank, buffers[0][first_row:],
                       (pointers, first_row))
    for buffer in buffers:
        assert torch.equal(buffer[first_row:first_row + num_tokens].view(torch.int16),
                           expected_BW[:num_tokens].view(torch.int16))
        meta = buffer[first_row:, HIDDEN:].view(torch.int32)
        assert torch.equal(meta, expected_BW[:, HIDDEN:].view(torch.int32)) and not meta[num_tokens:].any()
        assert (buffer[:first_row] == -7).all() and (buffer[first_row + num_tokens:, :HIDDEN] == -7).all()


def test_partials_go_to_their_owners_slot(tep):
    """Each gathered row's local experts' weighted outputs summed in increasing k (the other
    ranks' experts add nothing); pushed: row j's partial into rank j // B's buffer, row
    first_row + j % B."""
    num_ranks, rows_per_rank, top_k, num_local, first_row = 2, 3, 2, 4, 3
    generator = torch.Generator().manual_seed(11)
    meta_JM = torch.cat((torch.randint(0, NUM_EXPERTS + 1, (num_ranks * rows_per_rank, top_k), dtype=torch.int32,
                                       generator=generator),
                         torch.rand(num_ranks * rows_per_rank, top_k, generator=generator).view(torch.int32)), 1)
    y_RD = torch.randn(num_ranks * rows_per_rank * top_k, HIDDEN, generator=generator)
    local_JK = meta_JM[:, :top_k] - 5
    weights_JK = meta_JM[:, top_k:].view(torch.float32)
    y_JKD = y_RD.view(-1, top_k, HIDDEN)
    expected_JD = torch.zeros(num_ranks * rows_per_rank, HIDDEN)
    for k in range(top_k):  # in increasing k, only this rank's experts (local ids 0 .. 3)
        is_local_J1 = ((local_JK[:, k] >= 0) & (local_JK[:, k] < num_local))[:, None]
        expected_JD += torch.where(is_local_J1, y_JKD[:, k] * weights_JK[:, k:k + 1], 0.0)
    assert torch.equal(tep.partials(y_RD, meta_JM, 5, num_local), expected_JD)
    buffers = [torch.full((num_ranks * rows_per_rank, HIDDEN), float("nan")) for _ in range(num_ranks)]
    pointers = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    tep.partials(y_RD, meta_JM, 5, num_local, owners=(pointers, first_row))
    for owner, buffer in enumerate(buffers):
        mine = slice(owner * rows_per_rank, (owner + 1) * rows_per_rank)
        assert torch.equal(buffer[first_row:first_row + rows_per_rank], expected_JD[mine])
        assert buffer[:first_row].isnan().all()


def test_align_places_only_local_experts(tep):
    """Gathered ids (+ 1, 0 for padding) offset to one rank's experts: the others and the padding
    get no position and count nowhere."""
    ids_JK = torch.tensor([[1, 4, 6], [0, 0, 0], [2, 5, 8], [3, 5, 7]], dtype=torch.int32)
    a = tep.moe_align.align(ids_JK, 4, 1, id_offset=5)  # local experts 0..3 = global 4..7, ids + 1 5..8
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
        ids_TK, weights_TK = tep.routing.route(torch.nn.functional.linear(x_TD, reference.w_gate_ED), top_k,
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


# Two ranks (4 local experts each, both top_k below that): each top_k once, one case with an idle rank.
# Four ranks (2 local experts each): top_k equal to that and above it (a token's experts on one rank:
# up to min(top_k, 2)).
@pytest.mark.parametrize(("tokens_N", "top_k"), [([5, 3], 2), ([0, 7], 3), ([4, 0, 9, 1], 2), ([4, 0, 9, 1], 3)])
def test_simulated_ranks_match_the_one_rank_layer(tep, tokens_N, top_k):
    for out_TD, expected_TD in _simulated(tep, _weights(torch.float32), top_k, tokens_N, torch.float32):
        torch.testing.assert_close(out_TD, expected_TD, atol=1e-5, rtol=1e-5)


def test_simulated_ranks_round_like_torch(tep):
    """fp16 with every sum exact: the roundings of gate, up, SiLU, the product, the down output,
    the weighted output and the final one are the torch layer's, bit for bit."""
    for out_TD, expected_TD in _simulated(tep, _weights(torch.float16, coarse=True), 3, [6, 2], torch.float16):
        assert torch.equal(out_TD, expected_TD)


class _GlooExchange:
    """exchange.symmetric.SymmetricExchange's protocol (push) over gloo, on the CPU where symmetric
    memory is not: this rank's kernels write into local stand-ins for every rank's buffers (their
    addresses in the pointer tables, as the peers' mapped ones are on a GPU), and the barriers
    become gloo all_to_alls that deliver each stand-in's slot to its rank. So gathered_moe's use
    of an exchange and the kernels' push addressing (rows to every rank, partials to their owner,
    the reduce over the slots of one buffer) run as on GPUs."""

    def __init__(self, max_rows_per_rank: int, row_width: int, dtype, rank: int, sx):
        self.rank, self.num_ranks, self.sx = rank, 2, sx
        self.row_width, self.max_rows_per_rank = row_width, max_rows_per_rank
        rows, partials = ((self.num_ranks * max_rows_per_rank, width) for width in (row_width, HIDDEN))
        self.rows_for = [torch.full(rows, float("nan"), dtype=dtype) for _ in range(self.num_ranks)]
        self.partials_for = [torch.full(partials, float("nan")) for _ in range(self.num_ranks)]
        self.rows, self.partials = torch.full(rows, float("nan"), dtype=dtype), torch.full(partials, float("nan"))
        self.calls = []

    def fits(self, rows_per_rank: int, row_width: int) -> bool:
        return rows_per_rank <= self.max_rows_per_rank and row_width == self.row_width

    def _deliver(self, stand_ins, mine, rows_per_rank: int):
        """Slot `rank` of each stand-in to its rank; each rank's slots, in rank order, into mine."""
        slot = slice(self.rank * rows_per_rank, (self.rank + 1) * rows_per_rank)
        received = mine[:self.num_ranks * rows_per_rank]
        dist.all_to_all_single(received, torch.cat([s[slot] for s in stand_ins]))
        return received

    def row_target(self, rows_per_rank: int):
        b = rows_per_rank
        return (self.rows_for[self.rank][self.rank * b:(self.rank + 1) * b], (_pointers(self.rows_for), self.rank * b),
                None)

    def gathered_rows(self, rows_per_rank: int):
        self.calls.append("gathered_rows")
        return self._deliver(self.rows_for, self.rows, rows_per_rank), None

    def partial_target(self, rows_per_rank: int):
        return (self.partials[:self.num_ranks * rows_per_rank],
                (_pointers(self.partials_for), self.rank * rows_per_rank), None)

    def reduce(self, num_tokens: int, rows_per_rank: int, dtype, add_norm=None):
        self.calls.append("reduce")
        self._deliver(self.partials_for, self.partials, rows_per_rank)
        own_N = _pointers([self.partials] * self.num_ranks)
        if add_norm is not None:
            return self.sx.reduce_add_norm(own_N, add_norm, 0, rows_per_rank)
        out_TD = torch.empty(num_tokens, HIDDEN, dtype=dtype)
        self.sx.reduce_rows(own_N, out_TD, 0, rows_per_rank)
        return out_TD


def _pointers(buffers) -> torch.Tensor:
    return torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)


def _gloo_worker(rank: int, init_file: str, cases: list[tuple[list[int], bool]], top_k: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    try:
        torch.set_num_threads(1)
        with (interpreted("kernels.moe_ep") as tep, interpreted("exchange.symmetric") as sx,
              interpreted("kernels.norm") as norm):
            tep.moe_gemm.default_config = lambda _num_tokens: _config(tep)
            weights = _weights(torch.float32)
            for tokens_N, exchange in cases:
                _gloo_case(rank, tep, sx, norm, weights, tokens_N, top_k, exchange)
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_rank()


def _gloo_case(rank: int, tep, sx, norm, weights, tokens_N: list[int], top_k: int, exchange: bool) -> None:
    """One step of the layer on this rank of the two, tokens_N[rank] tokens, checked against the one-rank layer."""
    comm = ExpertComm(dist.group.WORLD)
    rows_per_rank = max(tokens_N) + 1
    if exchange:  # buffers for this step exactly: a bigger one takes the collectives
        comm.exchange = _GlooExchange(rows_per_rank, tep.row_width(HIDDEN, top_k, torch.float32),
                                      torch.float32, rank, sx)
    layer = _layer(weights, top_k, comm)
    reference = _layer(weights, top_k)
    x_TD = _tokens(tokens_N[rank], torch.float32, seed=rank)
    out_TD = tep.gathered_moe(layer, x_TD, rows_per_rank=rows_per_rank)
    expected_TD = reference(x_TD)
    torch.testing.assert_close(out_TD, expected_TD, atol=1e-5, rtol=1e-5)
    assert torch.equal(layer.hit_counts_E, reference.hit_counts_E)  # this rank's tokens' experts
    # With the fused layer loop's residual add and next norm: the same bits as after the layer.
    norm_D = torch.rand(HIDDEN, generator=torch.Generator().manual_seed(9)) + 0.5
    residual_TD = _tokens(tokens_N[rank], torch.float32, seed=20 + rank)
    fused_x_TD, unfused_x_TD = residual_TD.clone(), residual_TD.clone()
    h_TD = tep.gathered_moe(layer, x_TD, rows_per_rank, _add_norm(norm, fused_x_TD, norm_D))
    expected_h_TD = _add_norm(norm, unfused_x_TD, norm_D)(out_TD)
    assert torch.equal(fused_x_TD, unfused_x_TD) and torch.equal(h_TD, expected_h_TD)
    if exchange:
        assert comm.exchange.calls == ["gathered_rows", "reduce"] * 2
        out_TD = tep.gathered_moe(layer, x_TD, rows_per_rank=rows_per_rank + 1)
        assert comm.exchange.calls == ["gathered_rows", "reduce"] * 2  # did not fit: collectives
        torch.testing.assert_close(out_TD, expected_TD, atol=1e-5, rtol=1e-5)


def _add_norm(norm, x_TD: torch.Tensor, norm_D: torch.Tensor) -> AddNorm:
    """The fused layer loop's AddNorm (kernels/norm.py's add_rms_norm_, interpreted)."""
    return AddNorm(x_TD, norm_D, 1e-6, norm.add_rms_norm_)


def test_gathered_moe_over_two_gloo_ranks(tmp_path):
    """The whole layer with its all_gather and reduce_scatter (an idle rank too, and a padding row);
    through an exchange's buffers where the step fits them. The cases one after the other in one
    pair of processes (spawning a pair costs more than a case)."""
    pytest.importorskip("triton")
    cases = [([5, 3], False), ([0, 4], False), ([5, 3], True)]
    torch.multiprocessing.spawn(_gloo_worker, args=(str(tmp_path / "rendezvous"), cases, 2), nprocs=2)


def test_expert_parallel_steps_on_cuda_take_a_fixed_capacity(monkeypatch):
    """Where moe_ep takes the layers (moe_backend.gathers_on), a step bigger than the decode buckets
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


@pytest.mark.parametrize("tokens_N", [[5, 3], [2, 0, 4, 1]])
def test_signalled_push_layers_match_the_one_rank_layer_and_leave_the_flags_consistent(tep, tokens_N):
    """The symmetric exchange's signals, the ranks simulated in one process and run in turn (each kernel
    of every rank before the next kernel): route_pack pushes the rows and sets this rank's rows
    flag in each peer's pad, the count kernel waits for the peers' flags, partials pushes and
    sets the partials flags, the sum waits for them. Over three layers: the one-rank layer's
    output each time, the producers' counters back at zero, and each channel's flags cleared by
    the other channel's producer before they are set again."""
    flags_mod = tep.flags
    sx = __import__("services.model.exchange.symmetric", fromlist=["reduce_rows"])
    num_ranks, top_k = len(tokens_N), 2
    num_local, rows_per_rank = NUM_EXPERTS // num_ranks, max(tokens_N)
    weights = _weights(torch.float32)
    reference = _layer(weights, top_k)
    layers = [_layer(weights, top_k, _FakeComm(rank, num_ranks)) for rank in range(num_ranks)]
    width = tep.row_width(HIDDEN, top_k, torch.float32)
    rows = [torch.full((num_ranks * rows_per_rank, width), float("nan")) for _ in range(num_ranks)]
    partials = [torch.full((num_ranks * rows_per_rank, HIDDEN), float("nan")) for _ in range(num_ranks)]
    pads = [torch.zeros(3 * num_ranks, dtype=torch.int32) for _ in range(num_ranks)]
    row_ptrs, partial_ptrs, pads_N = (torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64)
                                      for ts in (rows, partials, pads))
    flags = [flags_mod.exchange_flags(pads_N, rank, "cpu", timeout_ns=10 ** 9) for rank in range(num_ranks)]
    rows_ch, partials_ch = flags_mod.ROWS_CHANNEL, flags_mod.PARTIALS_CHANNEL

    def channel(rank, ch):
        return pads[rank][ch * num_ranks:(ch + 1) * num_ranks].tolist()

    def peers_set(rank):
        return [int(s != rank) for s in range(num_ranks)]

    for layer_index in range(3):
        xs = [_tokens(n, torch.float32, seed=30 + 7 * layer_index + rank) for rank, n in enumerate(tokens_N)]
        for rank, (layer, x_TD) in enumerate(zip(layers, xs)):
            b = rows_per_rank
            tep._route_and_pack(layer, x_TD, b, rows[rank][rank * b:(rank + 1) * b], (row_ptrs, rank * b),
                                flags[rank]["rows"])
        for rank in range(num_ranks):
            assert channel(rank, rows_ch) == peers_set(rank) and channel(rank, partials_ch) == [0] * num_ranks
        for rank, layer in enumerate(layers):
            tep.local_partials(rows[rank], HIDDEN, top_k, 1 + rank * num_local, layer.w_gate_up_LGD,
                               layer.w_down_LDF, _config(tep), partials[rank], (partial_ptrs, rank * rows_per_rank),
                               flags[rank]["partials"], wait=flags[rank]["rows_wait"])
        for rank in range(num_ranks):
            assert channel(rank, rows_ch) == [0] * num_ranks and channel(rank, partials_ch) == peers_set(rank)
        for rank, x_TD in enumerate(xs):
            out_TD = torch.empty(tokens_N[rank], HIDDEN)
            sx.reduce_rows(partial_ptrs[rank].repeat(num_ranks), out_TD, 0, rows_per_rank, flags[rank]["partials_wait"])
            torch.testing.assert_close(out_TD, reference(x_TD), atol=1e-5, rtol=1e-5)
        assert all(int(f[name].counter_1) == 0 for f in flags for name in ("rows", "partials"))

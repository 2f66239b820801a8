"""The exchange's flags (services/model/kernels/flags.py) compiled on one GPU (skipped without CUDA).

The ranks are simulated on one device: each rank's buffers and signal pad are plain allocations,
their addresses in the pointer tables as the peers' mapped ones are on several GPUs.
1. The push layer with signals, every rank's kernels in turn on one stream: the same bits as push
   without them (route_pack, align, the GEMMs, partials, the sum), the flags and counters as the
   protocol leaves them.
2. A consumer launched before its producer (another stream, behind a sleep) waits for it: the sum
   reads the partials the producer wrote, not what the buffer held. (The producer's kernels are
   loaded first: a lazy load in the same process would wait for the spinning consumer.)
3. A wait that nothing answers traps after its timeout: the process fails instead of hanging.
"""

import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HIDDEN, WIDTH, NUM_EXPERTS, TOP_K = 256, 128, 16, 4


def _pointers(tensors) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device="cuda")


class _Ranks:
    """num_ranks simulated ranks' buffers, signal pads and producer counters."""

    def __init__(self, num_ranks: int, rows_per_rank: int):
        from services.model.kernels import flags, moe_ep

        self.flags, self.num_ranks, self.b = flags, num_ranks, rows_per_rank
        width = moe_ep.row_width(HIDDEN, TOP_K, torch.bfloat16)
        self.rows = [torch.full((num_ranks * rows_per_rank, width), float("nan"), dtype=torch.bfloat16,
                                device="cuda") for _ in range(num_ranks)]
        self.partials = [torch.full((num_ranks * rows_per_rank, HIDDEN), float("nan"), device="cuda")
                         for _ in range(num_ranks)]
        self.pads = [torch.zeros(3 * num_ranks, dtype=torch.int32, device="cuda") for _ in range(num_ranks)]
        self.row_ptrs, self.partial_ptrs, self.pads_N = map(_pointers, (self.rows, self.partials, self.pads))
        self.of = [flags.exchange_flags(self.pads_N, r, "cuda", timeout_ns=10 ** 10) for r in range(num_ranks)]

    def channel(self, rank: int, channel: int) -> list[int]:
        return self.pads[rank][channel * self.num_ranks:(channel + 1) * self.num_ranks].tolist()


def _layer_inputs(num_ranks: int, tokens: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w_gate_ED = torch.randn(NUM_EXPERTS, HIDDEN, generator=g, device="cuda").bfloat16()
    w_gate_up_EGD = (torch.randn(NUM_EXPERTS, 2 * WIDTH, HIDDEN, generator=g, device="cuda") * 0.05).bfloat16()
    w_down_EDF = (torch.randn(NUM_EXPERTS, HIDDEN, WIDTH, generator=g, device="cuda") * 0.05).bfloat16()
    xs = [torch.randn(tokens, HIDDEN, generator=g, device="cuda").bfloat16() for _ in range(num_ranks)]
    return w_gate_ED, w_gate_up_EGD, w_down_EDF, xs


def _run_layer(ranks: _Ranks, inputs, signals: bool) -> list[torch.Tensor]:
    """Every rank's push layer, kernel by kernel in rank order on the current stream."""
    from services.model.exchange import symmetric
    from services.model.kernels import moe_ep

    w_gate_ED, w_gate_up_EGD, w_down_EDF, xs = inputs
    n, b, local = ranks.num_ranks, ranks.b, NUM_EXPERTS // ranks.num_ranks
    for rank, x_TD in enumerate(xs):
        logits_TE = torch.nn.functional.linear(x_TD, w_gate_ED)
        moe_ep.route_pack(logits_TE, x_TD, TOP_K, True, torch.zeros(NUM_EXPERTS, dtype=torch.int64, device="cuda"),
                          b, ranks.rows[rank][rank * b:(rank + 1) * b], (ranks.row_ptrs, rank * b),
                          ranks.of[rank]["rows"] if signals else None)
    for rank in range(n):
        experts = slice(rank * local, (rank + 1) * local)
        moe_ep.local_partials(ranks.rows[rank], HIDDEN, TOP_K, 1 + rank * local,
                              w_gate_up_EGD[experts].contiguous(), w_down_EDF[experts].contiguous(), None,
                              ranks.partials[rank], (ranks.partial_ptrs, rank * b),
                              ranks.of[rank]["partials"] if signals else None,
                              wait=ranks.of[rank]["rows_wait"] if signals else None)
    outs = []
    for rank, x_TD in enumerate(xs):
        out_TD = torch.empty_like(x_TD)
        symmetric.reduce_rows(ranks.partial_ptrs[rank].repeat(n), out_TD, 0, b,
                              ranks.of[rank]["partials_wait"] if signals else None)
        outs.append(out_TD)
    return outs


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_signalled_push_layers_give_push_layers_bits(num_ranks):
    ranks, plain = _Ranks(num_ranks, 32), _Ranks(num_ranks, 32)
    fl, peers = ranks.flags, lambda r: [int(s != r) for s in range(num_ranks)]
    for layer in range(3):
        inputs = _layer_inputs(num_ranks, 32 - layer, seed=layer)
        got, expected = _run_layer(ranks, inputs, True), _run_layer(plain, inputs, False)
        torch.cuda.synchronize()
        for g, e in zip(got, expected):
            assert torch.equal(g, e) and g.float().abs().max() > 0
        for rank in range(num_ranks):  # each sum's flags are set; the rows' were cleared by partials
            assert ranks.channel(rank, fl.PARTIALS_CHANNEL) == peers(rank)
            assert ranks.channel(rank, fl.ROWS_CHANNEL) == [0] * num_ranks
        assert all(int(f[name].counter_1) == 0 for f in ranks.of for name in ("rows", "partials"))


def test_a_consumer_waits_for_its_producer():
    """Rank 0's sum, launched first, spins until rank 1's partials kernel (another stream, after a
    sleep of about 50 ms) has written rank 0's slot 1 and set the flag."""
    from services.model.exchange import symmetric
    from services.model.kernels import moe_ep

    ranks, b = _Ranks(2, 4), 4
    fl = ranks.flags
    g = torch.Generator(device="cuda").manual_seed(3)
    ranks.partials[0][:b] = torch.randn(b, HIDDEN, generator=g, device="cuda")  # rank 0's own slot
    y_RD = torch.randn(2 * b * TOP_K, HIDDEN, generator=g, device="cuda").bfloat16()
    ids = torch.arange(1, TOP_K + 1, dtype=torch.int32, device="cuda").repeat(2 * b, 1)  # experts 0..K-1: local
    weights = torch.full((2 * b, TOP_K), 0.5, device="cuda").view(torch.int32)
    meta_JM = torch.cat([ids, weights], 1)
    expected = moe_ep.partials(y_RD, meta_JM, 1, NUM_EXPERTS)  # rank 1's partials of every row
    out_TD = torch.empty(b, HIDDEN, device="cuda")
    # The producer's kernels loaded first: CUDA loads a kernel lazily at its first launch, and in
    # one process that load waits for the spinning consumer (on several GPUs each rank is its own
    # process, and its producers come before its consumers on its stream).
    scratch = _Ranks(2, b)
    moe_ep.partials(y_RD, meta_JM, 1, NUM_EXPERTS, scratch.partials[1], (scratch.partial_ptrs, b),
                    scratch.of[1]["partials"])
    torch.cuda._sleep(1000)
    consumer, producer = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(consumer):
        symmetric.reduce_rows(ranks.partial_ptrs[0].repeat(2), out_TD, 0, b, ranks.of[0]["partials_wait"])
    with torch.cuda.stream(producer):
        torch.cuda._sleep(100_000_000)
        moe_ep.partials(y_RD, meta_JM, 1, NUM_EXPERTS, ranks.partials[1], (ranks.partial_ptrs, b),
                        ranks.of[1]["partials"])
    torch.cuda.synchronize()
    assert torch.equal(out_TD, ranks.partials[0][:b] + expected[:b])
    assert ranks.channel(0, fl.PARTIALS_CHANNEL) == [0, 1]


def test_an_unanswered_wait_traps_after_its_timeout():
    script = textwrap.dedent("""
        import torch
        from services.model.exchange import symmetric
        from services.model.kernels import flags
        pads = [torch.zeros(6, dtype=torch.int32, device="cuda") for _ in range(2)]
        pads_N = torch.tensor([p.data_ptr() for p in pads], dtype=torch.int64, device="cuda")
        partials = torch.zeros(8, 64, device="cuda")
        wait = flags.Flags(pads_N, 0, flags.PARTIALS_CHANNEL, timeout_ns=200_000_000)
        symmetric.reduce_rows(torch.tensor([partials.data_ptr()] * 2, device="cuda"),
                              torch.empty(4, 64, device="cuda"), 0, 4, wait)
        torch.cuda.synchronize()
        print("RETURNED")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "RETURNED" not in done.stdout, done.stdout + done.stderr[-2000:]

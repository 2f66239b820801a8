"""services/model/exchange/symmetric.py's kernels on the CPU through Triton's interpreter, the ranks'
symmetric buffers simulated by separate tensors of one process (their addresses in the pointer
table, as the peers' mapped addresses are on a GPU). The barriers and the mapping itself are
torch's and need GPUs: bench/ep_gpu.py checks the whole layer on two H200s.

TRITON_INTERPRET=1 must be set before the kernels are defined, so this file sets it first.
"""

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from services.model.layers import AddNorm  # noqa: E402
from tests.triton_interpreter import interpreted  # noqa: E402


@pytest.fixture(scope="module")
def sx():
    with interpreted("exchange.symmetric") as module:
        yield module


def _pointers(buffers) -> torch.Tensor:
    return torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)


@pytest.mark.parametrize("num_ranks,rows_per_rank", [(2, 3), (3, 1), (4, 5)])
def test_gather_stacks_every_ranks_rows_bit_exactly(sx, num_ranks, rows_per_rank):
    width, capacity = 21, 6
    generator = torch.Generator().manual_seed(num_ranks)
    buffers = [torch.randint(-2 ** 15, 2 ** 15, (capacity, width), dtype=torch.int16, generator=generator)
               for _ in range(num_ranks)]
    # Packed rows are bf16 columns followed by int32 / fp32 bits: NaN patterns must come through.
    buffers[0][0, :4] = torch.tensor([-1, 0x7FC1, 0x7F81, -32767], dtype=torch.int16)
    out = torch.zeros(num_ranks * rows_per_rank, width, dtype=torch.bfloat16)
    sx.gather_rows(_pointers(buffers), out, rows_per_rank)
    expected = torch.cat([b[:rows_per_rank] for b in buffers])
    assert torch.equal(out.view(torch.int16), expected)


def test_gather_copies_rows_of_a_four_byte_dtype(sx):
    buffers = [torch.randn(4, 7, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    out = torch.empty(6, 7)
    sx.gather_rows(_pointers(buffers), out, 3)
    assert torch.equal(out, torch.cat([b[:3] for b in buffers]))


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_reduce_sums_this_ranks_rows_in_rank_order(sx, num_ranks):
    rows_per_rank, hidden = 4, 40
    generator = torch.Generator().manual_seed(7)
    partials = [torch.randn(num_ranks * rows_per_rank, hidden, generator=generator) * 3
                for _ in range(num_ranks)]
    for rank in range(num_ranks):
        out = torch.empty(rows_per_rank, hidden)
        sx.reduce_rows(_pointers(partials), out, rank * rows_per_rank)
        mine = slice(rank * rows_per_rank, (rank + 1) * rows_per_rank)
        total = partials[0][mine].clone()
        for p in partials[1:]:
            total += p[mine]
        assert torch.equal(out, total)


def test_reduce_sums_the_slots_of_one_buffer_with_a_row_step(sx):
    """Push: rank r's partials of this rank's rows arrive in slot r of this rank's own buffer
    (rows r * B ..); the pointer table holds that one buffer N times."""
    num_ranks, rows_per_rank, hidden = 3, 4, 40
    buffer = torch.randn(num_ranks * rows_per_rank, hidden, generator=torch.Generator().manual_seed(8)) * 3
    out = torch.empty(rows_per_rank - 1, hidden)  # the rank's tokens: fewer than its B rows
    sx.reduce_rows(_pointers([buffer] * num_ranks), out, 0, rows_per_rank)
    slots = buffer.view(num_ranks, rows_per_rank, hidden)[:, :rows_per_rank - 1]
    assert torch.equal(out, slots[0] + slots[1] + slots[2])


@pytest.mark.parametrize("row_step", [0, 3])
def test_reduce_add_norm_is_the_reduce_then_add_rms_norm_bit_for_bit(sx, row_step):
    """The sum rounded to the model dtype, added into the residual in place, the RMSNorm of the
    result returned: kernels/norm.py's add_rms_norm_ after reduce_rows, the same bits (fp16)."""
    rows_per_rank, hidden = 3, 48
    generator = torch.Generator().manual_seed(5)
    partials = [torch.randn(2 * rows_per_rank, hidden, generator=generator) for _ in range(2)]
    residual = torch.randn(2, hidden, generator=generator).half()
    norm = (torch.rand(hidden, generator=generator) + 0.5).half()
    pointers, add_rms_norm_ = _pointers(partials), importlib.import_module("services.model.kernels.norm").add_rms_norm_
    x_fused, x_unfused = residual.clone(), residual.clone()
    h_fused = sx.reduce_add_norm(pointers, AddNorm(x_fused, norm, 1e-6, add_rms_norm_), 1, row_step)
    summed = torch.empty(2, hidden, dtype=torch.float16)
    sx.reduce_rows(pointers, summed, 1, row_step)
    h_unfused = add_rms_norm_(x_unfused, summed, norm, 1e-6)
    assert torch.equal(x_fused, x_unfused) and torch.equal(h_fused, h_unfused)
    assert not torch.equal(x_fused, residual)


def test_reduce_writes_the_model_dtype(sx):
    # Sums exact in bf16, so the interpreter's fp32 -> bf16 conversion (it truncates; GPUs round
    # to nearest even, checked bit for bit against NCCL's sum by bench/ep_gpu.py) cannot differ.
    generator = torch.Generator().manual_seed(3)
    partials = [(torch.randn(6, 24, generator=generator) * 16).round() / 16 for _ in range(2)]
    out = torch.empty(3, 24, dtype=torch.bfloat16)
    sx.reduce_rows(_pointers(partials), out, 3)
    assert torch.equal(out, (partials[0][3:] + partials[1][3:]).to(torch.bfloat16))


def test_an_empty_step_launches_nothing(sx):
    sx.gather_rows(torch.zeros(2, dtype=torch.int64), torch.empty(0, 8, dtype=torch.bfloat16), 0)
    sx.reduce_rows(torch.zeros(2, dtype=torch.int64), torch.empty(0, 8), 0)

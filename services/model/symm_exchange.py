"""triton_ep's gather and reduce-scatter over symmetric memory (issue 8, CUDA only).

triton_ep's MoE layer moves two messages a layer between the ranks: the
all_gather of the packed rows and the reduce_scatter of the fp32 partials.
Through NCCL each is a collective of its own; at decode sizes (a few MB)
their time is mostly latency. Here each rank's two buffers (packed rows,
fp32 partials) are allocated in symmetric memory
(torch.distributed._symmetric_memory: every rank maps every peer's buffer
into its address space, over NVLink), and a layer is:

1. route_pack writes the rank's B packed rows into its row buffer (send_rows);
2. a barrier (torch's symmetric-memory barrier kernel: every rank signals every
   peer and waits for theirs); then one kernel copies every rank's B rows,
   in rank order, into the gathered J = N * B rows (the peers' over NVLink);
3. the local experts write their fp32 partials of the J rows into the rank's
   partial buffer (partial_rows);
4. a barrier; then one kernel sums, for each of this rank's B rows, every
   rank's partial in rank order in fp32 and rounds once to the model dtype.
   With two ranks that is one fp32 addition, which is commutative: the bits
   of NCCL's reduce_scatter followed by the cast.

One buffer of each serves every layer: a rank rewrites its rows (step 1 of
the next layer) only after the barrier of step 4, which every peer reaches
after its copy of step 2 has read them; and it rewrites its partials (step 3)
only after the next layer's barrier of step 2, which every peer reaches after
its sum of step 4. The buffers hold `max_rows_per_rank` rows per rank (the
decode graphs' largest bucket); bigger steps (prefill chunks) take NCCL.
Every rank makes the same choice, since B is the same on every rank.

Why not NCCL here: each NCCL collective costs a fixed ~15-20 us in a CUDA
graph on two H200s whatever its size at these sizes (facts.md, and
bench/ep_gpu.py), two a layer, 96 a Qwen3-30B-A3B step. This is the usual
way around it (vLLM's and SGLang's custom all-reduce kernels use the same
idea over CUDA IPC); the mapping and the barrier are torch's own.
"""

import warnings

import torch
import torch.distributed as dist
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _gather_kernel(ptrs_ptr, out_ptr, rows_per_rank, width, BLOCK: tl.constexpr):
    """Gathered row j = rank j // B's row j % B, as 16-bit words (bit-exact copies of the
    packed rows, whose int32 and fp32 columns are no model-dtype values)."""
    j = tl.program_id(0).to(tl.int64)
    src = tl.load(ptrs_ptr + j // rows_per_rank).to(tl.pointer_type(tl.int16))
    row = j % rows_per_rank
    for c0 in range(0, width, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        mask = c < width
        tl.store(out_ptr + j * width + c, tl.load(src + row * width + c, mask=mask), mask=mask)


@triton.jit
def _reduce_kernel(ptrs_ptr, out_ptr, first_row, hidden, NUM_RANKS: tl.constexpr, BLOCK_D: tl.constexpr):
    """out row i = the sum over the ranks, in rank order and in fp32, of partial row
    first_row + i, rounded once to out's dtype."""
    i = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = d < hidden
    offset = (first_row + i) * hidden + d
    total = tl.load(tl.load(ptrs_ptr).to(tl.pointer_type(tl.float32)) + offset, mask=mask, other=0.0)
    for r in tl.static_range(1, NUM_RANKS):
        total += tl.load(tl.load(ptrs_ptr + r).to(tl.pointer_type(tl.float32)) + offset, mask=mask, other=0.0)
    tl.store(out_ptr + i * hidden + d, total.to(out_ptr.dtype.element_ty), mask=mask)


def gather_rows(ptrs_N: Tensor, out_JW: Tensor, rows_per_rank: int) -> None:
    """out_JW = the N ranks' first rows_per_rank rows, stacked in rank order; ptrs_N holds
    each rank's row buffer address (int64), rows laid out as out_JW's (copied as 16-bit words)."""
    assert out_JW.is_contiguous() and out_JW.shape[0] == ptrs_N.numel() * rows_per_rank
    words_JW = out_JW.view(torch.int16)
    num_rows, width = words_JW.shape
    if num_rows:
        _gather_kernel[(num_rows,)](ptrs_N, words_JW, rows_per_rank, width,
                                    BLOCK=min(triton.next_power_of_2(width), 1024))


def reduce_rows(ptrs_N: Tensor, out_BD: Tensor, first_row: int) -> None:
    """out_BD = the sum over ranks (in rank order, fp32) of rows first_row.. of each rank's
    fp32 partial buffer (addresses in ptrs_N), rounded to out_BD's dtype."""
    num_rows, hidden = out_BD.shape
    assert out_BD.is_contiguous()
    if num_rows:
        block_d = min(triton.next_power_of_2(hidden), 1024)
        _reduce_kernel[(num_rows, triton.cdiv(hidden, block_d))](ptrs_N, out_BD, first_row, hidden,
                                                                 NUM_RANKS=ptrs_N.numel(), BLOCK_D=block_d)


def _rendezvous(symm_mem, tensor: Tensor, group: dist.ProcessGroup):
    """symm_mem.rendezvous; torch releases before symmetric memory needed no set-up per group
    want enable_symm_mem_for_group first (deprecated since, and a no-op once done)."""
    try:
        return symm_mem.rendezvous(tensor, group.group_name)
    except RuntimeError:
        if not hasattr(symm_mem, "enable_symm_mem_for_group"):
            raise
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        symm_mem.enable_symm_mem_for_group(group.group_name)
    return symm_mem.rendezvous(tensor, group.group_name)


class SymmetricExchange:
    """The row and partial buffers of one rank in symmetric memory, for steps of at most
    max_rows_per_rank rows per rank (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup, max_rows_per_rank: int, row_width: int, hidden: int,
                 dtype: torch.dtype, device: torch.device | str, timeout_ms: int = 0):
        import torch.distributed._symmetric_memory as symm_mem

        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.max_rows_per_rank, self.row_width, self.hidden = max_rows_per_rank, row_width, hidden
        self.timeout_ms = timeout_ms
        self._rows = symm_mem.empty(max_rows_per_rank, row_width, dtype=dtype, device=device)
        self._partials = symm_mem.empty(self.world_size * max_rows_per_rank, hidden, dtype=torch.float32,
                                        device=device)
        self._rows_handle = _rendezvous(symm_mem, self._rows, group)
        self._partials_handle = _rendezvous(symm_mem, self._partials, group)
        self._row_ptrs_N = self._peer_pointers(self._rows_handle, self._rows, group)
        self._partial_ptrs_N = self._peer_pointers(self._partials_handle, self._partials, group)

    def _peer_pointers(self, handle, local: Tensor, group) -> Tensor:
        """Every rank's address of `local`'s buffer (int64, on the device): the peers' mapped
        base addresses plus local's offset in its allocation, checked equal on every rank."""
        offset = local.data_ptr() - handle.buffer_ptrs[self.rank]
        offsets = torch.tensor([offset], dtype=torch.int64, device=local.device)
        everyone = offsets.new_empty(self.world_size)
        dist.all_gather_into_tensor(everyone, offsets, group=group)
        if not bool((everyone == offset).all()):
            raise RuntimeError(f"symmetric buffers at different offsets on the ranks: {everyone.tolist()}")
        return torch.tensor([p + offset for p in handle.buffer_ptrs], dtype=torch.int64, device=local.device)

    def fits(self, rows_per_rank: int, row_width: int) -> bool:
        """Whether a step of rows_per_rank rows of this width goes through the exchange."""
        return rows_per_rank <= self.max_rows_per_rank and row_width == self.row_width

    def send_rows(self, rows_per_rank: int) -> Tensor:
        """The rank's row buffer's first rows_per_rank rows: where route_pack / pack write."""
        return self._rows[:rows_per_rank]

    def partial_rows(self, num_rows: int) -> Tensor:
        """The rank's fp32 partial buffer's first num_rows (= N * B) rows."""
        return self._partials[:num_rows]

    def owns(self, tensor: Tensor) -> bool:
        """Whether tensor starts one of this rank's two buffers (a send_rows / partial_rows view)."""
        return tensor.data_ptr() in (self._rows.data_ptr(), self._partials.data_ptr())

    def all_gather(self, out_JW: Tensor, send_BW: Tensor) -> None:
        """out_JW = every rank's send_rows(B) in rank order (send_BW must be this rank's)."""
        assert send_BW.data_ptr() == self._rows.data_ptr(), "all_gather takes send_rows' view"
        self._rows_handle.barrier(channel=0, timeout_ms=self.timeout_ms)
        gather_rows(self._row_ptrs_N, out_JW, send_BW.shape[0])

    def reduce_scatter(self, out_BD: Tensor, partial_JD: Tensor) -> None:
        """out_BD = the rank-order fp32 sum of every rank's partial rows of this rank (rows
        rank * B ..), rounded to out_BD's dtype (partial_JD must be partial_rows' view)."""
        assert partial_JD.data_ptr() == self._partials.data_ptr(), "reduce_scatter takes partial_rows' view"
        self._partials_handle.barrier(channel=0, timeout_ms=self.timeout_ms)
        reduce_rows(self._partial_ptrs_N, out_BD, self.rank * out_BD.shape[0])

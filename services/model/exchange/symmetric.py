"""kernels/moe_ep.py's gather and reduce-scatter over symmetric memory (issue 8, CUDA only).

moe_ep's MoE layer moves two messages a layer between the ranks: every
rank's packed rows to every rank, and the fp32 partials of each rank's rows
back to it. Through NCCL each is a collective of its own; at decode sizes (a
few MB) their time is mostly latency. Here each rank's two buffers (rows,
fp32 partials) are allocated in symmetric memory
(torch.distributed._symmetric_memory: every rank maps every peer's buffer
into its address space, over NVLink). With push (the expert service's
--ep-exchange-push) each rank writes into its peers' buffers, and a layer is:

1. route_pack writes the rank's B packed rows into slot `rank` (rows
   rank * B ..) of every rank's row buffer, its own included (row_target);
2. a barrier (torch's symmetric-memory barrier kernel: every rank signals every
   peer and waits for theirs); the rank's buffer now holds the J = N * B
   gathered rows in rank order (gathered_rows): the experts read them there;
3. the local experts' fp32 partial of gathered row j goes to its owner,
   rank j // B, into slot `rank` of that rank's partial buffer (partial_target);
4. a barrier; then one kernel sums, for each of this rank's B rows, the N slots
   of its own partial buffer in rank order in fp32 and rounds once to the model
   dtype (reduce), and may add the sum into the residual stream and take the
   next layer's RMSNorm (kernels/norm.py's add_rms_norm_, the same bits).
   With two ranks that is one fp32 addition, which is commutative: the bits
   of NCCL's reduce_scatter followed by the cast.

Without push (pull, the default, and the mode measured on two GPUs) each
rank writes only its own buffers and reads its peers':
step 1 writes the rank's own row buffer, step 2 adds a kernel that copies
every rank's rows into a gathered tensor, step 3 keeps the partials local and
step 4 reads the peers' slots. Push saves that copy, and its reads are local,
while the writes over NVLink need no round trip; it is not yet measured on
two GPUs.

One buffer of each serves every layer. With push, rank s writes rank r's rows
(step 1 of the next layer) only after the barrier of step 4, which r reaches
after its experts have read them; and it writes r's partials (step 3 of the
next layer) only after the next layer's barrier of step 2, which r reaches
after its sum of step 4. With pull the same two barriers keep the peers'
reads ahead of the rewrites. The buffers hold `max_rows_per_rank` rows per
rank (the decode graphs' largest bucket); bigger steps (prefill chunks) take
NCCL. Every rank makes the same choice, since B is the same on every rank.

With signals (--ep-exchange-signals, push only) the two barriers are not
kernels: route_pack's and partials' last program sets this rank's flag in
each peer's signal pad, and the kernels that read the rows (align's count
kernel) and the partials (the sum) wait for the peers' flags first
(services/model/kernels/flags.py). Not yet measured on two GPUs.

Why not NCCL here: each NCCL collective costs a fixed latency in a CUDA
graph whatever its size at these sizes (docs/performance.md), two a layer,
96 a Qwen3-30B-A3B step. This is the usual
way around it (vLLM's and SGLang's custom all-reduce kernels use the same
idea over CUDA IPC); the mapping and the barrier are torch's own.
"""

import warnings

import torch
import torch.distributed as dist
import triton
import triton.language as tl
from torch import Tensor

from services.model.kernels import flags
from services.model.kernels.norm import add_residual, store_rms_norm
from services.model.layers import AddNorm


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
def _reduce_kernel(ptrs_ptr, out_ptr, x_ptr, norm_ptr, first_row, row_step, hidden, eps, flag_pads_ptr, flag_rank,
                   flag_channel, flag_timeout_ns, NUM_RANKS: tl.constexpr, ADD_NORM: tl.constexpr,
                   BLOCK_D: tl.constexpr, FLAG_RANKS: tl.constexpr, WAIT: tl.constexpr):
    """Row i: the sum over r, in rank order and in fp32, of row first_row + r * row_step + i
    of buffer r (its address at ptrs_ptr + r), rounded once to the model dtype. ADD_NORM (one
    program a row): that sum added into x's row i in place, out = the new row's RMSNorm.
    WAIT: once the peers' flags say their partials are in (signals)."""
    if WAIT:
        flags.wait_flags(flag_pads_ptr, flag_rank, flag_channel, flag_timeout_ns, FLAG_RANKS)
    i = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = d < hidden
    total = tl.load(tl.load(ptrs_ptr).to(tl.pointer_type(tl.float32)) + (first_row + i) * hidden + d, mask=mask,
                    other=0.0)
    for r in tl.static_range(1, NUM_RANKS):
        src = tl.load(ptrs_ptr + r).to(tl.pointer_type(tl.float32))
        total += tl.load(src + (first_row + r * row_step + i) * hidden + d, mask=mask, other=0.0)
    if ADD_NORM:
        x = tl.load(x_ptr + i * hidden + d, mask=mask, other=0.0)
        x = add_residual(x_ptr, i * hidden + d, mask, x, total.to(x_ptr.dtype.element_ty))
        store_rms_norm(out_ptr, i * hidden + d, mask, x, tl.load(norm_ptr + d, mask=mask, other=0.0).to(tl.float32),
                       hidden, eps)
    else:
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


def reduce_rows(ptrs_N: Tensor, out_BD: Tensor, first_row: int, row_step: int = 0,
                wait: flags.Flags | None = None) -> None:
    """out_BD row i = the sum over ranks r (in rank order, fp32) of row first_row + r * row_step + i
    of the fp32 buffer at ptrs_N[r] (rows of out_BD's width), rounded to out_BD's dtype: with
    row_step 0 each rank's partials of this rank's rows (read from the peers), with row_step B
    the N slots of one buffer (ptrs_N's addresses all this rank's). wait: the peers' flags it
    waits for first (signals)."""
    num_rows, hidden = out_BD.shape
    assert out_BD.is_contiguous()
    if num_rows:
        block_d = min(triton.next_power_of_2(hidden), 1024)
        _reduce_kernel[(num_rows, triton.cdiv(hidden, block_d))](
            ptrs_N, out_BD, out_BD, out_BD, first_row, row_step, hidden, 0.0, NUM_RANKS=ptrs_N.numel(),
            ADD_NORM=False, BLOCK_D=block_d, **flags.wait_args(wait, ptrs_N))


def reduce_add_norm(ptrs_N: Tensor, add_norm: AddNorm, first_row: int, row_step: int = 0,
                    wait: flags.Flags | None = None) -> Tensor:
    """add_norm(the sum reduce_rows gives for add_norm.x_TD's rows) in one kernel, the same bits:
    the sum added into x_TD in place, its RMSNorm returned."""
    x_TD = add_norm.x_TD
    assert x_TD.is_contiguous()
    h_TD = torch.empty_like(x_TD)
    if x_TD.shape[0]:
        _reduce_kernel[(x_TD.shape[0], 1)](
            ptrs_N, h_TD, x_TD, add_norm.weight_D, first_row, row_step, x_TD.shape[1], add_norm.eps,
            NUM_RANKS=ptrs_N.numel(), ADD_NORM=True, BLOCK_D=triton.next_power_of_2(x_TD.shape[1]), num_warps=8,
            **flags.wait_args(wait, ptrs_N))
    return h_TD


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
    max_rows_per_rank rows per rank (see the module docstring: push, or pull; signals, push
    with flags instead of barriers).

    moe_ep.gathered_moe's protocol: route_pack into row_target(B) (out, dests, signal);
    gathered_rows(B) (the rows, the flags align waits for); the partials into partial_target(B)
    (out, owners, signal); reduce."""

    def __init__(self, group: dist.ProcessGroup, max_rows_per_rank: int, row_width: int, hidden: int,
                 dtype: torch.dtype, device: torch.device | str, timeout_ms: int = 0, push: bool = False,
                 signals: bool = False):
        import torch.distributed._symmetric_memory as symm_mem

        if signals and not push:
            raise ValueError("the exchange's signals need push (the flags follow writes into the peers' buffers)")
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.max_rows_per_rank, self.row_width, self.hidden = max_rows_per_rank, row_width, hidden
        self.timeout_ms, self.push, self.signals = timeout_ms, push, signals
        num_rows = self.world_size * max_rows_per_rank
        self._rows = symm_mem.empty(num_rows if self.push else max_rows_per_rank, row_width, dtype=dtype,
                                    device=device)
        self._partials = symm_mem.empty(num_rows, hidden, dtype=torch.float32, device=device)
        self._rows_handle = _rendezvous(symm_mem, self._rows, group)
        self._partials_handle = _rendezvous(symm_mem, self._partials, group)
        self._row_ptrs_N = self._peer_pointers(self._rows_handle, self._rows, group)
        self._partial_ptrs_N = self._peer_pointers(self._partials_handle, self._partials, group)
        # push's reduce reads the N slots of its own buffer
        self._own_partial_ptrs_N = self._partial_ptrs_N[self.rank].repeat(self.world_size)
        self._flags = self._signal_flags(symm_mem, device) if signals else None

    def _signal_flags(self, symm_mem, device) -> dict[str, flags.Flags]:
        """The flags of signals (kernels/flags.py), in the row buffer's signal pads: each message's
        producer's (which clears the other message's) and its consumers'."""
        words = (1 + max(flags.ROWS_CHANNEL, flags.PARTIALS_CHANNEL)) * self.world_size
        pad_bytes = getattr(symm_mem, "get_signal_pad_size", lambda: None)()  # newer torch only
        if pad_bytes is not None and 4 * words > pad_bytes:
            raise RuntimeError(f"{words} flags do not fit a {pad_bytes}-byte signal pad")
        pads_N = torch.tensor(self._rows_handle.signal_pad_ptrs, dtype=torch.int64, device=device)
        return flags.exchange_flags(pads_N, self.rank, device, self.timeout_ms * 1_000_000)

    def _flag(self, name: str) -> flags.Flags | None:
        return None if self._flags is None else self._flags[name]

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

    def row_target(self, rows_per_rank: int) -> tuple[Tensor, tuple[Tensor, int] | None, flags.Flags | None]:
        """Where route_pack / pack write this rank's B rows: (out, dests, signal) as they take them."""
        b = rows_per_rank
        if self.push:  # slot `rank` of every rank's buffer
            return self._rows[self.rank * b:(self.rank + 1) * b], (self._row_ptrs_N, self.rank * b), self._flag("rows")
        return self._rows[:b], None, None

    def gathered_rows(self, rows_per_rank: int) -> tuple[Tensor, flags.Flags | None]:
        """(recv_JW, wait): every rank's B rows in rank order, once every rank has written its own
        (after a barrier; with signals, once the flags `wait` says so: align waits for them)."""
        if self.signals:
            return self._rows[:self.world_size * rows_per_rank], self._flag("rows_wait")
        self._rows_handle.barrier(channel=0, timeout_ms=self.timeout_ms)
        if self.push:
            return self._rows[:self.world_size * rows_per_rank], None
        recv_JW = self._rows.new_empty(self.world_size * rows_per_rank, self.row_width)
        gather_rows(self._row_ptrs_N, recv_JW, rows_per_rank)
        return recv_JW, None

    def partial_target(self, rows_per_rank: int) -> tuple[Tensor, tuple[Tensor, int] | None,
                                                          flags.Flags | None]:
        """Where moe_ep.partials writes the J gathered rows' partials: (out, owners, signal) as
        it takes them (push: row j into slot `rank` of its owner j // B's buffer)."""
        partial_JD = self._partials[:self.world_size * rows_per_rank]
        if not self.push:
            return partial_JD, None, None
        return partial_JD, (self._partial_ptrs_N, self.rank * rows_per_rank), self._flag("partials")

    def reduce(self, num_tokens: int, rows_per_rank: int, dtype: torch.dtype,
               add_norm: AddNorm | None = None) -> Tensor:
        """This rank's first num_tokens rows summed over the ranks' partials (fp32, rank order),
        rounded to dtype, once every rank has written them; add_norm(that), fused, if given."""
        if not self.signals:  # with signals the sum's kernel waits for the flags
            self._partials_handle.barrier(channel=0, timeout_ms=self.timeout_ms)
        if self.push:
            ptrs_N, first_row, row_step = self._own_partial_ptrs_N, 0, rows_per_rank
        else:
            ptrs_N, first_row, row_step = self._partial_ptrs_N, self.rank * rows_per_rank, 0
        wait = self._flag("partials_wait")
        if add_norm is not None:
            return reduce_add_norm(ptrs_N, add_norm, first_row, row_step, wait)
        out_TD = self._partials.new_empty(num_tokens, self.hidden, dtype=dtype)
        reduce_rows(ptrs_N, out_TD, first_row, row_step, wait)
        return out_TD

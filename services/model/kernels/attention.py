"""Paged attention in Triton: a KV write, a split-K decode kernel and a varlen prefill kernel.

All three read the block tables and lengths from device tensors only, so a
decode step (every sequence one new token) can be captured in a CUDA graph:
the launch grid and the split count depend on tensor shapes alone.

- KV write (prefill, expanded decode): one program per token, skipping slot -1
  (padding rows).
- Decode (flash-decoding): one program per (sequence, KV head, split) runs
  all query heads of its group against one slice of the context with an
  online softmax in fp32; the split holding the step's token writes its K/V
  first (no KV-write kernel in decode steps). With several splits a second
  kernel merges the partial results, so one long sequence still fills the
  GPU; splits past a row's context (a graph's split count comes from its
  block-table width, not the row's length) exit at once and are not read.
  (Merging in the last split to finish, by an atomic count, was tried: one
  program merging serially was slower than the two kernels plus the KV write.)
- Prefill: one program per (tile of BLOCK_Q new tokens of a sequence, KV
  head), rows = tile tokens x group heads; a chunk may start mid-sequence and
  attends to every cached token plus its own tokens causally. The tiles are
  listed on the host (the batch's q_lens, once per step): a grid of
  (sequences, heads, the longest chunk's tiles) gave a step of 8 chunks of
  512 and 256 decodes 64 programs per decode row, 63 of them empty (67,584
  programs for 3,072 tiles of work). With mixed_decode the single-token
  sequences of such a batch go through the decode kernel instead (their
  K/V stored with the chunks'), as a list of sequence ids.
- Whole prompts (no cached prefix) of at least SDPA_PREFILL_MIN_TOKENS tokens:
  torch's scaled_dot_product_attention on the step's own K/V (cuDNN's fused
  kernel first), causal, query heads grouped over the KV heads; the prefill
  kernel tiles the rest of the batch. On an H200 cuDNN ran a 4-8K-token
  causal prompt at about twice the prefill kernel's speed, and the FLOPs of a
  long prompt's attention grow with its square, so these prompts are where a
  prefill step's attention time goes; with a cached prefix (later chunks,
  prefix-cache hits) the causal mask is aligned to the bottom right, which
  cuDNN ran no faster than this kernel, so those stay here. A float8 cache
  keeps every prompt here: this kernel attends to the K/V as stored, rounded.
  cuDNN builds a graph for each new sequence length (tens to hundreds of ms
  of host time, the device idle behind it), and in serving a prompt's first
  chunk can have any length the step budget leaves: so a prompt runs at the
  length of its bucket (sdpa_length: 16 lengths a power of two, at most 1/8
  more rows, about 3% on average), the rows past it being later tokens that
  no row of the prompt sees under the causal mask (the step's next rows, or
  zeros where the step ends), and `warm_whole_prompts` builds every bucket's
  graph when the model loads.
- Expanded decode (ForwardBatch.is_expanded: a sequence's few new tokens as
  consecutive decode rows): row j + 1 reads row j's K/V, which another
  program of the same launch would write, so the KV-write kernel stores every
  row first and the decode kernel writes nothing (STORE_KV off); the grid
  still comes from shapes only, so the step captures as a decode step does.

A row with context length 0 (padding) gets zeros. Legend as in attention.py;
N context tokens of one loop step, S splits.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from services.kv_pool import KVPool
from services.model.attention import ATTENTION_BACKENDS, AttentionBackend, output_like
from services.model.batch import length_bucket, length_buckets, to_device
from services.model.kernels import launch

_LOG2E = 1.4426950408889634
# A split covers at least this many tokens, at most this many splits: on an H200 one sequence
# wants many splits at long contexts, big batches few or one (docs/performance.md).
_MIN_SPLIT_TOKENS = 64
_MAX_SPLITS = 64
# Decode programs wanted per SM: the split count makes about this many (sequences x KV
# heads x splits), e.g. raised to compare more splits at big batches.
DECODE_PROGRAMS_PER_SM = 2
# The decode grid's faster-launched axis: True, the KV heads (a sequence's heads, which share
# its K/V pages, together); False, the sequences (each KV head over every sequence in turn).
# True was the faster on an H200 at big batches (docs/performance.md).
DECODE_HEADS_FIRST = True
# Registers per thread of the decode kernel with a float8 cache: its fp16 copies of each K/V
# block take more than 128 (three programs an SM); capped at 128 (four programs) the step is
# faster with the same bits; 96 was slower, and the bf16 kernel (128 already) gained nothing
# (docs/performance.md). None: the compiler's.
FP8_DECODE_MAXNREG: int | None = 128
# The decode kernel's (and its merge's) launch settings over the backend's, e.g. {"BLOCK_N": 128,
# "num_warps": 8, "num_stages": 2}, to compare. Empty: the backend's.
DECODE_LAUNCH: dict[str, int] = {}
# With a float8 cache the attention dots take fp16 operands (q rounded to fp16 once, K/V and the
# probabilities converted to it): float8 widens to fp16 in one instruction, to bf16 not, and on an
# H200 the bf16 conversions made the float8 decode kernel slower than the bf16 one
# (docs/performance.md).
# False: bf16 operands (the model dtype), e.g. to compare.
FP8_DOTS_IN_FP16 = True
# Whole prompts of at least this many tokens go to torch's fused attention (module doc); 0: none.
SDPA_PREFILL_MIN_TOKENS = 1024
# Their lengths are rounded up to a bucket: this many a power of two, and at least this step.
SDPA_LENGTHS_PER_OCTAVE = 16
SDPA_MIN_LENGTH_STEP = 64
# Its kernels in the order tried: cuDNN's was the fastest causal prefill on an H200; off CUDA
# only the math one runs.
_SDPA_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                  SDPBackend.MATH]
# The same with flash first (TritonPagedAttention's sdpa_flash_first knob, to compare).
_SDPA_FLASH_FIRST = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                     SDPBackend.MATH]
# The number of SMs assumed off CUDA (the interpreter), for the split count.
_CPU_NUM_SMS = 4


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_t, stride_g, stride_slot,
                     num_kv_heads, head_dim, G_PAD: tl.constexpr, K_PAD: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    g = tl.arange(0, G_PAD)[:, None]
    d = tl.arange(0, K_PAD)[None, :]
    mask = (g < num_kv_heads) & (d < head_dim) & (slot >= 0)
    src = t * stride_t + g * stride_g + d
    dst = slot * stride_slot + g * head_dim + d
    tl.store(k_cache_ptr + dst, tl.load(k_ptr + src, mask=mask).to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(v_ptr + src, mask=mask).to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _attend_block(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_ptr, n, n_mask, is_key, g, d, d_mask,
                  scale_log2, stride_slot, head_dim, BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One online-softmax step of q's rows over context tokens n (those of n_mask, each row is_key)."""
    block = tl.load(table_ptr + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    slot = block * BLOCK_SIZE + n % BLOCK_SIZE
    kv_offs = slot * stride_slot + g * head_dim
    k_KN = tl.load(k_cache_ptr + kv_offs[None, :] + d[:, None], mask=n_mask[None, :] & d_mask[:, None], other=0.0)
    scores = tl.dot(q, k_KN.to(q.dtype), input_precision=DOT_PRECISION) * scale_log2
    scores = tl.where(is_key, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    v_NK = tl.load(v_cache_ptr + kv_offs[:, None] + d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v_NK.to(q.dtype), input_precision=DOT_PRECISION)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _decode_row(i, seq_map_ptr, cu_q_lens_ptr, MIXED: tl.constexpr):
    """Decode row i's sequence and query row. A decode batch: sequence i at row i (its K/V
    written by the decode kernel). MIXED: the single-token sequences of a mixed batch,
    sequence seq_map[i] at its row cu_q_lens[seq] (its K/V stored with the chunks')."""
    if MIXED:
        b = tl.load(seq_map_ptr + i)
        row = tl.load(cu_q_lens_ptr + b).to(tl.int64)
    else:
        b = i
        row = i.to(tl.int64)
    return b, row


@triton.jit
def _decode_kernel(q_ptr, k_new_ptr, v_new_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, o_ptr, part_acc_ptr,
                   part_ml_ptr, block_tables_ptr, context_lens_ptr, seq_map_ptr, cu_q_lens_ptr, scale_log2,
                   stride_qt, stride_qh, stride_nt, stride_ng, stride_ot, stride_oh, stride_bt, stride_slot,
                   num_heads, group, head_dim,
                   BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, GROUP_PAD: tl.constexpr,
                   K_PAD: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
                   MIXED: tl.constexpr, HEADS_FIRST: tl.constexpr, F16_DOTS: tl.constexpr,
                   STORE_KV: tl.constexpr):
    if PDL:  # a programmatic dependent launch (launch.PDL): the previous kernel done first
        launch.wait_for_previous_kernel()
    i, g, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if HEADS_FIRST:
        i, g = g, i
    b, row = _decode_row(i, seq_map_ptr, cu_q_lens_ptr, MIXED)
    context_len = tl.load(context_lens_ptr + b)
    # Each split takes an equal share of this sequence's context, in whole BLOCK_N steps.
    split_len = tl.cdiv(tl.cdiv(context_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, context_len)
    if (NUM_SPLITS > 1) & (start >= context_len):
        return  # past the context: no partial (the merge reads only the splits with tokens)
    h = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, K_PAD)
    h_mask, d_mask = h < group, d < head_dim
    # The step's token (the context's last): the split that reads it writes its K/V to the cache
    # first (a padding row, slot -1, writes nothing); the barrier makes the stores visible to
    # every thread of the program before the loop loads them. STORE_KV off (a mixed or an
    # expanded batch): stored before this kernel.
    if STORE_KV:
        slot = tl.load(slot_ptr + b).to(tl.int64)
        if (slot >= 0) & (start < context_len) & (context_len <= end):
            dst = slot * stride_slot + g * head_dim + d
            src = b * stride_nt + g * stride_ng + d
            tl.store(k_cache_ptr + dst, tl.load(k_new_ptr + src, mask=d_mask).to(k_cache_ptr.dtype.element_ty),
                     mask=d_mask)
            tl.store(v_cache_ptr + dst, tl.load(v_new_ptr + src, mask=d_mask).to(v_cache_ptr.dtype.element_ty),
                     mask=d_mask)
            tl.debug_barrier()
    heads = g * group + h
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    if F16_DOTS:  # the dots' operand type (FP8_DOTS_IN_FP16): _attend_block converts K/V to q's
        q = q.to(tl.float16)
    # A finite floor: a split with no token ends with l = 0 and no NaN.
    m_i = tl.full([GROUP_PAD], -1e30, tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, K_PAD], tl.float32)
    table_ptr = block_tables_ptr + b * stride_bt
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_ptr, n, n_mask,
                                      n_mask[None, :], g, d, d_mask, scale_log2, stride_slot, head_dim,
                                      BLOCK_SIZE, DOT_PRECISION)
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(o_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])
    else:
        part = (i * num_heads + heads) * NUM_SPLITS + split
        tl.store(part_acc_ptr + part[:, None] * K_PAD + d[None, :], acc, mask=h_mask[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=h_mask)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=h_mask)


@triton.jit
def _decode_reduce_kernel(part_acc_ptr, part_ml_ptr, o_ptr, context_lens_ptr, seq_map_ptr, cu_q_lens_ptr,
                          stride_ot, stride_oh, num_heads, head_dim, NUM_SPLITS: tl.constexpr, K_PAD: tl.constexpr,
                          BLOCK_N: tl.constexpr, PDL: tl.constexpr, MIXED: tl.constexpr):
    if PDL:
        launch.wait_for_previous_kernel()
    i, h = tl.program_id(0), tl.program_id(1)
    b, row = _decode_row(i, seq_map_ptr, cu_q_lens_ptr, MIXED)
    # The splits the decode kernel gave tokens (its split length; the others wrote nothing).
    context_len = tl.load(context_lens_ptr + b)
    split_len = tl.cdiv(tl.cdiv(context_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    s = tl.arange(0, NUM_SPLITS)
    has_tokens = s < tl.cdiv(context_len, tl.maximum(split_len, 1))
    part = (i * num_heads + h) * NUM_SPLITS + s
    m_S = tl.load(part_ml_ptr + part * 2, mask=has_tokens, other=-1e30)
    l_S = tl.load(part_ml_ptr + part * 2 + 1, mask=has_tokens, other=0.0)
    w_S = tl.exp2(m_S - tl.max(m_S, 0))
    l_sum = tl.sum(l_S * w_S, 0)
    d = tl.arange(0, K_PAD)
    acc_SK = tl.load(part_acc_ptr + part[:, None] * K_PAD + d[None, :], mask=has_tokens[:, None], other=0.0)
    out = tl.sum(acc_SK * w_S[:, None], 0) / tl.where(l_sum == 0.0, 1.0, l_sum)
    tl.store(o_ptr + row * stride_ot + h * stride_oh + d, out.to(o_ptr.dtype.element_ty), mask=d < head_dim)


# num_tiles changes every step: not specialised on (a value of 1 or a multiple of 16 would
# compile another variant in the middle of serving).
@triton.jit(do_not_specialize=["num_tiles"])
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, o_ptr, block_tables_ptr, context_lens_ptr, cu_q_lens_ptr,
                    tiles_ptr, num_tiles, scale_log2, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                    stride_slot, group, head_dim,
                    BLOCK_SIZE: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                    K_PAD: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, F16_DOTS: tl.constexpr):
    # tiles_ptr: [2, num_tiles] int32, each program's sequence and its tile within the sequence.
    w, g = tl.program_id(0), tl.program_id(1)
    b, tile = tl.load(tiles_ptr + w), tl.load(tiles_ptr + num_tiles + w)
    q_start = tl.load(cu_q_lens_ptr + b)
    q_len = tl.load(cu_q_lens_ptr + b + 1) - q_start
    context_len = tl.load(context_lens_ptr + b)
    # Row r is new token tile * BLOCK_Q + r // GROUP_PAD, query head r % GROUP_PAD of group g.
    r = tl.arange(0, BLOCK_Q * GROUP_PAD)
    qi = tile * BLOCK_Q + r // GROUP_PAD
    h = r % GROUP_PAD
    d = tl.arange(0, K_PAD)
    row_mask, d_mask = (qi < q_len) & (h < group), d < head_dim
    heads = g * group + h
    q = tl.load(q_ptr + (q_start + qi)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    if F16_DOTS:
        q = q.to(tl.float16)
    # The new tokens are the context's last q_len: token qi sits at position context_len - q_len + qi.
    q_pos = context_len - q_len + qi
    end = tl.minimum(context_len, context_len - q_len + (tile + 1) * BLOCK_Q)
    end = tl.where(tile * BLOCK_Q < q_len, end, 0)
    m_i = tl.full([BLOCK_Q * GROUP_PAD], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, K_PAD], tl.float32)
    table_ptr = block_tables_ptr + b * stride_bt
    for n0 in range(0, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_ptr, n, n_mask,
                                      n_mask[None, :] & (n[None, :] <= q_pos[:, None]), g, d, d_mask,
                                      scale_log2, stride_slot, head_dim, BLOCK_SIZE, DOT_PRECISION)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(o_ptr + (q_start + qi)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def sdpa_length(length: int) -> int:
    """The length a whole prompt of `length` tokens attends at: rounded up to a multiple of
    1/SDPA_LENGTHS_PER_OCTAVE of the power of two at or above it (at least SDPA_MIN_LENGTH_STEP),
    so that a few lengths (and cuDNN graphs) serve every prompt."""
    return length_bucket(length, SDPA_LENGTHS_PER_OCTAVE, SDPA_MIN_LENGTH_STEP)


def sdpa_lengths(first: int, last: int) -> list[int]:
    """Every length sdpa_length gives to the prompts of first..last tokens, in order."""
    return length_buckets(first, last, SDPA_LENGTHS_PER_OCTAVE, SDPA_MIN_LENGTH_STEP)


def _attend_whole_prompt(q_THK: Tensor, k_TGK: Tensor, v_TGK: Tensor, o_THK: Tensor, start: int, length: int,
                         scale: float, expand_kv: bool = False) -> None:
    """o_THK's rows start..start+length: causal attention of one whole prompt (nothing cached)
    over its own K/V, by torch's fused kernels (the caller's sdpa_kernel picks them), run at
    sdpa_length(length) rows: the step's rows after the prompt (views, no copies) or, where
    the step ends first, a copy padded with zeros. Causal: no row of the prompt sees them.
    The query heads are grouped over the KV heads, or with `expand_kv` K/V are copied out to
    every query head (for a kernel that runs grouped heads slower, or not at all)."""
    run = sdpa_length(length)
    if start + run <= q_THK.shape[0]:
        q, k, v = (x[start:start + run] for x in (q_THK, k_TGK, v_TGK))
    else:
        q, k, v = (F.pad(x[start:start + length], (0, 0, 0, 0, 0, run - length)) for x in (q_THK, k_TGK, v_TGK))
    if expand_kv:
        group = q.shape[1] // k.shape[1]
        k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, heads, run, D]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=not expand_kv)
    o_THK[start:start + length] = out[0, :, :length].transpose(0, 1)


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Splits per (sequence, KV head): a power of two giving about DECODE_PROGRAMS_PER_SM
    programs per SM.

    From shapes only (max_context is the block table's width in tokens), so a
    captured graph keeps its split count; never more splits than
    max_context / _MIN_SPLIT_TOKENS.
    """
    wanted = triton.cdiv(DECODE_PROGRAMS_PER_SM * num_sms, max(1, num_seqs * num_kv_heads))
    most = triton.cdiv(max(1, max_context), _MIN_SPLIT_TOKENS)
    splits = max(1, min(wanted, most, _MAX_SPLITS))
    return triton.next_power_of_2(splits)


class TritonPagedAttention(AttentionBackend):
    """Paged attention with Triton kernels; the decode path is CUDA graph capturable.

    `decode_splits` fixes the decode split count (a power of two); None picks
    it from the batch shape and the GPU's SM count (decode_num_splits). The
    rest are tuning knobs: context tokens per loop step, prefill rows (tokens
    x group heads) per program, warps per program, the prefill kernel's
    software-pipeline stages (None: Triton's default), and `mixed_decode`: in a
    batch with prefill chunks, the single-token sequences (the decodes) go
    through the decode kernel (its split-K over the context, GROUP_PAD rows a
    program) instead of a prefill tile each (prefill_rows rows, one token's
    group heads valid). `sdpa_min_tokens`: whole prompts this long or longer go to torch's
    fused attention (None: SDPA_PREFILL_MIN_TOKENS; 0: none); `sdpa_flash_first` tries its
    flash kernel before cuDNN's, `sdpa_expand_kv` gives it K/V copied out to every query head
    (knobs to compare on a GPU: bench/kernels/attention_gpu.py's sdpa section).
    """

    def __init__(self, decode_splits: int | None = None, *, block_n: int = 64, prefill_rows: int = 64,
                 num_warps: int = 4, prefill_stages: int | None = None, mixed_decode: bool = False,
                 sdpa_min_tokens: int | None = None, sdpa_flash_first: bool = False, sdpa_expand_kv: bool = False):
        if decode_splits is not None and (decode_splits <= 0 or decode_splits & (decode_splits - 1)):
            raise ValueError(f"decode_splits must be a power of two, got {decode_splits}")
        self.decode_splits, self.block_n, self.prefill_rows = decode_splits, block_n, prefill_rows
        self.num_warps, self.mixed_decode = num_warps, mixed_decode
        self.prefill_launch = {} if prefill_stages is None else {"num_stages": prefill_stages}
        self.sdpa_min_tokens = SDPA_PREFILL_MIN_TOKENS if sdpa_min_tokens is None else sdpa_min_tokens
        self.sdpa_backends = _SDPA_FLASH_FIRST if sdpa_flash_first else _SDPA_BACKENDS
        self.sdpa_expand_kv = bool(sdpa_expand_kv)
        self._num_sms: dict[torch.device, int] = {}
        # (batch, block_q, whole, tiles, decode sequences, whole prompts): the last prefill batch's
        # work lists (_prefill_tiles).
        self._tiles: tuple | None = None

    def warm_whole_prompts(self, kv: KVPool, num_heads: int, dtype: torch.dtype, max_tokens: int) -> list[int]:
        """Runs torch's fused attention once at every length a whole prompt of up to max_tokens
        tokens attends at (sdpa_length) with kv's heads on its device, so that none is prepared
        while serving (cuDNN builds a graph per length, kept per thread: call it on the thread
        that runs the steps). The lengths; none over a float8 cache (its prompts stay here)."""
        k_cache, _ = kv.layer(0)
        if not self.sdpa_min_tokens or max_tokens < self.sdpa_min_tokens or k_cache.element_size() == 1:
            return []
        lengths = sdpa_lengths(self.sdpa_min_tokens, max_tokens)
        num_kv_heads, head_dim = k_cache.shape[2:]
        q_THK = torch.zeros((lengths[-1], num_heads, head_dim), dtype=dtype, device=k_cache.device)
        k_TGK = torch.zeros((lengths[-1], num_kv_heads, head_dim), dtype=dtype, device=k_cache.device)
        v_TGK, o_THK = torch.zeros_like(k_TGK), torch.empty_like(q_THK)
        with torch.inference_mode(), sdpa_kernel(self.sdpa_backends, set_priority=True):
            for length in lengths:
                _attend_whole_prompt(q_THK, k_TGK, v_TGK, o_THK, 0, length, head_dim ** -0.5, self.sdpa_expand_kv)
        return lengths

    def forward(self, layer, q_THK, k_TGK, v_TGK, batch, kv, scale, out=None):
        k_cache, v_cache = kv.layer(layer)
        num_tokens, num_heads, head_dim = q_THK.shape
        num_kv_heads = k_cache.shape[2]
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and num_heads % num_kv_heads == 0
        k_TGK, v_TGK, q_THK = k_TGK.contiguous(), v_TGK.contiguous(), q_THK.contiguous()
        stride_slot = num_kv_heads * head_dim
        k_pad = max(16, triton.next_power_of_2(head_dim))
        o_THK = output_like(q_THK, out)
        if num_tokens == 0:
            return o_THK
        # A decode kernel writes its tokens' K/V itself, unless rows of one sequence read each other's.
        if not batch.is_decode or batch.is_expanded:
            _store_kv_kernel[(num_tokens,)](
                k_TGK, v_TGK, k_cache, v_cache, batch.slot_mapping_T, k_TGK.stride(0), k_TGK.stride(1),
                stride_slot, num_kv_heads, head_dim, G_PAD=triton.next_power_of_2(num_kv_heads), K_PAD=k_pad)
        group = num_heads // num_kv_heads
        common = dict(
            q_ptr=q_THK, k_cache_ptr=k_cache, v_cache_ptr=v_cache, o_ptr=o_THK,
            block_tables_ptr=batch.block_tables_BM, context_lens_ptr=batch.context_lens_B,
            scale_log2=scale * _LOG2E, stride_qt=q_THK.stride(0), stride_qh=q_THK.stride(1),
            stride_ot=o_THK.stride(0), stride_oh=o_THK.stride(1), stride_bt=batch.block_tables_BM.stride(0),
            stride_slot=stride_slot, group=group, head_dim=head_dim, BLOCK_SIZE=kv.block_size, K_PAD=k_pad,
            BLOCK_N=self.block_n, DOT_PRECISION="ieee" if q_THK.dtype == torch.float32 else "tf32",
            F16_DOTS=FP8_DOTS_IN_FP16 and k_cache.element_size() == 1,
            num_warps=self.num_warps)
        max_context = batch.block_tables_BM.shape[1] * kv.block_size
        if batch.is_decode:
            self._decode(common, k_TGK, v_TGK, batch.slot_mapping_T, num_tokens, num_heads, num_kv_heads,
                         max_context, q_THK.device, stores_kv=not batch.is_expanded)
        else:
            group_pad = triton.next_power_of_2(group)
            block_q = max(1, self.prefill_rows // group_pad)
            whole_ok = k_cache.element_size() > 1  # a float8 cache: attend to the K/V as stored
            tiles_2W, decode_seqs_D, whole = self._prefill_tiles(batch, block_q, q_THK.device, whole_ok)
            if whole:
                with sdpa_kernel(self.sdpa_backends, set_priority=True):  # entered once for the step's prompts
                    for start, length in whole:
                        _attend_whole_prompt(q_THK, k_TGK, v_TGK, o_THK, start, length, scale, self.sdpa_expand_kv)
            if tiles_2W.shape[1]:
                _prefill_kernel[(tiles_2W.shape[1], num_kv_heads)](
                    cu_q_lens_ptr=batch.cu_q_lens_B1, tiles_ptr=tiles_2W, num_tiles=tiles_2W.shape[1],
                    GROUP_PAD=group_pad, BLOCK_Q=block_q, **common, **self.prefill_launch)
            if decode_seqs_D is not None:
                self._decode(common, k_TGK, v_TGK, batch.slot_mapping_T, decode_seqs_D.shape[0], num_heads,
                             num_kv_heads, max_context, q_THK.device, (decode_seqs_D, batch.cu_q_lens_B1))
        return o_THK

    def _prefill_tiles(self, batch, block_q: int, device: torch.device,
                       whole_ok: bool = False) -> tuple[Tensor, Tensor | None, list[tuple[int, int]]]:
        """The work lists of a batch with prefill chunks, on the device; built once per batch
        (every layer of a step reuses them), without a sync: [2, W] int32, the sequence and
        tile of each of the W query tiles the prefill kernel runs; with mixed_decode the
        int32 ids of the single-token sequences the decode kernel runs instead (None if none);
        and (if whole_ok) the (first row, length) of each whole prompt torch's fused attention
        takes (at least sdpa_min_tokens new tokens, nothing cached)."""
        key = (batch, block_q, whole_ok)
        if self._tiles is not None and self._tiles[0] is batch and self._tiles[1:3] == key[1:]:
            return self._tiles[3:]
        seqs, tiles, decodes, whole = [], [], [], []
        for b, (start, q_len, context_len) in enumerate(zip(batch.cu_q_lens, batch.q_lens, batch.context_lens)):
            if whole_ok and self.sdpa_min_tokens and q_len >= self.sdpa_min_tokens and context_len == q_len:
                whole.append((start, q_len))
                continue
            if self.mixed_decode and q_len == 1:
                decodes.append(b)
                continue
            n = -(-q_len // block_q)
            seqs += [b] * n
            tiles += range(n)
        on_device = to_device(torch.tensor(seqs + tiles + decodes, dtype=torch.int32), device)  # one copy
        tiles_2W = on_device[:2 * len(tiles)].view(2, len(tiles))
        decode_seqs_D = on_device[2 * len(tiles):] if decodes else None
        self._tiles = (*key, tiles_2W, decode_seqs_D, whole)
        return tiles_2W, decode_seqs_D, whole

    def _decode(self, common: dict, k_TGK: Tensor, v_TGK: Tensor, slot_mapping_T: Tensor, num_seqs: int,
                num_heads: int, num_kv_heads: int, max_context: int, device: torch.device,
                mixed: tuple[Tensor, Tensor] | None = None, *, stores_kv: bool = True) -> None:
        """A decode batch: row i is sequence i, the grid and splits come from shapes only
        (capturable), each program writing its token's K/V (stores_kv; off: an expanded batch,
        its K/V already stored). `mixed` (seq_map_D, cu_q_lens_B1): decode row i is sequence
        seq_map_D[i] of a mixed batch, its K/V already stored."""
        splits = self.decode_splits or decode_num_splits(num_seqs, num_kv_heads, max_context, self._sms(device))
        if FP8_DECODE_MAXNREG and common["k_cache_ptr"].element_size() == 1:
            common = {**common, "maxnreg": FP8_DECODE_MAXNREG}
        common = {**common, **DECODE_LAUNCH}
        k_pad = common["K_PAD"]
        # Per split: the unnormalised output, the running max and the sum of exponentials.
        part_acc = part_ml = common["o_ptr"]  # unused with one split
        if splits > 1:
            part_acc = torch.empty((num_seqs, num_heads, splits, k_pad), dtype=torch.float32, device=device)
            part_ml = torch.empty((num_seqs, num_heads, splits, 2), dtype=torch.float32, device=device)
        group_pad = max(16, triton.next_power_of_2(common["group"]))
        # Single-token steps, as the layer loop's kernels around these (a mixed step is not one).
        pdl = mixed is None and launch.uses_pdl(k_TGK)
        seq_map, cu_q_lens = mixed or (slot_mapping_T, slot_mapping_T)  # unread without MIXED
        grid = (num_kv_heads, num_seqs, splits) if DECODE_HEADS_FIRST else (num_seqs, num_kv_heads, splits)
        _decode_kernel[grid](
            k_new_ptr=k_TGK, v_new_ptr=v_TGK, slot_ptr=slot_mapping_T, seq_map_ptr=seq_map, cu_q_lens_ptr=cu_q_lens,
            stride_nt=k_TGK.stride(0), stride_ng=k_TGK.stride(1), part_acc_ptr=part_acc, part_ml_ptr=part_ml,
            num_heads=num_heads, NUM_SPLITS=splits, GROUP_PAD=group_pad, PDL=pdl, launch_pdl=pdl,
            MIXED=mixed is not None, HEADS_FIRST=DECODE_HEADS_FIRST, STORE_KV=stores_kv and mixed is None, **common)
        if splits > 1:
            _decode_reduce_kernel[(num_seqs, num_heads)](
                part_acc, part_ml, common["o_ptr"], common["context_lens_ptr"], seq_map, cu_q_lens,
                common["stride_ot"], common["stride_oh"], num_heads, common["head_dim"], NUM_SPLITS=splits,
                K_PAD=k_pad, BLOCK_N=common["BLOCK_N"], PDL=pdl, launch_pdl=pdl, MIXED=mixed is not None)

    def _sms(self, device: torch.device) -> int:
        if device.type != "cuda":
            return _CPU_NUM_SMS
        if device not in self._num_sms:
            self._num_sms[device] = torch.cuda.get_device_properties(device).multi_processor_count
        return self._num_sms[device]


ATTENTION_BACKENDS["triton"] = TritonPagedAttention

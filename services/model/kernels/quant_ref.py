"""Pure-torch references of the quantized kernels' weight layouts (issue 29): dequantize, quantize, pack.

What the kernels of quant_fp8*.py and quant_awq*.py compute, written plainly
so tests and benchmarks can check them (and make test weights in the exact
stored layouts); no triton here. The loader's own CPU path lives in
services/model/quant/ and does not depend on this module.

- Block FP8 (the published "fp8" checkpoints): weight w_NK float8_e4m3fn and
  weight_scale_inv s [ceil(N/128), ceil(K/128)] fp32, W[n, k] = w[n, k] * s[n // 128, k // 128];
  y = x @ W^T. Activations are quantized per token and 128-channel group the same way.
- AWQ 4-bit, version "gemm": qweight [K, ceil(N/8)] int32 with eight 4-bit values per
  int32 in AWQ's interleaved order (nibble i, bits 4i..4i+3, holds column 8j + AWQ_ORDER[i]),
  qzeros [ceil(K/G), ceil(N/8)] packed the same way, scales [ceil(K/G), N] fp16;
  W[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]; y = x @ W.

Every function takes leading dimensions (the experts' [E, ...]) as they come.
"""

import torch
from torch import Tensor

FP8_BLOCK = 128  # the FP8 checkpoints' weight_block_size, and the activation group
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
AWQ_GROUP = 128
AWQ_PACK = 8  # 4-bit values per int32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column (within its 8) held by nibble i
# The bit offset of column c within its int32: 4 * [0, 4, 1, 5, 2, 6, 3, 7][c].
AWQ_SHIFTS = tuple(4 * AWQ_ORDER.index(c) for c in range(AWQ_PACK))


def _expand_blocks(s: Tensor, rows: int, cols: int, block_rows: int, block_cols: int) -> Tensor:
    """s [..., R, C] repeated to [..., rows, cols]: element (i, j) is s[..., i // block_rows, j // block_cols]."""
    return s.repeat_interleave(block_rows, -2)[..., :rows, :].repeat_interleave(block_cols, -1)[..., :cols]


def dequant_fp8(w: Tensor, s: Tensor, block: int = FP8_BLOCK) -> Tensor:
    """fp32 W [..., N, K] of block FP8 w [..., N, K] and its scales s [..., ceil(N/block), ceil(K/block)]."""
    return w.float() * _expand_blocks(s.float(), w.shape[-2], w.shape[-1], block, block)


def quant_fp8(w: Tensor, block: int = FP8_BLOCK) -> tuple[Tensor, Tensor]:
    """(w8, s): w [..., N, K] in block FP8 (each block's largest |w| at 448), as the FP8 checkpoints store it."""
    n, k = w.shape[-2:]
    pad = w.new_zeros(*w.shape[:-2], -(-n // block) * block, -(-k // block) * block, dtype=torch.float32)
    pad[..., :n, :k] = w.float()
    blocks = pad.unflatten(-1, (-1, block)).unflatten(-3, (-1, block))  # [..., NB, block, KB, block]
    amax = blocks.abs().amax(dim=(-3, -1))
    s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    w8 = (w.float() / _expand_blocks(s, n, k, block, block)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return w8, s


def quant_act_fp8(x: Tensor, group: int = FP8_BLOCK) -> tuple[Tensor, Tensor]:
    """(xq, xs): x [M, K] per token and 128-channel group in FP8, x ~ xq * xs[:, k // group], as the
    tensor-core kernels quantize activations (a group's largest |x| at 448; an all-zero group: scale 1)."""
    m, k = x.shape
    pad = x.new_zeros(m, -(-k // group) * group, dtype=torch.float32)
    pad[:, :k] = x.float()
    amax = pad.unflatten(1, (-1, group)).abs().amax(-1)
    xs = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    xq = (x.float() / xs.repeat_interleave(group, 1)[:, :k]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return xq, xs


def awq_pack(q: Tensor) -> Tensor:
    """int32 [..., ceil(N/8)]: 4-bit values q [..., N] (0..15) packed eight to an int32 in AWQ's order."""
    n = q.shape[-1]
    padded = torch.nn.functional.pad(q.to(torch.int64), (0, -n % AWQ_PACK)).unflatten(-1, (-1, AWQ_PACK))
    shifts = torch.tensor(AWQ_SHIFTS, dtype=torch.int64, device=q.device)
    packed = (padded << shifts).sum(-1)  # disjoint bits: the sum is their OR
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def awq_unpack(packed: Tensor, n: int) -> Tensor:
    """int32 [..., n]: the 4-bit values of packed [..., ceil(n/8)] (awq_pack's inverse)."""
    shifts = torch.tensor(AWQ_SHIFTS, dtype=torch.int32, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).flatten(-2)[..., :n]


def dequant_awq(qweight: Tensor, qzeros: Tensor, scales: Tensor, group: int = AWQ_GROUP) -> Tensor:
    """fp32 W [..., K, N] of AWQ's qweight [..., K, N/8], qzeros [..., K/G, N/8], scales [..., K/G, N]."""
    k, n = qweight.shape[-2], scales.shape[-1]
    z = _expand_blocks(awq_unpack(qzeros, n).float(), k, n, group, 1)
    return (awq_unpack(qweight, n).float() - z) * _expand_blocks(scales.float(), k, n, group, 1)


def quant_awq(w: Tensor, group: int = AWQ_GROUP) -> tuple[Tensor, Tensor, Tensor]:
    """(qweight, qzeros, scales): w [..., K, N] in AWQ 4-bit with zero points, per group of `group` rows
    (each group's range of a column over 15 steps, fp16 scales), in the stored layouts."""
    k, n = w.shape[-2:]
    groups = torch.nn.functional.pad(w.float(), (0, 0, 0, -k % group)).unflatten(-2, (-1, group))  # [..., KG, G, N]
    lo, hi = groups.amin(-2).clamp(max=0), groups.amax(-2).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-6).to(torch.float16)
    zeros = (-lo / scales.float()).round().clamp(0, 15)
    q = (groups / scales.float().unsqueeze(-2) + zeros.unsqueeze(-2)).round().clamp(0, 15).flatten(-3, -2)[..., :k, :]
    return awq_pack(q.to(torch.int32)), awq_pack(zeros.to(torch.int32)), scales

"""The stored layouts of quantized linears, as the published checkpoints hold them, and their arithmetic.

Block FP8 (`quant_method: "fp8"`, Qwen/Qwen3-*-FP8, DeepSeek-V3's layout): a
linear's `weight` is float8_e4m3fn [N, K] and `weight_scale_inv` float32
[ceil(N/128), ceil(K/128)], one scale per 128x128 block (blocks at the right
and bottom edges are partial); the weight is fp8 * scale_inv of its block.

AWQ 4-bit, GEMM version (`quant_method: "awq"`, AutoAWQ's WQLinear_GEMM): the
weight is stored transposed, in-features first. `qweight` int32 [K, N/8]
packs eight 4-bit values of one row per int32, columns in AWQ's interleaved
order (value of column 8c + AWQ_PACK_ORDER[i] in bits 4i..4i+3); `qzeros`
int32 [K/G, N/8] packs the zero points the same way; `scales` float16
[K/G, N]. The weight W[n, k] is (q[k, n] - z[k // G, n]) * s[k // G, n].

Legend: N out-features, K in-features, G AWQ group size.
"""

import dataclasses
import json
import pathlib

import torch
from torch import Tensor

FP8_BLOCK = 128
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
AWQ_BITS = 4
AWQ_PACK = 32 // AWQ_BITS  # 4-bit values per int32
# Column 8c + AWQ_PACK_ORDER[i] sits in bits 4i..4i+3 (AutoAWQ's order_map); unpacking
# the nibbles in bit order gives columns 8c + AWQ_PACK_ORDER[...], so AWQ_REVERSE_ORDER
# (its inverse) puts them back.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
FORMATS = ("fp8", "awq")


@dataclasses.dataclass(frozen=True, slots=True)
class QuantConfig:
    """A checkpoint's `quantization_config`, checked: only what serving supports."""

    method: str  # one of FORMATS
    group_size: int = 128  # AWQ only
    # Module names (or dotted name parts) left unquantized, e.g. "lm_head" or "mlp.gate".
    modules_to_not_convert: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, raw: dict) -> "QuantConfig":
        """From config.json's quantization_config; ValueError quoting what is unsupported."""
        if not isinstance(raw, dict):
            raise ValueError(f"quantization_config must be a JSON object, got {raw!r}")
        method = raw.get("quant_method")
        skip = raw.get("modules_to_not_convert") or ()
        if not isinstance(skip, (list, tuple)) or not all(isinstance(entry, str) for entry in skip):
            raise ValueError(f"quantization_config modules_to_not_convert must be a list of module names, "
                             f"got {skip!r}")
        skip = tuple(skip)
        if method == "fp8":
            expected = {"fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
            for key, value in expected.items():
                if raw.get(key, value) != value:
                    raise ValueError(f"quantization_config {key} {raw[key]!r} is not supported (only {value!r})")
            return cls("fp8", modules_to_not_convert=skip)
        if method == "awq":
            expected = {"bits": AWQ_BITS, "zero_point": True, "version": "gemm"}
            for key, value in expected.items():
                found = raw.get(key, value)
                if (found.lower() if isinstance(found, str) else found) != value:
                    raise ValueError(f"quantization_config {key} {found!r} is not supported (only {value!r})")
            group_size = raw.get("group_size", 128)
            if (not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0
                    or group_size % AWQ_PACK):
                raise ValueError(f"quantization_config group_size {group_size!r} must be a positive multiple of 8")
            return cls("awq", group_size=group_size, modules_to_not_convert=skip)
        raise ValueError(f"quantization_config quant_method {method!r} is not one of {list(FORMATS)}")

    def to_hub_dict(self) -> dict:
        """config.json's quantization_config, as the published checkpoints write it."""
        if self.method == "fp8":
            hub = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
        else:
            hub = {"quant_method": "awq", "bits": AWQ_BITS, "group_size": self.group_size,
                   "zero_point": True, "version": "gemm"}
        if self.modules_to_not_convert:
            hub["modules_to_not_convert"] = list(self.modules_to_not_convert)
        return hub

    def converts(self, module: str) -> bool:
        """Whether `module` (e.g. model.layers.0.mlp.gate) may be quantized: it matches no
        entry of modules_to_not_convert as whole dotted parts ("gate" skips mlp.gate, not
        gate_proj)."""
        padded = f".{module}."
        return not any(f".{entry.strip('.')}." in padded for entry in self.modules_to_not_convert)


def read_quant_config(model_dir: str | pathlib.Path) -> QuantConfig | None:
    """The quantization_config of a checkpoint directory's config.json, or None (not quantized)."""
    path = pathlib.Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    raw = json.loads(path.read_text()).get("quantization_config")
    return None if raw is None else QuantConfig.from_dict(raw)


def stored_bytes(quant: QuantConfig, n: int, k: int) -> int:
    """The bytes a [n, k] linear takes in `quant`'s stored layout, scales included."""
    if quant.method == "fp8":
        bn, bk = fp8_scale_shape(n, k)
        return n * k + 4 * bn * bk
    groups = k // quant.group_size
    return n * k // 2 + groups * n // 2 + 2 * groups * n  # qweight, qzeros, fp16 scales


# ---- block FP8 --------------------------------------------------------------------------------


def fp8_scale_shape(n: int, k: int) -> tuple[int, int]:
    """weight_scale_inv's shape for a [n, k] weight: partial blocks at the edges count."""
    return -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)


def _expand_blocks(scale_nk: Tensor, n: int, k: int) -> Tensor:
    """Each block's scale repeated over its elements, cut to [..., n, k]."""
    return scale_nk.repeat_interleave(FP8_BLOCK, -2).repeat_interleave(FP8_BLOCK, -1)[..., :n, :k]


def fp8_quantize(w_NK: Tensor) -> tuple[Tensor, Tensor]:
    """(weight float8_e4m3fn [N, K], weight_scale_inv float32 [ceil(N/128), ceil(K/128)]):
    each block scaled so that its largest magnitude maps to the largest fp8 value."""
    n, k = w_NK.shape[-2:]
    bn, bk = fp8_scale_shape(n, k)
    padded = w_NK.new_zeros(*w_NK.shape[:-2], bn * FP8_BLOCK, bk * FP8_BLOCK, dtype=torch.float32)
    padded[..., :n, :k] = w_NK.float()
    blocks = padded.unflatten(-2, (bn, FP8_BLOCK)).unflatten(-1, (bk, FP8_BLOCK))
    # An all-zero block gets the smallest normal scale, not 0: a zero scale is refused on load.
    scale = (blocks.abs().amax(dim=(-3, -1)) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (w_NK.float() / _expand_blocks(scale, n, k)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def fp8_dequantize(weight: Tensor, scale_inv: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The [..., N, K] weight of an FP8 layout, computed in fp32, in `dtype`."""
    n, k = weight.shape[-2:]
    return (weight.float() * _expand_blocks(scale_inv.float(), n, k)).to(dtype)


# ---- AWQ 4-bit --------------------------------------------------------------------------------


def awq_pack(int_KN: Tensor) -> Tensor:
    """Values 0..15 [..., K, N] -> int32 [..., K, N/8] in AWQ's interleaved column order."""
    *lead, k, n = int_KN.shape
    if n % AWQ_PACK:
        raise ValueError(f"AWQ packs 8 columns per int32: width {n} is not a multiple of 8")
    cols = int_KN.to(torch.int64).reshape(*lead, k, n // AWQ_PACK, AWQ_PACK)[..., list(AWQ_PACK_ORDER)]
    shifts = torch.arange(0, 32, AWQ_BITS, device=int_KN.device)
    packed = (cols << shifts).sum(-1)  # disjoint bits: the sum is the bitwise or
    # int32 two's complement: the top nibble's high bit is the sign bit.
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def awq_unpack(packed: Tensor) -> Tensor:
    """int32 [..., K, N/8] in AWQ's order -> values 0..15 [..., K, N] (uint8), columns in order."""
    shifts = torch.arange(0, 32, AWQ_BITS, device=packed.device)
    nibbles = (packed.to(torch.int64)[..., None] >> shifts) & 0xF
    return nibbles[..., list(AWQ_REVERSE_ORDER)].flatten(-2).to(torch.uint8)


def awq_quantize(w_NK: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """(qweight int32 [K, N/8], qzeros int32 [K/G, N/8], scales float16 [K/G, N]) of a
    [N, K] weight, as AutoAWQ's zero-point quantization computes them (asymmetric,
    per group of G in-features and out-feature)."""
    n, k = w_NK.shape
    if k % group_size:
        raise ValueError(f"AWQ group size {group_size} does not divide the in-features {k}")
    w_GgN = w_NK.float().T.reshape(k // group_size, group_size, n)
    low, high = w_GgN.amin(dim=1), w_GgN.amax(dim=1)
    scales = ((high - low).clamp(min=1e-5) / 15).half()
    s = scales.float()
    zeros = (-torch.round(low / s)).clamp(0, 15)
    q = (torch.round(w_GgN / s[:, None]) + zeros[:, None]).clamp(0, 15).reshape(k, n)
    return awq_pack(q), awq_pack(zeros), scales


def awq_dequantize(qweight: Tensor, qzeros: Tensor, scales: Tensor, group_size: int,
                   dtype: torch.dtype = torch.float32) -> Tensor:
    """The [..., N, K] weight (out-features first, like F.linear's) of an AWQ layout, in `dtype`.
    Exact in fp32: a 4-bit difference times a float16 scale."""
    q = awq_unpack(qweight).float()
    z = awq_unpack(qzeros).float().repeat_interleave(group_size, -2)
    s = scales.float().repeat_interleave(group_size, -2)
    return ((q - z) * s).transpose(-2, -1).to(dtype)

"""Random quantized projections drawn directly in the stored layouts, on the device: for benchmarks only.

The GPU benchmarks serve `--random-weights qwen3-235b-a22b-awq` and the like:
no checkpoint, weights drawn on the device as the model reads them
(random_weights.py). Drawing a dense tensor and quantizing it would cost a
dense fp32 temporary and a dozen kernels per projection (36,096 expert
projections for the 235B shape); these draw the stored tensors themselves,
one random-byte kernel and a few integer ops each:

- block FP8: every weight byte a finite float8_e4m3fn with a random sign and
  mantissa and an exponent field in FP8_EXPONENT_FIELDS (magnitudes 16 to
  240, never NaN: e4m3fn's NaN needs exponent field 15), so the values have
  about the spread of a real checkpoint's (a block's largest magnitude maps
  near the fp8 maximum); each 128x128 block's weight_scale_inv is
  std / FP8_VALUE_RMS times a factor in [1 - SCALE_SPREAD, 1 + SCALE_SPREAD];
- AWQ 4-bit: qweight random bits (every nibble 0..15), qzeros nibbles 7 or
  8 (the weights centred on zero, as a zero-point quantization of a
  symmetric distribution gives), fp16 scales std / AWQ_VALUE_RMS times a
  factor in the same range.

So the dequantized weights have mean about 0 and standard deviation about
`std`, like the dense presets' N(0, std) draws, every scale is finite and
positive and no weight is all zeros: the loader's checks (quant/loading.py)
accept them. The values are a function of the generator's seed only.
Legend: N out-features, K in-features, G AWQ group size.
"""

import torch

from services.model.quant.formats import AWQ_PACK, QuantConfig, fp8_scale_shape
from services.model.quant.linear import QuantWeight

# e4m3 (bias 7) exponent fields drawn, uniformly: 2^4 .. 2^7 times 1 + m/8.
FP8_EXPONENT_FIELDS = (11, 12, 13, 14)
_MANTISSA_MEAN_SQUARE = sum((1 + m / 8) ** 2 for m in range(8)) / 8
# The root mean square of the drawn fp8 values (about 108).
FP8_VALUE_RMS = (sum(4.0 ** (e - 7) for e in FP8_EXPONENT_FIELDS) / len(FP8_EXPONENT_FIELDS)
                 * _MANTISSA_MEAN_SQUARE) ** 0.5
# q - z with q uniform in 0..15 and z 7 or 8: variance 21.25 plus the mean's square 0.25.
AWQ_VALUE_RMS = 21.5 ** 0.5
# Scales vary by this share around their nominal value, as real ones vary from block to block.
SCALE_SPREAD = 0.25


def random_bytes(shape: tuple[int, ...], generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """uint8 [*shape], every value 0..255 equally likely."""
    return torch.empty(shape, dtype=torch.uint8, device=device).random_(0, 256, generator=generator)


def _scales(shape: tuple[int, ...], nominal: float, dtype: torch.dtype, generator: torch.Generator,
            device: torch.device) -> torch.Tensor:
    factor = torch.empty(shape, dtype=torch.float32, device=device).uniform_(
        1 - SCALE_SPREAD, 1 + SCALE_SPREAD, generator=generator)
    return (factor * nominal).to(dtype)


def random_fp8(n: int, k: int, std: float, generator: torch.Generator, device: torch.device) -> QuantWeight:
    """A [n, k] block-FP8 linear: weight float8_e4m3fn [n, k], weight_scale_inv fp32 per 128x128 block."""
    r = random_bytes((n, k), generator, device)
    low = FP8_EXPONENT_FIELDS[0]
    assert len(FP8_EXPONENT_FIELDS) == 4 and FP8_EXPONENT_FIELDS[-1] == low + 3  # two random bits pick it
    # S EEEE MMM: keep r's sign and mantissa bits, its bits 3-4 pick the exponent field.
    exponent = ((r >> 3) & 3) + low
    weight = ((r & 0x87) | (exponent << 3)).view(torch.float8_e4m3fn)
    scale = _scales(fp8_scale_shape(n, k), std / FP8_VALUE_RMS, torch.float32, generator, device)
    return QuantWeight("fp8", {"weight": weight, "weight_scale_inv": scale}, n, k)


def random_awq(n: int, k: int, group_size: int, std: float, generator: torch.Generator,
               device: torch.device) -> QuantWeight:
    """A [n, k] AWQ 4-bit linear: qweight int32 [k, n/8], qzeros int32 [k/G, n/8], scales fp16 [k/G, n]."""
    if k % group_size or n % AWQ_PACK:
        raise ValueError(f"AWQ needs k % group_size == 0 and n % {AWQ_PACK} == 0, got [{n}, {k}], G {group_size}")
    groups = k // group_size
    qweight = random_bytes((k, n // 2), generator, device).view(torch.int32)
    # Each nibble 7 + one random bit: 0x77 plus bit 0 (low nibble) and bit 1 moved to bit 4 (high nibble).
    r = random_bytes((groups, n // 2), generator, device)
    qzeros = (0x77 + (r & 1) + ((r & 2) << 3)).view(torch.int32)
    scales = _scales((groups, n), std / AWQ_VALUE_RMS, torch.float16, generator, device)
    return QuantWeight("awq", {"qweight": qweight, "qzeros": qzeros, "scales": scales}, n, k, group_size=group_size)


def random_quant(quant: QuantConfig, shape: tuple[int, int], std: float, generator: torch.Generator,
                 device: torch.device) -> QuantWeight:
    """A random [N, K] linear in `quant`'s stored layout (see the module doc)."""
    n, k = shape
    if quant.method == "fp8":
        return random_fp8(n, k, std, generator, device)
    return random_awq(n, k, quant.group_size, std, generator, device)


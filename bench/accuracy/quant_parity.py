"""The quantized side of bench/accuracy/hf_parity.py: weights, their dequantized twin, the FP8 path's bound.

With `--quant fp8|awq` the serving model runs random weights quantized into
the checkpoint layout (each projection drawn as the dense preset draws it,
then quantized: a real checkpoint's value distribution), and every reference
(transformers fp32, the oracle; transformers bf16, the bound) runs on the
DEQUANTIZED weights, which is what the quantized model computes with: any
logit error left is the serving path's, not the quantization's.

Verdicts: the weight-only paths (AWQ, FP8 with `--quantized-kernel
weight-only`, the CPU's reference path) compute in bf16 on weights that are
exact, so they are held to the bf16 bounds (hf_parity.MAX_ERROR_RATIO,
MAX_WORST_ROW_RATIO). The FP8 tensor-core path also rounds every projection's
input to e4m3 (per token and 128-channel group): FP8_MAX_ERROR_RATIO and
FP8_MAX_AGREE_DROP are its bounds (docs/configuration.md, "Quantized
checkpoints", says why these values). The argmax bound is taken against
transformers fp32 with the same input rounding (`fp8_inputs`): what the
rounding alone costs the argmax, on these weights, is the baseline, so the
path may lose at most FP8_MAX_AGREE_DROP more than that, give or take
FP8_AGREE_NOISE_Z standard errors of the measured drop (few positions measure
it coarsely). The weight-only
paths of an FP8 checkpoint (the CPU's included) report that reference beside
their own rows, unjudged: what the tensor-core path would lose to the rounding.
"""

import contextlib

import torch
from torch.nn import functional

from services.model.kernels.quant_ref import FP8_BLOCK, quant_act_fp8
from services.model.make_model import awq_group_size
from services.model.quant.formats import QuantConfig
from services.model.quant.linear import Dequantized
from services.model.random_weights import RandomWeights

# e4m3 keeps 3 mantissa bits against bf16's 8 (with the implicit bit): a rounding step 2^-4
# of the leading bit against 2^-8, 16 times larger, on each projection's input.
FP8_MAX_ERROR_RATIO = 16.0
# Its worst position, as the bf16 bound's 3x over the mean ratio.
FP8_MAX_WORST_ROW_RATIO = 3 * FP8_MAX_ERROR_RATIO
# The most argmax agreement (share of positions, 0..1) the FP8 path may lose against the rounding's.
FP8_MAX_AGREE_DROP = 0.05
# How many standard errors of the measured drop are allowed past FP8_MAX_AGREE_DROP: the drop is
# (positions only the reference gets right - positions only the path gets right) / n, whose standard
# error with d such discordant positions is sqrt(d) / n (McNemar's); a row of 128 positions
# measures it to about 3 points.
FP8_AGREE_NOISE_Z = 2.0


def quant_config(method: str | None, config) -> QuantConfig | None:
    """The QuantConfig of --quant: AWQ's group size 128, or a tiny model's largest that divides."""
    if not method:
        return None
    return QuantConfig(method, group_size=awq_group_size(config)) if method == "awq" else QuantConfig(method)


def serving_weights(config, args, device) -> RandomWeights:
    """The weights the serving model runs: bf16, projections quantized if --quant."""
    return RandomWeights(config, range(config.num_experts), args.seed, dtype=torch.bfloat16, device=device,
                         quant=quant_config(getattr(args, "quant", None), config))


def reference_weights(config, args, device):
    """What transformers runs: the same draw, projections dequantized (fp32) if --quant."""
    weights = serving_weights(config, args, device)
    return Dequantized(weights) if getattr(args, "quant", None) else weights


def round_fp8_input(x: torch.Tensor) -> torch.Tensor:
    """x with its last dimension rounded to e4m3 per row and 128-channel group, as the FP8 tensor-core
    kernels round a projection's input (quant_ref.quant_act_fp8), in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    xq, xs = quant_act_fp8(rows)
    scale = xs.repeat_interleave(FP8_BLOCK, 1)[:, :rows.shape[1]]
    return (xq.float() * scale).to(x.dtype).reshape(x.shape)


def quantized_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """A transformers Qwen3-MoE model's projections an FP8 checkpoint quantizes: the attention's q, k,
    v and o, the experts' (and any dense MLP's) projections; not the gates, embeddings or LM head."""
    return [p for name, p in model.named_parameters() if "_proj" in name and p.dim() >= 2]


@contextlib.contextmanager
def fp8_inputs(model: torch.nn.Module):
    """Within: every F.linear on one of `model`'s quantized projections (a slice of the experts' stacked
    weights included) sees its input rounded by round_fp8_input, the rest runs as it is."""
    storages = {p.untyped_storage().data_ptr() for p in quantized_parameters(model)}
    exact = functional.linear

    def linear(x, weight, bias=None):
        if weight.untyped_storage().data_ptr() in storages:
            x = round_fp8_input(x)
        return exact(x, weight, bias)

    functional.linear = linear
    try:
        yield
    finally:
        functional.linear = exact


def compute_path(model) -> tuple[str, str]:
    """(path, why) the serving model's quantized weights take ("bf16", "" when not quantized)."""
    if not model.quant_paths:
        return "bf16", ""
    (method, path), = model.quant_paths.items()
    return path.path, f"{method}: {path.reason}"


def fp8_verdict(candidate: dict, baseline: dict, rounding: dict | None = None,
                discordant: int | None = None) -> dict:
    """The FP8 tensor-core path's verdict: its error within FP8_MAX_ERROR_RATIO (worst row
    FP8_MAX_WORST_ROW_RATIO) of transformers bf16's, its argmax agreement at most
    FP8_MAX_AGREE_DROP below `rounding`'s (transformers fp32 with the FP8 input rounding), or
    below bf16's when that was not run. With `discordant` (the positions where exactly one of the
    two agrees with the oracle) the drop may also exceed the bound by FP8_AGREE_NOISE_Z standard
    errors: a failure then says the path loses more than the bound, not that a few positions flipped."""
    ratio = candidate["mean_abs_err"] / baseline["mean_abs_err"]
    worst_ratio = candidate["worst_row_err"] / baseline["worst_row_err"]
    drop = (rounding or baseline)["argmax_agree"] - candidate["argmax_agree"]
    noise = 0.0 if discordant is None else FP8_AGREE_NOISE_Z * discordant ** 0.5 / candidate["positions"]
    drop_bound = FP8_MAX_AGREE_DROP + noise
    return {"error_ratio": ratio, "worst_row_ratio": worst_ratio, "argmax_drop": drop,
            "argmax_drop_bound": drop_bound,
            "ok": ratio <= FP8_MAX_ERROR_RATIO and worst_ratio <= FP8_MAX_WORST_ROW_RATIO and drop <= drop_bound}

"""Random Qwen3-MoE checkpoints in the hub layout, for tests and demos.

`make_random_checkpoint` writes what a hub download holds: `config.json` (hub
spellings), `generation_config.json`, the weights as one `model.safetensors`
or as shards with `model.safetensors.index.json`, per-expert tensor names, and
the tokenizer files. Transformers loads the result with no missing keys.

With `quant` (`--quantize fp8|awq`) every projection is quantized from the
same random weights into the published checkpoints' layouts
(services/model/quant/formats.py) and config.json gets their
quantization_config; the gate, embeddings, norms and LM head stay in `dtype`.
`write_dequantized_checkpoint` writes the dense twin of a quantized
checkpoint (what serving computes with), which transformers loads.
"""

import argparse
import dataclasses
import json
import logging
import pathlib
import shutil
import sys

import torch
from safetensors.torch import save_file

from services.model.checkpoint import INDEX_FILE, SINGLE_FILE, expected_tensors, load_weights
from services.model.config import DTYPES, ModelConfig
from services.model.quant.formats import FORMATS, QuantConfig
from services.model.quant.linear import Dequantized, QuantWeight, is_projection

logger = logging.getLogger(__name__)

_TINY = ModelConfig(
    vocab_size=151936,  # the real Qwen vocabulary, so the real tokenizer fits
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # heads * head_dim (128) != hidden (64), as in the real models
    intermediate_size=128,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    mlp_only_layers=(1,),
    max_position_embeddings=4096,
    rope_theta=1_000_000.0,
    tie_word_embeddings=False,
    dtype=torch.float32,
    eos_token_ids=(151645, 151643),
    bos_token_id=None,
)

PRESETS: dict[str, ModelConfig] = {
    "tiny": _TINY,
    "tiny-tied": dataclasses.replace(_TINY, tie_word_embeddings=True),
    # A hidden size that is not a multiple of 128: FP8's edge blocks are partial (quantized tests).
    "tiny-h160": dataclasses.replace(_TINY, hidden_size=160, intermediate_size=192),
}
_AWQ_GROUP_SIZES = (128, 64, 32, 16, 8)


def awq_group_size(config: ModelConfig) -> int:
    """AWQ's group size for a model: 128 as published, else the largest power of two that
    divides every projection's in-features (tiny models)."""
    widths = (config.hidden_size, config.num_attention_heads * config.head_dim,
              config.intermediate_size, config.moe_intermediate_size)
    for size in _AWQ_GROUP_SIZES:
        if all(w % size == 0 for w in widths):
            return size
    raise ValueError(f"no AWQ group size of {_AWQ_GROUP_SIZES} divides the in-features {widths}")


def random_weights(config: ModelConfig, seed: int, *, init_std: float = 0.1) -> dict[str, torch.Tensor]:
    """All experts' weights in fp32, hub names; norms in [0.9, 1.1], the rest N(0, init_std)."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in expected_tensors(config, range(config.num_experts)).items():
        if name.endswith("norm.weight"):
            noise = torch.rand(shape, generator=generator) * 2 - 1
            weights[name] = 1 + 0.1 * noise
        else:
            weights[name] = torch.randn(shape, generator=generator) * init_std
    return weights


def make_random_checkpoint(
    out_dir: str | pathlib.Path,
    config: ModelConfig,
    seed: int,
    *,
    dtype: torch.dtype = torch.float32,
    num_shards: int = 1,
    init_std: float = 0.1,
    with_tokenizer: bool = True,
    quant: QuantConfig | None = None,
) -> None:
    """Writes a deterministic (from `seed`) random checkpoint of `config` into `out_dir`.

    The values do not depend on `dtype` beyond rounding, nor on `num_shards`.
    Checkpoint files of an earlier run in `out_dir` are replaced. With `quant`,
    the projections are stored quantized.
    """
    if dtype not in DTYPES.values():
        raise ValueError(f"checkpoint dtype {dtype} is not one of {sorted(DTYPES)}")
    if init_std <= 0:
        raise ValueError(f"init_std must be positive, got {init_std}")
    num_tensors = len(expected_tensors(config, range(config.num_experts)))
    if not 1 <= num_shards <= num_tensors:
        raise ValueError(f"num_shards {num_shards} outside [1, {num_tensors}]")
    weights = {}
    for name, w in random_weights(config, seed, init_std=init_std).items():
        if quant is not None and is_projection(name):
            weights.update(QuantWeight.quantize(w, quant).hub_tensors(name))
        else:
            weights[name] = w.to(dtype)
    root = pathlib.Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    for stale in [*root.glob("model-*-of-*.safetensors"), root / SINGLE_FILE, root / INDEX_FILE]:
        stale.unlink(missing_ok=True)
    _write_weights(root, weights, num_shards)
    hub = dataclasses.replace(config, dtype=dtype).to_hub_dict()
    if quant is not None:
        hub["quantization_config"] = quant.to_hub_dict()
    (root / "config.json").write_text(json.dumps(hub, indent=2) + "\n")
    generation = {"bos_token_id": hub["bos_token_id"], "eos_token_id": hub["eos_token_id"]}
    (root / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if with_tokenizer:
        from services.tokenizer import write_tokenizer_files  # its own module; imported only when used

        write_tokenizer_files(root)
    logger.info("wrote a random checkpoint (seed %d, %s, %d shard(s)%s) to %s", seed, dtype, num_shards,
                "" if quant is None else f", {quant.method}", root)


def write_dequantized_checkpoint(src: str | pathlib.Path, dst: str | pathlib.Path,
                                 dtype: torch.dtype = torch.float32) -> None:
    """Writes the dense twin of quantized checkpoint `src` into `dst`: every weight as serving
    computes with it (dequantized in fp32; a quantized gate in bf16, as loading gives it), in
    `dtype`, config.json without quantization_config, the other files copied."""
    src, dst = pathlib.Path(src), pathlib.Path(dst)
    config = ModelConfig.from_model_dir(src)
    weights = Dequantized(load_weights(src, config, range(config.num_experts)))
    dense = {name: w.to(dtype).contiguous() for name, w in weights.items()}
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in ("config.json", INDEX_FILE):
            shutil.copy(path, dst / path.name)
    hub = json.loads((src / "config.json").read_text())
    hub.pop("quantization_config", None)
    hub["torch_dtype"] = {v: k for k, v in DTYPES.items()}[dtype]
    (dst / "config.json").write_text(json.dumps(hub, indent=2) + "\n")
    _write_weights(dst, dense, 1)


def _write_weights(root: pathlib.Path, weights: dict[str, torch.Tensor], num_shards: int) -> None:
    """One file, or `num_shards` files of about equal bytes plus the index."""
    if num_shards == 1:
        save_file(weights, root / SINGLE_FILE, metadata={"format": "pt"})
        return
    names = list(weights)
    starts = _shard_starts([weights[n].nbytes for n in names], num_shards)
    weight_map = {}
    for i, (begin, end) in enumerate(zip(starts, [*starts[1:], len(names)])):
        file_name = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: weights[n] for n in names[begin:end]}, root / file_name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names[begin:end], file_name))
    index = {
        "metadata": {"total_size": sum(w.nbytes for w in weights.values())},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (root / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _shard_starts(sizes: list[int], num_shards: int) -> list[int]:
    """First tensor index of each shard: cut at equal byte fractions, no shard empty."""
    total, cumulative = sum(sizes), [0]
    for size in sizes:
        cumulative.append(cumulative[-1] + size)
    starts = [0]
    for k in range(1, num_shards):
        cut = next(i for i, before in enumerate(cumulative) if before * num_shards >= k * total)
        starts.append(min(max(cut, starts[-1] + 1), len(sizes) - (num_shards - k)))
    return starts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `moemesh make-model`."""
    parser.add_argument("dir", type=pathlib.Path, help="output checkpoint directory")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model shape")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="dtype of the files")
    parser.add_argument("--num-shards", type=int, default=1, help="number of safetensors files")
    parser.add_argument("--init-std", type=float, default=0.1, help="std of the random matrices")
    parser.add_argument("--no-tokenizer", action="store_true", help="skip writing the tokenizer files")
    parser.add_argument("--quantize", choices=FORMATS, default=None,
                        help="store the projections quantized: block FP8 or AWQ 4-bit, as the published checkpoints")
    parser.add_argument("--group-size", type=int, default=0,
                        help="AWQ group size (0: 128, or the largest power of two dividing a tiny model's widths)")


def run(args: argparse.Namespace) -> int:
    """Runs `moemesh make-model` on parsed arguments; returns the exit status."""
    config, quant = PRESETS[args.preset], None
    if args.quantize == "fp8":
        quant = QuantConfig("fp8")
    elif args.quantize == "awq":
        quant = QuantConfig("awq", group_size=args.group_size or awq_group_size(config))
    make_random_checkpoint(
        args.dir,
        config,
        args.seed,
        dtype=DTYPES[args.dtype],
        num_shards=args.num_shards,
        init_std=args.init_std,
        with_tokenizer=not args.no_tokenizer,
        quant=quant,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry: `python -m services.model.make_model DIR --preset tiny --seed S`."""
    parser = argparse.ArgumentParser(prog="moemesh make-model", description=__doc__.splitlines()[0])
    add_arguments(parser)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

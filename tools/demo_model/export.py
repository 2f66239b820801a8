"""What a finished training run leaves: the hub-layout checkpoint, expert hits, samples.

The checkpoint is what moemesh and transformers load: `config.json` (hub
spellings), `generation_config.json`, per-expert safetensors in shards under
`MAX_SHARD_BYTES` with their index, the run's own `tokenizer.json` and a
`tokenizer_config.json` with the ChatML template, and `SOURCES.md`.
Hits and samples are measured on the saved weights, in fp32, so that serving
the checkpoint reproduces them.
"""

import dataclasses
import json
import math
import pathlib
import shutil
import time

import torch

from tools.demo_model.model import DemoMoE, expert_counts, hub_weights, load_hub_weights
from services.model.checkpoint import load_weights
from services.model.config import ModelConfig
from services.model.make_model import _write_weights
from services.tokenizer import tokenizer_config

# Each file must come back from the GPU machine on its own (at most 16 MB).
MAX_SHARD_BYTES = 12_000_000
SOURCES_MD = pathlib.Path(__file__).resolve().parent / "SOURCES.md"


def save_checkpoint(model: DemoMoE, out_dir: pathlib.Path, tokenizer_json: pathlib.Path,
                    aux_loss_coef: float) -> None:
    """Writes the hub-layout checkpoint of model (in its config's dtype) into out_dir."""
    c = model.config
    weights = {name: t.to("cpu", c.dtype) for name, t in hub_weights(model).items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    num_shards = max(1, math.ceil(sum(t.nbytes for t in weights.values()) / MAX_SHARD_BYTES))
    _write_weights(out_dir, weights, num_shards)
    hub = {**c.to_hub_dict(), "router_aux_loss_coef": aux_loss_coef}
    (out_dir / "config.json").write_text(json.dumps(hub, indent=2) + "\n")
    generation = {"bos_token_id": hub["bos_token_id"], "eos_token_id": hub["eos_token_id"]}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    shutil.copyfile(tokenizer_json, out_dir / "tokenizer.json")
    config = tokenizer_config("PreTrainedTokenizerFast", c.max_position_embeddings)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    if SOURCES_MD.is_file():
        shutil.copyfile(SOURCES_MD, out_dir / "SOURCES.md")
    for path in out_dir.iterdir():
        path.chmod(0o644)  # safetensors writes its files private


def load_checkpoint_fp32(ckpt_dir: pathlib.Path, device) -> DemoMoE:
    """The saved checkpoint, read back through moemesh's loader, as an fp32 DemoMoE."""
    config = dataclasses.replace(ModelConfig.from_model_dir(ckpt_dir), dtype=torch.float32)
    weights = load_weights(ckpt_dir, config, range(config.num_experts), dtype=torch.float32)
    model = DemoMoE(config)
    load_hub_weights(model, weights)
    return model.to(device).eval()


@torch.no_grad()
def expert_hits(model: DemoMoE, prompts: list[dict]) -> dict:
    """Per layer and expert, how many prompt tokens were routed to it (each prompt alone)."""
    c, device = model.config, next(model.parameters()).device
    hits_LE = torch.zeros(c.num_hidden_layers, c.num_experts, dtype=torch.int64)
    for prompt in prompts:
        _, _, ids_per_layer = model(torch.tensor([prompt["token_ids"]], device=device))
        for layer, ids_NK in enumerate(ids_per_layer):
            hits_LE[layer] += expert_counts(ids_NK, c.num_experts).cpu()
    return {
        "num_tokens": sum(len(p["token_ids"]) for p in prompts),
        "top_k": c.num_experts_per_tok,
        "prompts": prompts,
        "layers": [hit_summary(layer, row.tolist()) for layer, row in enumerate(hits_LE)],
    }


def hit_summary(layer: int, hits: list[int]) -> dict:
    """One layer's hits, with max/mean and min/mean (1.0 each when perfectly balanced)."""
    mean = sum(hits) / len(hits)
    return {"layer": layer, "hits": hits, "max_over_mean": round(max(hits) / mean, 4),
            "min_over_mean": round(min(hits) / mean, 4)}


@torch.no_grad()
def greedy_samples(model: DemoMoE, prompts: list[dict], eos_ids: tuple[int, ...], max_new_tokens: int,
                   deadline: float = math.inf) -> list[dict]:
    """Greedy continuations of each prompt (full recompute per token; the model is small),
    cut short at `deadline` (time.monotonic()): samples are the one optional output."""
    device, samples = next(model.parameters()).device, []
    for prompt in prompts:
        ids = list(prompt["token_ids"])
        new_ids: list[int] = []
        while (len(new_ids) < max_new_tokens and len(ids) < model.config.max_position_embeddings
               and time.monotonic() < deadline):
            logits_BTV, _, _ = model(torch.tensor([ids], device=device))
            token = int(logits_BTV[0, -1].argmax())
            new_ids.append(token)
            ids.append(token)
            if token in eos_ids:
                break
        samples.append({"kind": prompt["kind"], "prompt": prompt["text"], "new_token_ids": new_ids})
    return samples


def decode_samples(samples: list[dict], tokenizer_json: pathlib.Path) -> None:
    """Adds the text of each sample, when this tokenizers version reads the file."""
    try:
        import tokenizers

        tok = tokenizers.Tokenizer.from_file(str(tokenizer_json))
    except Exception as err:  # missing, or too old: tokenizers raises a plain Exception for such a file
        print(f"samples left undecoded ({err}); pack.py unpack decodes them", flush=True)
        return
    for sample in samples:
        sample["completion"] = tok.decode(sample["new_token_ids"], skip_special_tokens=False)

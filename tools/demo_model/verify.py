"""Checks a demo checkpoint against moemesh's serving model, transformers and its own records.

    python -m tools.demo_model.verify services/model/demo [--hits tools/demo_model/expert_hits.json]

On every prompt of the fixed set, in fp32: moemesh's Qwen3MoeModel (paged KV,
one prefill) gives the same logits as transformers' Qwen3MoeForCausalLM, and
both as the training-time model but for near ties of its routing (at most
NEAR_TIE_PROMPTS prompts, where moemesh and transformers agree); moemesh's
tokenizer and transformers' (with the checkpoint's chat template) encode the
prompts as training did; moemesh's router hit counters equal transformers'
routing, and the training model's (recounted here) and the run's record up
to near ties (`--rewrite-hits` stores the recount).
Prints one line per check and raises AssertionError on the first failure.
"""

import argparse
import dataclasses
import json
import pathlib
import sys

import torch

from tools.demo_model.export import expert_hits, load_checkpoint_fp32
from services.kv_pool import KVPool
from services.model.batch import SeqInput, build_forward_batch
from services.model.checkpoint import load_weights
from services.model.config import ModelConfig
from services.model.qwen3_moe import Qwen3MoeModel
from services.tokenizer import Tokenizer

BLOCK_SIZE = 16
ATOL = 1e-4
# Near ties of the training model's own routing allowed (prompts off by more than ATOL, routed
# slots): its code sums the gate logits in another order than moemesh and transformers, which
# agree with each other bit for bit on such a prompt.
NEAR_TIE_PROMPTS = 2
NEAR_TIE_SLOTS = 2


def moemesh_logits(model: Qwen3MoeModel, config: ModelConfig, token_ids: list[int]) -> torch.Tensor:
    """Logits of every position of one prompt, one prefill through the paged KV cache."""
    num_blocks = -(-len(token_ids) // BLOCK_SIZE)
    kv = KVPool.for_model(config, num_blocks, BLOCK_SIZE, torch.float32, "cpu")
    batch = build_forward_batch([SeqInput(0, token_ids, 0, list(range(num_blocks)), True)], BLOCK_SIZE, "cpu")
    batch = dataclasses.replace(batch, sample_indices_S=torch.arange(len(token_ids)))
    return model.forward(batch, kv)


def check_tokenizer(ckpt: pathlib.Path, prompts: list[dict]) -> None:
    """moemesh's tokenizer (the checkpoint's own tokenizer.json) encodes the prompts as training did."""
    tok = Tokenizer.from_model_dir(ckpt)
    config = ModelConfig.from_model_dir(ckpt)
    assert tok.vocab_size == config.vocab_size, (tok.vocab_size, config.vocab_size)
    assert set(tok.eos_token_ids) == set(config.eos_token_ids), (tok.eos_token_ids, config.eos_token_ids)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(ckpt)
    for p in prompts:
        is_chat = p["kind"] == "chat"
        ids = tok.encode_chat([("user", p["text"])]) if is_chat else tok.encode(p["text"])
        assert ids == p["token_ids"], (p["text"], ids, p["token_ids"])
        text = (hf.apply_chat_template([{"role": "user", "content": p["text"]}], add_generation_prompt=True,
                                       tokenize=False) if is_chat else p["text"])
        assert text == p["model_text"], (text, p["model_text"])
        assert hf(text, add_special_tokens=False)["input_ids"] == p["token_ids"], p["text"]
    print(f"tokenizer: moemesh and transformers encode all {len(prompts)} prompts as training did")


def check_logits(ckpt: pathlib.Path, prompts: list[dict]) -> dict:
    """moemesh against transformers on every prompt, fp32, and both against the training-time
    model. A prompt where both differ alike from the training model is a near tie of its
    routing: the training code sums a gate logit in another order and picks another expert
    (moemesh and transformers agree bit for bit there). At most NEAR_TIE_PROMPTS of those.
    Returns moemesh's and transformers' router hits."""
    from transformers import Qwen3MoeForCausalLM

    config = dataclasses.replace(ModelConfig.from_model_dir(ckpt), dtype=torch.float32)
    experts = range(config.num_experts)
    ours = Qwen3MoeModel(config, load_weights(ckpt, config, experts, dtype=torch.float32), expert_ids=experts)
    hf = Qwen3MoeForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager",
                                             experts_implementation="eager").eval()
    trained = load_checkpoint_fp32(ckpt, "cpu")
    hf_hits_LE = torch.zeros_like(ours.hit_counts_LE)
    worst, near_ties = {"transformers": 0.0, "training": 0.0}, []
    with torch.no_grad():
        for p in prompts:
            ids = p["token_ids"]
            logits, hf_out = moemesh_logits(ours, config, ids), hf(torch.tensor([ids]), output_router_logits=True)
            torch.testing.assert_close(logits, hf_out.logits[0], atol=ATOL, rtol=0,
                                       msg=f"moemesh against transformers on {p['text']!r}")
            for layer, router_TE in enumerate(hf_out.router_logits):
                top_TK = router_TE.topk(config.num_experts_per_tok, dim=-1).indices.flatten()
                hf_hits_LE[layer] += torch.bincount(top_TK, minlength=config.num_experts)
            diff = float((logits - trained(torch.tensor([ids]))[0][0]).abs().max())
            worst["transformers"] = max(worst["transformers"], float((logits - hf_out.logits[0]).abs().max()))
            if diff > ATOL:
                near_ties.append(f"{p['text'][:40]!r} ({diff:.1e})")
            else:
                worst["training"] = max(worst["training"], diff)
    assert len(near_ties) <= NEAR_TIE_PROMPTS, f"moemesh and transformers differ from training on {near_ties}"
    print(f"logits: max |diff| over {len(prompts)} prompts: moemesh to transformers {worst['transformers']:.2e}, "
          f"to the training model {worst['training']:.2e} (atol {ATOL})"
          + (f"; both off the training model alike (a near tie of its routing) on {', '.join(near_ties)}"
             if near_ties else ""))
    return {"hits_LE": ours.hit_counts_LE.tolist(), "transformers_hits_LE": hf_hits_LE.tolist()}


def _moved(a_LE: list[list[int]], b_LE: list[list[int]]) -> int:
    """Routed slots that differ between two hit tables (each moved slot counts twice)."""
    return sum(abs(a - b) for row_a, row_b in zip(a_LE, b_LE) for a, b in zip(row_a, row_b))


def check_hits(recorded: dict, hits: dict, ckpt: pathlib.Path) -> dict:
    """moemesh's router counters equal transformers' routing; the training model's recount on
    this CPU and the record (measured on the GPU) are within near ties of them: up to
    NEAR_TIE_SLOTS slots of the recount, 1% of the record. Returns the recount."""
    moemesh_hits_LE = hits["hits_LE"]
    assert moemesh_hits_LE == hits["transformers_hits_LE"], (moemesh_hits_LE, hits["transformers_hits_LE"])
    recount = expert_hits(load_checkpoint_fp32(ckpt, "cpu"), recorded["prompts"])
    recount_LE = [layer["hits"] for layer in recount["layers"]]
    slots = recount["num_tokens"] * recount["top_k"] * len(recount_LE)
    off_recount = _moved(moemesh_hits_LE, recount_LE)
    assert off_recount <= 2 * NEAR_TIE_SLOTS, f"moemesh's hits differ from the recount by {off_recount} of {slots}"
    moved = _moved(recount_LE, [layer["hits"] for layer in recorded["layers"]])
    assert moved <= 0.01 * slots, f"the record differs from the recount by {moved} of {slots} slots"
    ratios = ", ".join(f"{layer['max_over_mean']:.2f}" for layer in recount["layers"])
    print(f"hits: moemesh's counters equal transformers' ({recount['num_tokens']} tokens), differ from the "
          f"training model's recount by {off_recount // 2} slot(s); the record differs from the recount by "
          f"{moved} of {slots} slots; max/mean per layer: {ratios}")
    return recount


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=pathlib.Path)
    parser.add_argument("--hits", type=pathlib.Path,
                        help="expert_hits.json of the run (default: in the checkpoint's parent, a run directory)")
    parser.add_argument("--rewrite-hits", action="store_true",
                        help="replace the recorded hits by this machine's recount if they differ")
    args = parser.parse_args(argv)
    hits_path = args.hits or args.checkpoint.parent / "expert_hits.json"
    recorded = json.loads(hits_path.read_text())
    torch.set_num_threads(1)
    check_tokenizer(args.checkpoint, recorded["prompts"])
    hits = check_logits(args.checkpoint, recorded["prompts"])
    recount = check_hits(recorded, hits, args.checkpoint)
    if args.rewrite_hits and recount != recorded:
        hits_path.write_text(json.dumps(recount, indent=1) + "\n")
        print(f"rewrote {hits_path} with the recount, which serving on a CPU reproduces exactly")
    return 0


if __name__ == "__main__":
    sys.exit(main())

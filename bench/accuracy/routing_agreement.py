"""Per-layer top-k routing agreement of quantized models with their bf16 twins (issue 29).

    python -m bench.accuracy.routing_agreement --device cpu --preset tiny --out bench/results   # the CPU result
    python -m bench.accuracy.routing_agreement --preset qwen3-30b-a3b --out /tmp/routing      # one H200

The gate is never quantized, but a quantized model's hidden states drift,
and with them the experts its gates pick. For each format (--quant), random
weights are drawn as the dense preset draws them and quantized into the
checkpoint layout (bench/accuracy/quant_parity.py); the same prompts
(teacher forced, one prefill each: services/model/quant/routing.py) then go
through three bf16 models, one at a time (the 30B shape's three do not fit
one GPU together):
- the quantized model, on the path --quantized-kernel picks;
- its dequantized twin: the same weights dequantized, served dense; against it
  the agreement measures the compute path alone (on the CPU's reference path,
  which computes with exactly those weights, it is 100%);
- the original: the unquantized draw; against it the agreement measures what
  quantizing the projections costs the routing.
Per MoE layer: `overlap`, the mean share of a token's K experts both models
pick (operators' "top-k routing accuracy"), and `exact`, the share of tokens
routed to the same set. Writes routing_agreement_<device>.md and .json to --out.
"""

import argparse
import dataclasses
import json
import pathlib
import sys
import time

import torch

from bench.accuracy import quant_parity
from services.model.quant.dispatch import QUANTIZED_KERNELS
from services.model.quant.linear import Dequantized
from services.model.quant.routing import recorded_routing
from services.model.qwen3_moe import Qwen3MoeModel
from services.model.random_weights import RandomWeights, preset

ROOT = pathlib.Path(__file__).resolve().parents[2]


def agreement(a_TK: torch.Tensor, b_TK: torch.Tensor) -> dict:
    """Two models' expert choices for the same tokens ([T, K] each): mean overlap and exact share."""
    shared_T = (a_TK[:, :, None] == b_TK[:, None, :]).any(-1).sum(-1)
    k = a_TK.shape[1]
    return {"overlap": float(shared_T.float().mean() / k), "exact": float((shared_T == k).float().mean())}


def routing_of(config, weights, args) -> tuple[dict[int, torch.Tensor], str]:
    """One bf16 model's recorded routing of the prompts, and its quantized path ("bf16" if none);
    the model is freed before returning."""
    model = Qwen3MoeModel(config, weights, expert_ids=range(config.num_experts), dtype=torch.bfloat16,
                          device=args.device, attention="auto" if args.device != "cpu" else "torch",
                          quantized_kernel=args.quantized_kernel)
    path = quant_parity.compute_path(model)[0]
    with torch.inference_mode():
        routed = recorded_routing(model, args.prompt_ids)
    del model
    if args.device != "cpu":
        torch.cuda.empty_cache()
    return routed, path


def run(args) -> dict:
    config = preset(args.preset)
    if args.layers:
        config = dataclasses.replace(config, num_hidden_layers=args.layers)
    generator = torch.Generator().manual_seed(args.seed + 1)
    args.prompt_ids = torch.randint(1000, 100000, (args.prompts, args.prompt_tokens), generator=generator).tolist()
    start = time.perf_counter()
    dense = RandomWeights(config, range(config.num_experts), args.seed, dtype=torch.bfloat16, device=args.device)
    original, _ = routing_of(config, dense, args)
    formats = {}
    for method in [m for m in args.quant.split(",") if m]:
        args.quant_method = method
        weights = RandomWeights(config, range(config.num_experts), args.seed, dtype=torch.bfloat16,
                                device=args.device, quant=quant_parity.quant_config(method, config))
        quantized, path = routing_of(config, weights, args)
        twin, _ = routing_of(config, Dequantized(weights), args)
        layers = [{"layer": i, "tokens": quantized[i].shape[0], "twin": agreement(quantized[i], twin[i]),
                   "original": agreement(quantized[i], original[i])} for i in config.moe_layers]
        mean = {ref: {key: sum(r[ref][key] for r in layers) / len(layers) for key in ("overlap", "exact")}
                for ref in ("twin", "original")}
        formats[method] = {"path": path, "layers": layers, "mean": mean}
    return {"config": {"preset": args.preset, "layers": config.num_hidden_layers, "seed": args.seed,
                       "prompts": args.prompts, "prompt_tokens": args.prompt_tokens, "device": args.device,
                       "quantized_kernel": args.quantized_kernel, "top_k": config.num_experts_per_tok,
                       "experts": config.num_experts},
            "formats": formats, "seconds": round(time.perf_counter() - start, 1)}


def render(result: dict, command: str) -> str:
    c = result["config"]
    lines = ["# Top-k routing agreement of quantized models", "", f"Command: `{command}`", "",
             f"Model: {c['preset']} shape, {c['layers']} layers, {c['experts']} experts, top-{c['top_k']}, random "
             f"weights (seed {c['seed']}) quantized into the checkpoint layouts, bf16 compute on {c['device']}; "
             f"{c['prompts']} prompts of {c['prompt_tokens']} random tokens, one prefill each (teacher forced).", "",
             "Per MoE layer: overlap = mean share of a token's top-k experts both models pick; exact = share of "
             "tokens with the same set. `twin`: the same weights dequantized and served dense (the compute path's "
             "effect); `original`: the unquantized draw the weights were quantized from (quantization's effect).", ""]
    for method, f in result["formats"].items():
        m = f["mean"]
        lines += [f"## {method} (path `{f['path']}`)", "",
                  f"Mean over layers: vs twin overlap {m['twin']['overlap']:.4%}, exact {m['twin']['exact']:.4%}; "
                  f"vs original overlap {m['original']['overlap']:.4%}, exact {m['original']['exact']:.4%}.", "",
                  "| layer | tokens | vs twin: overlap | exact | vs original: overlap | exact |",
                  "|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['layer']} | {r['tokens']} | {r['twin']['overlap']:.4%} | {r['twin']['exact']:.4%} | "
                  f"{r['original']['overlap']:.4%} | {r['original']['exact']:.4%} |" for r in f["layers"]]
        lines.append("")
    lines.append(f"Wall time {result['seconds']} s.")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.accuracy.routing_agreement", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=0, help="cut the preset to this many layers (0: all)")
    p.add_argument("--quant", default="fp8,awq", help="comma list of formats")
    p.add_argument("--quantized-kernel", choices=QUANTIZED_KERNELS, default="auto")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    command = "python -m bench.accuracy.routing_agreement " + " ".join(argv if argv is not None else sys.argv[1:])
    result = run(args)
    out, name = pathlib.Path(args.out), f"routing_agreement_{'cpu' if args.device == 'cpu' else 'cuda'}"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"command": command, **result}, indent=1) + "\n")
    text = render(result, command)
    (out / f"{name}.md").write_text(text)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

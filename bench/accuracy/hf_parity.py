"""The serving model's logits against transformers' on the same weights, on the GPU (issue 8).

    python -m bench.accuracy.hf_parity --out bench/results                     # one H200, Qwen3-30B-A3B shape
    python -m bench.accuracy.hf_parity --device cpu --preset tiny --batches 1,3 --out /tmp/x  # CPU smoke run

The speed figures count only if the model they time computes what the reference
computes. The CPU tests hold the torch code to transformers in fp32; this holds
the GPU path the benchmarks time (the Triton kernels, paged KV, CUDA graphs of
decode steps, the batch-1, small-batch and grouped MoE kernels) to it, at the
released shape, on the random weights gpu_speed serves (the preset, --seed).

Every sequence is --prompt-tokens random tokens, then --decode-tokens more fed
one by one (teacher forcing: the same inputs for every model, so errors cannot
snowball through different tokens). The oracle is transformers in fp32 (eager
attention and experts, the reference settings) on the bf16 weights upcast. Each
candidate's logits at every position are set against the oracle's:
- `transformers bf16`: transformers as a user runs it (its default attention and
  experts), one forward over each whole sequence: the error bf16 itself costs;
- `moemesh bB`: the serving model decoding B sequences at once (groups of B of the
  first max(B, MIN_SEQS) sequences): one prefill step of their prompts (the logits
  of every prompt position), then decode steps as an expert service runs them,
  through expert_svc's DecodeGraphRunner on CUDA (each batch's first step eager,
  then captured and replayed; 50 rows run in the 64-row graph, padded);
- `moemesh N mixed`: N sequences in the steps the gateway mixes: half of them
  decoding while the other half's prompts arrive in two chunks (the second
  attending to the first's cache), each chunk in a step with their decodes.

With `--quant fp8|awq` (bench/accuracy/quant_parity.py) the serving model runs the
weights quantized into the checkpoint layout on the path `--quantized-kernel` picks,
and both transformers runs use the DEQUANTIZED weights; the weight-only paths are
held to the bounds below, the FP8 tensor-core path to quant_parity's.

    python -m bench.accuracy.hf_parity --quant awq --layers 8 --out /tmp/awq    # the 30B shape, 8 layers

A run passes when its mean absolute logit error is at most MAX_ERROR_RATIO times
transformers bf16's on the same positions and its worst row's (one position's
mean over the vocabulary) at most MAX_WORST_ROW_RATIO times transformers bf16's
worst row. Argmax agreement with the oracle is reported, not judged: on random
weights near-ties make it noisy over a few hundred positions. The script exits 1
if a run fails. Writes hf_parity.md and .json to --out.
"""

import argparse
import contextlib
import dataclasses
import json
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.accuracy import quant_parity  # noqa: E402
from bench.serving.gpu_speed import hf_model  # noqa: E402
from expert_svc.graph_runner import make_graph_runner  # noqa: E402
from services.kv_pool import KV_CACHE_DTYPES, KVPool, kv_cache_dtype  # noqa: E402
from services.model.batch import SeqInput, build_forward_batch  # noqa: E402
from services.model.qwen3_moe import Qwen3MoeModel  # noqa: E402
from services.model.quant.dispatch import QUANTIZED_KERNELS  # noqa: E402
from services.model.random_weights import preset  # noqa: E402

BLOCK_SIZE = 16
GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# A run passes when its mean |logit error| is at most MAX_ERROR_RATIO times transformers bf16's on
# the same positions, and its worst row's at most MAX_WORST_ROW_RATIO times transformers bf16's
# worst row (a fault in a few sequences or positions hardly moves the mean).
MAX_ERROR_RATIO = 1.5
MAX_WORST_ROW_RATIO = 3.0
MIN_SEQS = 8  # a run of batch B decodes groups of B sequences: the first max(B, MIN_SEQS)
HF_CHUNK_TOKENS = 1024  # the most tokens of one transformers forward (whole sequences, at least one)
PREFILL_TOKENS = 4096  # the most prompt tokens of one moemesh prefill step (whole prompts, at least one)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=0, help="cut the preset to this many layers (0: all)")
    p.add_argument("--batches", default="1,8,50,256",
                   help="moemesh runs, each decoding groups of B of the first max(B, MIN_SEQS) sequences "
                        "(50: a graph bucket padded to 64)")
    p.add_argument("--mixed", type=int, default=16,
                   help="also a run of this many sequences in mixed steps: half decoding while the other half's "
                        "prompts arrive in two chunks (0: none)")
    p.add_argument("--prompt-tokens", type=int, default=40)
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0, help="the weights' seed (gpu_speed's mesh: 0)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--attention", default="auto", help="moemesh's attention backend (the expert service's default)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", *KV_CACHE_DTYPES),
                   help="moemesh's KV cache: auto (bf16, the check's setting) or fp8_e4m3 (what it costs in accuracy)")
    p.add_argument("--quant", choices=("fp8", "awq"), default=None,
                   help="serve the weights quantized (references on the dequantized weights)")
    p.add_argument("--quantized-kernel", choices=QUANTIZED_KERNELS, default="auto",
                   help="the quantized weights' path (the expert service's flag)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    return p.parse_args(argv)


@dataclasses.dataclass(slots=True)
class RowErrors:
    """Per (sequence, position) of one candidate: its logits against the oracle's."""

    mean_abs_BL: torch.Tensor
    max_abs_BL: torch.Tensor
    agree_BL: torch.Tensor  # bool: argmax equal to the oracle's

    @classmethod
    def empty(cls, shape) -> "RowErrors":
        nan = float("nan")
        return cls(torch.full(shape, nan), torch.full(shape, nan), torch.zeros(shape, dtype=torch.bool))

    def add(self, seq_N: torch.Tensor, pos_N: torch.Tensor, logits_NV: torch.Tensor, ref_BLV: torch.Tensor) -> None:
        """Scores rows (seq_N[i], pos_N[i]) of a candidate, logits_NV on any device."""
        ref_NV = ref_BLV[seq_N, pos_N].to(logits_NV.device)
        diff_NV = (logits_NV.float() - ref_NV).abs()
        self.mean_abs_BL[seq_N, pos_N] = diff_NV.mean(-1).cpu()
        self.max_abs_BL[seq_N, pos_N] = diff_NV.amax(-1).cpu()
        self.agree_BL[seq_N, pos_N] = (logits_NV.argmax(-1) == ref_NV.argmax(-1)).cpu()

    def discordant(self, other: "RowErrors", num_seqs: int, positions: slice) -> int:
        """Over the same positions as summary: how many have exactly one of the two agreeing with the oracle."""
        return int((self.agree_BL[:num_seqs, positions] != other.agree_BL[:num_seqs, positions]).sum())

    def summary(self, num_seqs: int, positions: slice) -> dict:
        """Over the first num_seqs sequences' positions: the mean of the rows' mean |error|, the
        worst row's mean |error|, the largest |error| and the share of argmaxes agreeing."""
        mean_abs, max_abs = self.mean_abs_BL[:num_seqs, positions], self.max_abs_BL[:num_seqs, positions]
        assert not mean_abs.isnan().any(), "a position was not scored"
        return {"positions": mean_abs.numel(), "mean_abs_err": mean_abs.mean().item(),
                "worst_row_err": mean_abs.max().item(), "max_abs_err": max_abs.max().item(),
                "argmax_agree": self.agree_BL[:num_seqs, positions].float().mean().item()}


def make_tokens(config, num_seqs: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, config.vocab_size, (num_seqs, length), generator=g)


def hf_logits(config, args, tokens_BL, dtype, within=contextlib.nullcontext, **implementations):
    """Yields (first sequence, logits [n, L, V] on the device) per chunk of transformers' forwards, run
    inside within(model)."""
    weights = quant_parity.reference_weights(config, args, args.device)
    model = hf_model(config, weights, dtype, args.device, **implementations)
    try:
        with torch.inference_mode(), within(model):
            chunk = max(1, HF_CHUNK_TOKENS // tokens_BL.shape[1])
            for start in range(0, tokens_BL.shape[0], chunk):
                ids = tokens_BL[start:start + chunk].to(args.device)
                yield start, model(ids).logits.float()
    finally:
        del model
        if args.device != "cpu":
            torch.cuda.empty_cache()


def oracle(config, args, tokens_BL) -> torch.Tensor:
    """transformers fp32 (eager attention and experts) logits [B, L, V], on the host."""
    ref_BLV = torch.empty(*tokens_BL.shape, config.vocab_size)
    for start, logits in hf_logits(config, args, tokens_BL, torch.float32, attn_implementation="eager",
                                   experts_implementation="eager"):
        ref_BLV[start:start + logits.shape[0]] = logits.cpu()
    return ref_BLV


def score_hf_bf16(config, args, tokens_BL, ref_BLV) -> RowErrors:
    return _score_hf(hf_logits(config, args, tokens_BL, torch.bfloat16), tokens_BL, ref_BLV)


def score_fp8_rounding(config, args, tokens_BL, ref_BLV) -> RowErrors:
    """transformers fp32 (eager) with every quantized projection's input rounded as the FP8 tensor-core
    path rounds it (quant_parity.fp8_inputs): what the rounding alone costs, the FP8 verdict's baseline."""
    return _score_hf(hf_logits(config, args, tokens_BL, torch.float32, quant_parity.fp8_inputs,
                               attn_implementation="eager", experts_implementation="eager"), tokens_BL, ref_BLV)


def _score_hf(chunks, tokens_BL, ref_BLV) -> RowErrors:
    errors = RowErrors.empty(tokens_BL.shape)
    length = tokens_BL.shape[1]
    for start, logits in chunks:
        n = logits.shape[0]
        seq = torch.arange(start, start + n).repeat_interleave(length)
        errors.add(seq, torch.arange(length).repeat(n), logits.reshape(n * length, -1), ref_BLV)
    return errors


def build_moemesh(config, args) -> Qwen3MoeModel:
    weights = quant_parity.serving_weights(config, args, args.device)
    return Qwen3MoeModel(config, weights, expert_ids=range(config.num_experts), dtype=torch.bfloat16,
                         device=args.device, attention=args.attention,
                         quantized_kernel=getattr(args, "quantized_kernel", "auto"))


class MoemeshScorer:
    """Runs steps of the serving model on one KV pool (each sequence its own blocks) and scores
    every row they return against the oracle."""

    def __init__(self, model, kv, graphs, ref_BLV, device):
        self.model, self.kv, self.graphs, self.ref_BLV, self.device = model, kv, graphs, ref_BLV, device
        self.per_seq = kv.num_blocks // ref_BLV.shape[0]

    def seq(self, i: int, token_ids, num_computed: int) -> SeqInput:
        return SeqInput(i, [int(t) for t in token_ids], num_computed,
                        list(range(i * self.per_seq, (i + 1) * self.per_seq)), True)

    def eager_step(self, seqs: list[SeqInput], errors: RowErrors) -> None:
        """One step as the rank runs a step with prefill rows (no graph), every row's logits scored."""
        batch = build_forward_batch(seqs, BLOCK_SIZE, self.device)
        batch = dataclasses.replace(batch, sample_indices_S=torch.arange(batch.num_tokens, device=self.device))
        logits = self.model.forward_at_capacity(batch, self.kv, self.model.dispatch_capacity(batch.num_tokens))
        errors.add(torch.tensor([s.seq_id for s in seqs for _ in s.token_ids]),
                   torch.tensor([s.num_computed + j for s in seqs for j in range(len(s.token_ids))]),
                   logits, self.ref_BLV)

    def decode_step(self, seqs: list[SeqInput], errors: RowErrors) -> None:
        """One token per sequence, as expert_svc's StepRunner runs it: by the graph runner where
        it fits, else eagerly."""
        capacity = self.model.dispatch_capacity(len(seqs))
        if self.graphs is not None and self.graphs.fits(seqs, capacity):
            logits = self.graphs.run(seqs, capacity).logits_SV
        else:
            logits = self.model.forward_at_capacity(build_forward_batch(seqs, BLOCK_SIZE, self.device), self.kv,
                                                    capacity)
        errors.add(torch.tensor([s.seq_id for s in seqs]), torch.tensor([s.num_computed for s in seqs]), logits,
                   self.ref_BLV)


def score_batch(scorer: MoemeshScorer, group: range, tokens_BL, args, errors: RowErrors) -> None:
    """A group of sequences through the serving model together: prefill steps of their prompts
    (every prompt position's logits), then one decode step of them all per decode token."""
    prompt = args.prompt_tokens
    per_step = max(1, PREFILL_TOKENS // prompt)
    for first in range(group.start, group.stop, per_step):
        scorer.eager_step([scorer.seq(i, tokens_BL[i, :prompt], 0)
                           for i in range(first, min(first + per_step, group.stop))], errors)
    for pos in range(prompt, prompt + args.decode_tokens):
        scorer.decode_step([scorer.seq(i, tokens_BL[i, pos:pos + 1], pos) for i in group], errors)


def score_mixed(scorer: MoemeshScorer, num_seqs: int, tokens_BL, args, errors: RowErrors) -> None:
    """Steps as the gateway mixes them: the first half of the sequences prefilled and decoding
    while the second half's prompts arrive in two chunks (the second attending to the first's
    cache), each chunk in one step with a decode token of every sequence of the first half;
    then decode steps of whoever has tokens left (the first half finishes two steps early)."""
    prompt, length = args.prompt_tokens, tokens_BL.shape[1]
    early, late, cut = range(num_seqs // 2), range(num_seqs // 2, num_seqs), prompt // 2
    scorer.eager_step([scorer.seq(i, tokens_BL[i, :prompt], 0) for i in early], errors)
    for t, (lo, hi) in enumerate(((0, cut), (cut, prompt))):
        decodes = [scorer.seq(i, tokens_BL[i, prompt + t:prompt + t + 1], prompt + t) for i in early]
        scorer.eager_step(decodes + [scorer.seq(i, tokens_BL[i, lo:hi], lo) for i in late], errors)
    for step in range(args.decode_tokens):
        positions = [(i, prompt + step + 2) for i in early] + [(i, prompt + step) for i in late]
        scorer.decode_step([scorer.seq(i, tokens_BL[i, p:p + 1], p) for i, p in positions if p < length], errors)


def verdict(candidate: dict, baseline: dict) -> dict:
    """Whether the candidate's errors are those of bf16 (the baseline's), everywhere and at its worst row."""
    ratio = candidate["mean_abs_err"] / baseline["mean_abs_err"]
    worst_ratio = candidate["worst_row_err"] / baseline["worst_row_err"]
    return {"error_ratio": ratio, "worst_row_ratio": worst_ratio,
            "ok": ratio <= MAX_ERROR_RATIO and worst_ratio <= MAX_WORST_ROW_RATIO}


def run(args, corrupt=None) -> dict:
    """The whole comparison; `corrupt(model)`, if given, alters the moemesh model first (a test
    that the check can fail)."""
    config = preset(args.preset)
    if args.layers:
        config = dataclasses.replace(config, num_hidden_layers=args.layers)
    batches = sorted({int(b) for b in args.batches.split(",")})
    length = args.prompt_tokens + args.decode_tokens
    if args.mixed == 1 or args.mixed < 0:
        raise ValueError(f"--mixed must be 0 or at least 2 sequences, got {args.mixed}")
    if args.mixed and (args.decode_tokens < 2 or args.prompt_tokens < 2):
        raise ValueError(f"--mixed needs 2 or more prompt and decode tokens, got {args.prompt_tokens} and "
                         f"{args.decode_tokens}")
    tokens_BL = make_tokens(config, max(*batches, MIN_SEQS, args.mixed), length, args.seed)
    marks = [time.perf_counter()]
    ref_BLV = oracle(config, args, tokens_BL)
    marks.append(time.perf_counter())
    hf_errors = score_hf_bf16(config, args, tokens_BL, ref_BLV)
    marks.append(time.perf_counter())
    # What the FP8 tensor-core path's input rounding alone costs: that path's verdict's baseline, and
    # beside an FP8 checkpoint's weight-only run (the CPU's too) what the tensor-core path would lose.
    is_fp8 = getattr(args, "quant", None) == "fp8"
    rounding_errors = score_fp8_rounding(config, args, tokens_BL, ref_BLV) if is_fp8 else None
    marks.append(time.perf_counter())
    model = corrupt(build_moemesh(config, args)) if corrupt else build_moemesh(config, args)
    per_seq = -(-length // BLOCK_SIZE)
    kv = KVPool.for_model(config, per_seq * tokens_BL.shape[0], BLOCK_SIZE,
                          kv_cache_dtype(args.kv_cache_dtype, torch.bfloat16), args.device)
    # As an expert service decodes: CUDA graphs where the attention backend captures, else eager
    # steps (the CPU smoke run; the graph runner's static batch would feed the torch attention's
    # host loops stale lengths).
    graphs = make_graph_runner(model, kv, BLOCK_SIZE, GRAPH_BUCKETS, max_context=per_seq * BLOCK_SIZE)
    phases = {"prefill": slice(0, args.prompt_tokens), "decode": slice(args.prompt_tokens, length)}
    path, path_reason = quant_parity.compute_path(model)
    rows = []
    scorer = MoemeshScorer(model, kv, graphs, ref_BLV, args.device)
    runs = [(str(b), max(b, MIN_SEQS)) for b in batches] + ([(f"{args.mixed} mixed", args.mixed)] * bool(args.mixed))
    for name, num_seqs in runs:
        errors = RowErrors.empty(tokens_BL.shape)
        if name.endswith("mixed"):
            score_mixed(scorer, num_seqs, tokens_BL, args, errors)
        else:
            batch = int(name)
            for first in range(0, num_seqs, batch):
                score_batch(scorer, range(first, min(first + batch, num_seqs)), tokens_BL, args, errors)
        for phase, positions in phases.items():
            baseline = hf_errors.summary(num_seqs, positions)
            candidate = errors.summary(num_seqs, positions)
            row = {"batch": name, "phase": phase, "hf_bf16": baseline, "moemesh": candidate}
            if rounding_errors is not None:
                row["hf_fp8_inputs"] = rounding_errors.summary(num_seqs, positions)
            if path == "fp8":
                rows.append({**row, **quant_parity.fp8_verdict(
                    candidate, baseline, row["hf_fp8_inputs"], errors.discordant(rounding_errors, num_seqs, positions))})
            else:
                rows.append({**row, **verdict(candidate, baseline)})
    marks.append(time.perf_counter())
    timings = dict(zip(("oracle_s", "hf_bf16_s", "fp8_rounding_s", "moemesh_s"),
                       (b - a for a, b in zip(marks, marks[1:]))))
    return {"config": {"preset": args.preset, "layers": config.num_hidden_layers, "seed": args.seed,
                       "prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens,
                       "attention": type(model.attention).__name__, "device": args.device,
                       "quant": getattr(args, "quant", None), "path": path, "path_reason": path_reason,
                       "kv_cache_dtype": str(kv.k_cache.dtype).removeprefix("torch.")},
            "graph_counts": None if graphs is None else [graphs.num_eager, graphs.num_captures, graphs.num_replays],
            "oracle_max_abs_logit": ref_BLV.abs().max().item(), "rows": rows, "timings_s": timings,
            "ok": all(r["ok"] for r in rows)}


def render(result: dict, command: str) -> str:
    c, counts = result["config"], result["graph_counts"]
    decode = "eager" if counts is None else f"CUDA graphs: eager / captures / replays {counts}"
    quant = (f" Quantized: {c['quant']}, served on the `{c['path']}` path ({c['path_reason']}); both transformers "
             f"runs on the dequantized weights." if c.get("quant") else "")
    bounds = (f"the FP8 tensor-core path's bounds: <= {quant_parity.FP8_MAX_ERROR_RATIO}x, worst position <= "
              f"{quant_parity.FP8_MAX_WORST_ROW_RATIO}x, argmax agreement at most "
              f"{100 * quant_parity.FP8_MAX_AGREE_DROP:.0f} points below transformers fp32's with the same FP8 "
              f"rounding of the projections' inputs (the `fp32, FP8 inputs` column: what the rounding alone costs), "
              f"plus {quant_parity.FP8_AGREE_NOISE_Z:g} standard errors of the measured drop (sqrt(positions where "
              f"exactly one of the two agrees with the oracle) / positions; the `agree drop / bound` column, points)"
              if c.get("path") == "fp8" else "")
    rounding = any("hf_fp8_inputs" in r for r in result["rows"])
    lines = ["# moemesh against transformers on the same weights", "", f"Command: `{command}`", "",
             f"Model: {c['preset']} shape, {c['layers']} layers, random weights (seed {c['seed']}), bf16; "
             f"moemesh attention `{c['attention']}` on {c['device']}, KV cache {c['kv_cache_dtype']}; "
             f"{c['prompt_tokens']} prompt tokens (one prefill step's logits at every position) then "
             f"{c['decode_tokens']} decode steps ({decode}), the same random tokens for every model; "
             f"the oracle's largest |logit| {result['oracle_max_abs_logit']:.3g}.{quant}",
             "", "Logit errors are against transformers fp32 (eager attention and experts) on the same weights: "
             "the mean |error| over positions and vocabulary, the worst position's mean, the largest single "
             "|error|, and the share of positions whose argmax is the oracle's. A run passes at a mean |error| "
             f"<= {MAX_ERROR_RATIO}x transformers bf16's on the same positions and a worst position <= "
             f"{MAX_WORST_ROW_RATIO}x transformers bf16's{'; here ' + bounds if bounds else ''}.", "",
             "| batch | phase | positions | transformers bf16: mean / worst / max err, agree | "
             + ("transformers fp32, FP8 inputs: mean / worst / max err, agree | " if rounding else "")
             + "moemesh: mean / worst / max err, agree | error ratio | worst ratio | "
             + ("agree drop / bound | " if bounds else "") + "ok |",
             "|---:|---|---:|---|" + ("---|" if rounding else "") + "---|---:|---:|" + ("---:|" if bounds else "")
             + "---|"]
    for r in result["rows"]:
        h, m = r["hf_bf16"], r["moemesh"]
        rounded = f"{_errors(r['hf_fp8_inputs'])} | " if rounding else ""
        lines.append(f"| {r['batch']} | {r['phase']} | {m['positions']} | {_errors(h)} | {rounded}{_errors(m)} | "
                     f"{r['error_ratio']:.3f} | {r['worst_row_ratio']:.3f} | "
                     + (f"{100 * r['argmax_drop']:.1f} / {100 * r['argmax_drop_bound']:.1f} | " if bounds else "")
                     + f"{'yes' if r['ok'] else 'NO'} |")
    t = result["timings_s"]
    lines += ["", f"Verdict: {'every row passes' if result['ok'] else 'FAILED'}. Wall time: oracle "
              f"{t['oracle_s']:.0f} s, transformers bf16 {t['hf_bf16_s']:.0f} s, moemesh {t['moemesh_s']:.0f} s."]
    return "\n".join(lines) + "\n"


def _errors(summary: dict) -> str:
    return (f"{summary['mean_abs_err']:.4g} / {summary['worst_row_err']:.4g} / {summary['max_abs_err']:.4g}, "
            f"{100 * summary['argmax_agree']:.1f}%")


def main(argv=None) -> int:
    args = parse_args(argv)
    command = "python -m bench.accuracy.hf_parity " + " ".join(argv if argv is not None else sys.argv[1:])
    result = run(args)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hf_parity.json").write_text(json.dumps({"command": command, **result}, indent=1) + "\n")
    text = render(result, command)
    (out / "hf_parity.md").write_text(text)
    print(text, flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

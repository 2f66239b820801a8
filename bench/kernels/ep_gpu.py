"""Expert parallelism on two GPUs: N=2 against N=1, and the cost of dispatch + combine.

    python bench/kernels/ep_gpu.py                         # 2 GPUs, NCCL, bf16: the issue-3 run
    python bench/kernels/ep_gpu.py --device cpu --small    # 2 CPU processes, gloo, a tiny model (CI smoke)

Self-contained: two processes from torch.multiprocessing, the library's model
code (services.model) called directly; no gRPC, no etcd. The random model is
generated on the device from a seed, tensor by tensor (each tensor's seed is
derived from its name), so the trunk and the gates are the same on both ranks
and each rank materialises only its own experts.

1. Correctness. Each rank prefills its half of the prompts with the N=2 model
   (data-parallel attention, experts split), scoring every prompt position,
   then decodes greedily. Rank 0 then runs every prompt in one batch through an
   N=1 model holding all experts and compares: max and mean abs logit
   difference (within a tolerance of the dtype), top-1 agreement, greedy
   tokens (first divergence and the reference's top-2 gap there). The check
   passes if the logits are within the tolerance and every top-1 flip and
   greedy divergence falls on a near-tie of the reference (top two closer than
   twice the largest logit difference): bf16 logits tie often over a 151936
   vocabulary, and a different batch split rounds differently.
2. Speed. dispatch + combine of one MoE layer at decode batch sizes per rank,
   for each dispatch mode (host splits; fixed capacity; fixed capacity replayed
   as a CUDA graph), timed with CUDA events after a warm-up: the median of many
   iterations, the slower rank's. The experts are the identity (combine gets the
   dispatched rows back), so each output must equal the one-rank sum over the
   token's K weighted rows up to fp32 regrouping: its largest difference is
   reported, with the bytes one rank sends per layer (both all-to-alls).

3. CUDA only: one whole MoE layer replayed as a CUDA graph through each path, and at
   --profile-batch tokens per rank the kernels of one eager call of the gathered paths
   (torch.profiler: where the layer's time goes beyond reading its experts' weights).

Rank 0 prints a markdown table and writes `<name>.json` and `<name>.md` under
--out (default bench/results/). Exit status 1 if the correctness check fails.
Uses only APIs of torch 2.11 and older.
"""

import argparse
import dataclasses
import datetime
import json
import pathlib
import socket
import statistics
import sys
import time
import zlib
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.kernels.kernel_profile import top_kernels  # noqa: E402
from services.kv_pool import KVPool  # noqa: E402
from services.model.batch import SeqInput, build_forward_batch  # noqa: E402
from services.model.checkpoint import expected_tensors  # noqa: E402
from services.model.config import ModelConfig  # noqa: E402
from services.model.layers import AddNorm  # noqa: E402
from services.model.exchange.comm import ExpertComm  # noqa: E402
from services.model.moe import MoELayer  # noqa: E402
from services.model.moe_dispatch import combine, dispatch, gate, local_expert_ids, step_capacity  # noqa: E402
from services.model.qwen3_moe import Qwen3MoeModel  # noqa: E402

WORLD_SIZE = 2
BLOCK_SIZE = 16
# The issue's model: 8 layers, hidden 2048, 64 experts, top-8.
LARGE = ModelConfig(vocab_size=151936, hidden_size=2048, num_hidden_layers=8, num_attention_heads=32,
                    num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
                    num_experts=64, num_experts_per_tok=8, max_position_embeddings=4096)
SMALL = ModelConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                    num_experts=8, num_experts_per_tok=2, max_position_embeddings=512)
# Largest logit difference allowed, relative to the largest reference logit.
REL_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class RandomWeights(Mapping):
    """Hub-named weights of `expert_ids`, each generated on first access from (seed, name)."""

    def __init__(self, config: ModelConfig, expert_ids, seed: int, dtype, device, init_std: float):
        self._shapes = expected_tensors(config, expert_ids)
        self._seed, self._dtype, self._device, self._init_std = seed, dtype, device, init_std

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self._shapes[name]
        g = torch.Generator(device=self._device).manual_seed(self._seed * 2**32 + zlib.crc32(name.encode()))
        if name.endswith("norm.weight"):  # norms in [0.9, 1.1]
            return 0.9 + 0.2 * torch.rand(shape, generator=g, device=self._device, dtype=self._dtype)
        return torch.randn(shape, generator=g, device=self._device, dtype=self._dtype) * self._init_std

    def __contains__(self, name) -> bool:
        return name in self._shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)


@dataclasses.dataclass(frozen=True)
class Settings:
    device: str
    small: bool
    dtype: str
    seed: int
    init_std: float
    num_prompts: int
    num_steps: int
    batch_sizes: tuple[int, ...]
    warmup: int
    iters: int
    out: str
    port: int
    profile_batch: int = 128

    @property
    def config(self) -> ModelConfig:
        return SMALL if self.small else LARGE

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def _device(settings: Settings, rank: int) -> torch.device:
    return torch.device(f"cuda:{rank}" if settings.device == "cuda" else "cpu")


def _prompts(settings: Settings) -> list[list[int]]:
    g = torch.Generator().manual_seed(settings.seed)
    low, high = (3, 12) if settings.small else (8, 48)
    lengths = torch.randint(low, high, (settings.num_prompts,), generator=g).tolist()
    return [torch.randint(0, settings.config.vocab_size, (n,), generator=g).tolist() for n in lengths]


def _run(model: Qwen3MoeModel, prompts: list[list[int]], num_steps: int, settings: Settings, device):
    """Prefill scoring every prompt position, then greedy decode in lockstep.

    Returns (logits of every prompt position [sum(len), V] fp32 on the CPU,
    greedy tokens per prompt, the top-2 logit gap per prompt and step)."""
    config = settings.config
    blocks_per_seq = -(-(max(map(len, prompts), default=0) + num_steps) // BLOCK_SIZE)
    kv = KVPool.for_model(config, max(1, len(prompts) * blocks_per_seq), BLOCK_SIZE, settings.torch_dtype, device)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(len(prompts))]
    batch = build_forward_batch([SeqInput(i, p, 0, tables[i], True) for i, p in enumerate(prompts)],
                                BLOCK_SIZE, device)
    every_row = torch.arange(batch.num_tokens, device=device)
    logits_TV = model.forward(dataclasses.replace(batch, sample_indices_S=every_row), kv)
    ends = torch.tensor([len(p) for p in prompts], device=device).cumsum(0) - 1
    last_SV = logits_TV[ends]
    tokens, gaps = [[] for _ in prompts], [[] for _ in prompts]
    for step in range(num_steps):
        if step:
            seqs = [SeqInput(i, [tokens[i][-1]], len(p) + step - 1, tables[i], True) for i, p in enumerate(prompts)]
            last_SV = model.forward(build_forward_batch(seqs, BLOCK_SIZE, device), kv)
        top2 = last_SV.topk(2, dim=-1)
        for i, (token, gap) in enumerate(zip(top2.indices[:, 0].tolist(),
                                              (top2.values[:, 0] - top2.values[:, 1]).tolist())):
            tokens[i].append(token)
            gaps[i].append(gap)
    return logits_TV.cpu(), tokens, gaps


def check_correctness(rank: int, settings: Settings, device) -> dict | None:
    """N=2 on both ranks, then N=1 on rank 0; rank 0 returns the comparison."""
    config, prompts = settings.config, _prompts(settings)
    mine = prompts[rank::WORLD_SIZE]
    comm = ExpertComm(dist.group.WORLD)
    experts = local_expert_ids(config.num_experts, rank, WORLD_SIZE)
    weights = RandomWeights(config, experts, settings.seed, settings.torch_dtype, device, settings.init_std)
    model = Qwen3MoeModel(config, weights, expert_ids=experts, comm=comm, dtype=settings.torch_dtype, device=device)
    logits, tokens, _ = _run(model, mine, settings.num_steps, settings, device)
    del model
    gathered = [None] * WORLD_SIZE
    dist.all_gather_object(gathered, (logits, tokens))
    if rank != 0:
        return None
    # The reference batch in the order the ranks hold the prompts.
    order = [i for r in range(WORLD_SIZE) for i in range(r, len(prompts), WORLD_SIZE)]
    weights = RandomWeights(config, range(config.num_experts), settings.seed, settings.torch_dtype, device,
                            settings.init_std)
    reference = Qwen3MoeModel(config, weights, expert_ids=range(config.num_experts), comm=ExpertComm.local(),
                              dtype=settings.torch_dtype, device=device)
    ref_logits, ref_tokens, ref_gaps = _run(reference, [prompts[i] for i in order], settings.num_steps,
                                            settings, device)
    del reference
    got_logits = torch.cat([g[0] for g in gathered])
    got_tokens = [t for g in gathered for t in g[1]]
    return _compare(got_logits, got_tokens, ref_logits, ref_tokens, ref_gaps, settings)


def _compare(got_logits, got_tokens, ref_logits, ref_tokens, ref_gaps, settings: Settings) -> dict:
    """The comparison; an argmax may flip only where the reference's top two are
    closer than twice the largest logit difference measured (a near-tie)."""
    diff = (got_logits - ref_logits).abs()
    max_diff, scale = diff.max().item(), ref_logits.abs().max().item()
    tie_tolerance = 2 * max_diff
    got_top1 = got_logits.argmax(-1)
    flip_gaps = (ref_logits.max(-1).values - ref_logits.gather(-1, got_top1[:, None])[:, 0])[
        got_top1 != ref_logits.argmax(-1)].tolist()
    agree = [next((s for s, (a, b) in enumerate(zip(got, ref)) if a != b), len(ref))
             for got, ref in zip(got_tokens, ref_tokens)]
    divergences = [{"prompt": i, "step": s, "ref_top2_gap": ref_gaps[i][s]}
                   for i, s in enumerate(agree) if s < len(ref_tokens[i])]
    result = {
        "num_prompts": len(ref_tokens),
        "num_positions": int(ref_logits.shape[0]),
        "max_abs_diff": max_diff,
        "mean_abs_diff": diff.mean().item(),
        "max_abs_ref_logit": scale,
        "rel_tolerance": REL_TOLERANCE[settings.torch_dtype],
        "tie_tolerance": tie_tolerance,
        "top1_agreement": 1 - len(flip_gaps) / max(1, ref_logits.shape[0]),
        "top1_flip_ref_gaps": flip_gaps,
        "greedy_steps": settings.num_steps,
        "greedy_identical_prompts": sum(s == settings.num_steps for s in agree),
        "greedy_divergences": divergences,
    }
    result["logits_ok"] = max_diff <= result["rel_tolerance"] * scale
    result["flips_at_ties_only"] = all(gap <= tie_tolerance for gap in flip_gaps) and all(
        d["ref_top2_gap"] <= tie_tolerance for d in divergences)
    result["passed"] = result["logits_ok"] and result["flips_at_ties_only"]
    return result


def _timer(device):
    """start() / stop() -> ms of the work between them, read after a sync at the end."""
    if device.type == "cuda":
        def mark():
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return mark, lambda a, b: a.elapsed_time(b)
    return time.perf_counter, lambda a, b: (b - a) * 1e3


class _CountingComm(ExpertComm):
    """ExpertComm adding up the bytes its all-to-alls send (this rank's own share included)."""

    def __init__(self, group):
        super().__init__(group)
        self.sent_bytes = 0

    def all_to_all(self, out, inp, out_splits=None, in_splits=None) -> None:
        self.sent_bytes += inp.numel() * inp.element_size()
        super().all_to_all(out, inp, out_splits, in_splits)


def time_dispatch_combine(rank: int, settings: Settings, device, *, graphed: bool) -> list[dict]:
    """This rank's median dispatch and combine times per batch size and mode: host
    splits and fixed capacity, or (graphed) fixed capacity replayed as a CUDA graph;
    with each mode's bytes sent and largest difference from the one-rank sum."""
    config, comm = settings.config, _CountingComm(dist.group.WORLD)
    num_local = config.num_experts // WORLD_SIZE
    g = torch.Generator(device=device).manual_seed(settings.seed + 1)
    w_gate_ED = torch.randn(config.num_experts, config.hidden_size, generator=g, device=device,
                            dtype=settings.torch_dtype) * 0.02
    rows, (mark, elapsed) = [], _timer(device)
    for batch_size in settings.batch_sizes:
        x_TD = torch.randn(batch_size, config.hidden_size, generator=g, device=device, dtype=settings.torch_dtype)
        ids_TK, weights_TK, counts_E = gate(x_TD, w_gate_ED, config.num_experts_per_tok, True)
        fixed = step_capacity(batch_size, config.num_experts_per_tok, num_local, max_fixed_tokens=1 << 30)
        # Identity experts: out = the sum of the token's K weighted rows, in fp32, rounded once.
        expected_TD = (x_TD[:, None] * weights_TK[..., None]).sum(1, dtype=torch.float32).to(x_TD.dtype)

        def layer(capacity):
            x_PD, meta = dispatch(x_TD, ids_TK, weights_TK, counts_E, comm, capacity)
            middle = mark()
            return combine(x_PD, meta, comm), middle

        if graphed:
            modes = [(f"fixed capacity, CUDA graph ({fixed}/peer)", fixed, _graphed(lambda: layer(fixed), mark))]
        else:
            modes = [("host splits", None, lambda: layer(None)),
                     (f"fixed capacity ({fixed}/peer)", fixed, lambda: layer(fixed))]
        for name, capacity, run in modes:
            comm.sent_bytes = 0
            layer(capacity)  # eager, once: what one layer sends (a replay calls no all_to_all here)
            sent_bytes = comm.sent_bytes
            dispatch_ms, total_ms, out_TD = _time(run, settings, device, mark, elapsed)
            rows.append({"batch_per_rank": batch_size, "mode": name, "rank": rank,
                         "dispatch_us": None if graphed else 1e3 * statistics.median(dispatch_ms),
                         "combine_us": None if graphed else 1e3 * statistics.median(
                             t - d for t, d in zip(total_ms, dispatch_ms)),
                         "total_us": 1e3 * statistics.median(total_ms), "sent_bytes": sent_bytes,
                         "max_abs_diff": (out_TD.float() - expected_TD.float()).abs().max().item(),
                         "max_abs_out": expected_TD.float().abs().max().item()})
    return rows


# The whole MoE layer at Qwen3-30B-A3B's shape (section 3): experts, width, top-k; hidden from LARGE.
LAYER_EXPERTS, LAYER_WIDTH, LAYER_TOP_K = 128, 768, 8


def time_moe_layer(rank: int, settings: Settings, device) -> list[dict]:
    """CUDA: one whole MoE layer of Qwen3-30B-A3B's shape (128 experts, 64 per rank) replayed as a
    CUDA graph per batch size, through moe_dispatch's dispatch / sorted_experts / combine and through
    kernels.moe_ep's gather / reduce-scatter (NCCL, and symmetric memory pull, push and signals), alone and
    handed the layer loop's residual add and next norm; each output's largest difference from
    the one-rank layer holding every expert (kernels.moe_grouped.grouped_moe on the same tokens), the
    exchanges' bits against NCCL's, and the fused add and norm's against add_rms_norm_ after."""
    from services.model.exchange.symmetric import SymmetricExchange
    from services.model.kernels import moe_ep, norm

    hidden, comm = LARGE.hidden_size, ExpertComm(dist.group.WORLD)
    g = torch.Generator(device=device).manual_seed(settings.seed + 2)  # the same weights on both ranks
    w_gate_ED = torch.randn(LAYER_EXPERTS, hidden, generator=g, device=device, dtype=settings.torch_dtype) * 0.02
    w_gate_up_EGD = torch.randn(LAYER_EXPERTS, 2 * LAYER_WIDTH, hidden, generator=g, device=device,
                                dtype=settings.torch_dtype) * 0.02
    w_down_EDF = torch.randn(LAYER_EXPERTS, hidden, LAYER_WIDTH, generator=g, device=device,
                             dtype=settings.torch_dtype) * 0.02
    mine = local_expert_ids(LAYER_EXPERTS, rank, WORLD_SIZE)
    hits_E = torch.zeros(LAYER_EXPERTS, dtype=torch.int64, device=device)
    layer = MoELayer(w_gate_ED, w_gate_up_EGD[mine.start:mine.stop].contiguous(),
                     w_down_EDF[mine.start:mine.stop].contiguous(), top_k=LAYER_TOP_K, norm_topk_prob=True,
                     comm=comm, hit_counts_E=hits_E)
    one_rank = MoELayer(w_gate_ED, w_gate_up_EGD, w_down_EDF, top_k=LAYER_TOP_K, norm_topk_prob=True,
                        comm=ExpertComm.local(), hit_counts_E=hits_E.clone())
    capacities = {b: step_capacity(b, LAYER_TOP_K, len(mine), max_fixed_tokens=1 << 30) for b in settings.batch_sizes}
    modes = [("dispatch + combine (moe_dispatch)", False, None), (NCCL_MODE, True, None)]
    rows, (mark, elapsed) = [], _timer(device)
    # last: a machine without it gets the other rows
    for name, push, signals in ((PULL_MODE, False, False), (PUSH_MODE, True, False), (SIGNALS_MODE, True, True)):
        try:
            modes.append((name, True, SymmetricExchange(
                dist.group.WORLD, max(c // min(LAYER_TOP_K, len(mine)) for c in capacities.values()),
                moe_ep.row_width(hidden, LAYER_TOP_K, settings.torch_dtype), hidden, settings.torch_dtype, device,
                timeout_ms=20_000, push=push, signals=signals)))  # a rank that fails traps the other after 20 s
        except Exception as error:  # noqa: BLE001 (reported in the table)
            rows.append({"mode": name, "rank": rank, "error": repr(error)[:500]})
    norm_D = torch.rand(hidden, generator=g, device=device).to(settings.torch_dtype) + 0.5
    for batch_size in settings.batch_sizes:
        x_TD = torch.randn(batch_size, hidden, generator=torch.Generator(device=device).manual_seed(rank),
                           device=device, dtype=settings.torch_dtype)
        residual_TD = torch.randn_like(x_TD)
        capacity = capacities[batch_size]
        expected_TD = one_rank(x_TD)
        outputs = {}
        for name, gathered, exchange in modes:
            moe_ep.ENABLED, comm.exchange = gathered, exchange
            # As the fused layer loop calls it: the residual add and the next layer's norm handed over.
            add_norm = AddNorm(residual_TD.clone(), norm_D, 1e-6, norm.add_rms_norm_)
            try:
                run = _graphed(lambda: (layer(x_TD, capacity), None), mark)
                _, total_ms, out_TD = _time(run, settings, device, mark, elapsed)
                run = _graphed(lambda: (layer(x_TD, capacity, add_norm), None), mark)
                add_norm_ms = _time(run, settings, device, mark, elapsed)[1]
            except RuntimeError as error:
                if exchange is None:
                    raise
                rows.append({"mode": name, "rank": rank, "batch_per_rank": batch_size, "error": repr(error)[:500]})
                continue
            outputs[name] = out_TD.clone()
            row = {"batch_per_rank": batch_size, "mode": name, "rank": rank,
                   "total_us": 1e3 * statistics.median(total_ms), "add_norm_us": 1e3 * statistics.median(add_norm_ms),
                   "max_abs_diff": (out_TD.float() - expected_TD.float()).abs().max().item(),
                   "max_abs_out": expected_TD.float().abs().max().item()}
            if gathered and batch_size == settings.profile_batch:  # where the layer's time goes
                row["kernels"] = top_kernels(lambda: layer(x_TD, capacity, add_norm), device)
            if exchange is not None:  # the same sums as NCCL's, rounded the same: the same bits
                row["equal_to_nccl"] = torch.equal(out_TD, outputs[NCCL_MODE])
                # the add and norm fused into the exchange's sum: the bits of add_rms_norm_ after it
                fused_x_TD, unfused_x_TD = residual_TD.clone(), residual_TD.clone()
                h_TD = layer(x_TD, capacity, AddNorm(fused_x_TD, norm_D, 1e-6, norm.add_rms_norm_))
                unfused_h_TD = norm.add_rms_norm_(unfused_x_TD, layer(x_TD, capacity), norm_D, 1e-6)
                row["add_norm_equal"] = torch.equal(fused_x_TD, unfused_x_TD) and torch.equal(h_TD, unfused_h_TD)
            rows.append(row)
    moe_ep.ENABLED, comm.exchange = True, None
    return rows


NCCL_MODE = "gather + reduce-scatter (kernels.moe_ep)"
PULL_MODE = "gather + reduce-scatter over symmetric memory, each rank reading its peers' buffers (pull)"
PUSH_MODE = "gather + reduce-scatter over symmetric memory, each rank writing into its peers' buffers (push)"
SIGNALS_MODE = "push, flags in the kernels instead of barrier kernels (signals)"


def _time(run, settings: Settings, device, mark, elapsed) -> tuple[list[float], list[float], torch.Tensor]:
    """ms from start to the middle mark and to the end, per iteration, after a warm-up;
    and the last iteration's output."""
    for _ in range(settings.warmup):
        run()
    dist.barrier()
    marks = []
    for _ in range(settings.iters):
        start = mark()
        out_TD, middle = run()
        marks.append((start, middle, mark()))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return [elapsed(a, b) for a, b, _ in marks], [elapsed(a, c) for a, _, c in marks], out_TD


def _graphed(layer, mark):
    """`layer` captured once in a CUDA graph (it fails if layer syncs with the host);
    returns a replay function (dispatch and combine are not timed apart)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            layer()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_TD, _ = layer()

    def replay():
        graph.replay()
        return out_TD, mark()
    return replay


def worker(rank: int, settings: Settings) -> None:
    device = _device(settings, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=WORLD_SIZE,
                            init_method=f"tcp://127.0.0.1:{settings.port}", timeout=datetime.timedelta(minutes=5))
    try:
        torch.set_num_threads(1 if device.type == "cpu" else torch.get_num_threads())
        started = time.perf_counter()
        correctness = check_correctness(rank, settings, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        dist.barrier()
        rows = _gather(time_dispatch_combine(rank, settings, device, graphed=False))
        if rank == 0:
            _report(settings, correctness, rows, time.perf_counter() - started)
        if device.type == "cuda":  # last, once the rest is written: a failed capture may break NCCL
            try:
                graphed = time_dispatch_combine(rank, settings, device, graphed=True)
            except RuntimeError as error:
                graphed = [{"mode": "fixed capacity, CUDA graph", "rank": rank, "error": repr(error)}]
            rows += _gather(graphed)
            if rank == 0:
                _report(settings, correctness, rows, time.perf_counter() - started)
            try:
                layer_rows = time_moe_layer(rank, settings, device)
            except RuntimeError as error:
                layer_rows = [{"mode": "whole MoE layer", "rank": rank, "error": repr(error)}]
            rows += _gather(layer_rows)
            if rank == 0:
                _report(settings, correctness, rows, time.perf_counter() - started)
    finally:
        dist.destroy_process_group()


def _gather(rows: list[dict]) -> list[dict]:
    """Every rank's rows, on every rank."""
    gathered = [None] * WORLD_SIZE
    dist.all_gather_object(gathered, rows)
    return [row for rank_rows in gathered for row in rank_rows]


def _environment(settings: Settings) -> dict:
    env = {"torch": torch.__version__, "device": settings.device, "dtype": settings.dtype}
    if settings.device == "cuda":
        env |= {"cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0),
                "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    return env


def _report(settings: Settings, correctness: dict, rows: list[dict], seconds: float) -> None:
    """Prints the markdown report and writes it, with the JSON, under settings.out."""
    slowest, errors = {}, [row for row in rows if "error" in row]
    for row in rows:  # per (batch, mode): the slower rank's medians
        if "error" in row:
            continue
        key = (row["batch_per_rank"], row["mode"])
        if key not in slowest or row["total_us"] > slowest[key]["total_us"]:
            slowest[key] = row
    c = correctness
    lines = [
        f"# Expert parallelism, N=2 against N=1 ({settings.device}, {settings.dtype}"
        f"{', small model' if settings.small else ''})", "",
        f"Command: `python {' '.join(sys.argv)}`", "",
        f"Environment: {json.dumps(_environment(settings))}", "",
        f"Model: {json.dumps(_model_summary(settings.config))}", "",
        "## Correctness", "",
        f"- {c['num_prompts']} prompts, {c['num_positions']} positions scored: max abs logit diff "
        f"{c['max_abs_diff']:.4g} (mean {c['mean_abs_diff']:.3g}; largest logit {c['max_abs_ref_logit']:.4g}, "
        f"tolerance {c['rel_tolerance']:g} of it): {'ok' if c['logits_ok'] else 'FAILED'}",
        f"- top-1 agreement: {100 * c['top1_agreement']:.2f}% (reference top-1 minus the logit picked "
        f"instead, where they differ: {[round(g, 4) for g in c['top1_flip_ref_gaps']] or 'none'})",
        f"- greedy: {c['greedy_identical_prompts']}/{c['num_prompts']} prompts identical over "
        f"{c['greedy_steps']} steps; divergences: {c['greedy_divergences'] or 'none'}",
        f"- flips only at near-ties (reference top-2 gap <= {c['tie_tolerance']:.4g}, twice the largest "
        f"logit difference): {'yes' if c['flips_at_ties_only'] else 'NO'}",
        f"- **{'PASSED' if c['passed'] else 'FAILED'}**", "",
        "## dispatch + combine per MoE layer (median, slower rank, microseconds)", "",
        "KB sent: by one rank per layer, dispatch and combine together (its share to itself included);",
        "max diff: the largest |output - one-rank sum| of any rank (identity experts).", "",
        "| batch per rank | mode | dispatch | combine | total | KB sent | max diff |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    max_diffs = {}
    for row in rows:
        if "error" not in row:
            key = (row["batch_per_rank"], row["mode"])
            max_diffs[key] = max(max_diffs.get(key, 0.0), row["max_abs_diff"])
    layer_rows = []
    for (batch_size, mode), row in sorted(slowest.items(), key=lambda kv: kv[0][0]):
        if "sent_bytes" not in row:  # a whole-layer row (time_moe_layer)
            layer_rows.append(row)
            continue
        parts = ["-" if row[k] is None else f"{row[k]:.1f}" for k in ("dispatch_us", "combine_us")]
        lines.append(f"| {batch_size} | {mode} | {parts[0]} | {parts[1]} | {row['total_us']:.1f} | "
                     f"{row['sent_bytes'] / 1024:.1f} | {max_diffs[batch_size, mode]:.3g} |")
    if layer_rows:
        lines += ["", f"## One whole MoE layer, {LAYER_EXPERTS} experts ({LAYER_EXPERTS // WORLD_SIZE} per rank), "
                  f"top-{LAYER_TOP_K}, width {LAYER_WIDTH}: CUDA graph replays (median, slower rank, microseconds)", "",
                  "max diff: the largest |output - one-rank layer| of any rank, relative to the largest output;",
                  "with add + norm: the layer as the fused layer loop calls it, handed the residual add and the "
                  "next layer's RMSNorm (the exchange fuses them into its sum; the other paths run add_rms_norm_ "
                  "after).", "",
                  "| batch per rank | mode | total | with add + norm | max diff (relative) |", "|---:|---|---:|---:|---:|"]
        for row in layer_rows:
            relative = max_diffs[row["batch_per_rank"], row["mode"]] / max(row["max_abs_out"], 1e-30)
            lines.append(f"| {row['batch_per_rank']} | {row['mode']} | {row['total_us']:.1f} | "
                         f"{row.get('add_norm_us', float('nan')):.1f} | {relative:.3g} |")
        for row in layer_rows:
            if row.get("kernels"):  # the slower rank's
                lines += ["", f"### Kernels of one eager call, rank {row['rank']}, {row['batch_per_rank']} tokens per "
                          f"rank: {row['mode']}", "", "| kernel | calls | total us |", "|---|---:|---:|"]
                lines += [f"| `{k['name'][:90]}` | {k['calls']} | {k['total_us']:.1f} |" for k in row["kernels"]]
        equal = [r["equal_to_nccl"] for r in rows if "equal_to_nccl" in r]
        if equal:
            lines += ["", f"Symmetric memory (pull and push) against NCCL (gather + reduce-scatter), every batch size "
                      f"and rank: {'bit-identical' if all(equal) else 'DIFFERENT'} outputs ({sum(equal)} of "
                      f"{len(equal)} equal)."]
        fused = [r["add_norm_equal"] for r in rows if "add_norm_equal" in r]
        if fused:
            lines += ["", f"The exchange's sum with the add and norm fused against add_rms_norm_ after it: "
                      f"{'bit-identical' if all(fused) else 'DIFFERENT'} ({sum(fused)} of {len(fused)} equal)."]
    lines += [f"\n{row['mode']} failed on rank {row['rank']}: {row['error']}" for row in errors]
    lines += ["", f"Wall time: {seconds:.1f} s", ""]
    text = "\n".join(lines)
    print(text, flush=True)
    out = pathlib.Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"ep_gpu_{settings.device}" + ("_small" if settings.small else "")
    (out / f"{name}.md").write_text(text)
    (out / f"{name}.json").write_text(json.dumps({
        "command": sys.argv, "environment": _environment(settings), "model": _model_summary(settings.config),
        "settings": dataclasses.asdict(settings), "correctness": correctness, "timings": rows}, indent=2))


def _model_summary(config: ModelConfig) -> dict:
    keys = ("num_hidden_layers", "hidden_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
            "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")
    return {k: getattr(config, k) for k in keys}


def parse_args(argv=None) -> Settings:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--small", action="store_true", help="a tiny model (CPU smoke test)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init-std", type=float, default=0.02)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--num-steps", type=int, default=32, help="greedy decode steps compared")
    p.add_argument("--batch-sizes", default="1,32,256", help="decode tokens per rank to time")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--profile-batch", type=int, default=128,
                   help="CUDA: the batch per rank whose whole MoE layer (gathered modes) gets a kernel profile")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < WORLD_SIZE:
        p.error(f"--device cuda needs {WORLD_SIZE} GPUs, found {torch.cuda.device_count()}")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return Settings(device=args.device, small=args.small,
                    dtype=args.dtype or ("bfloat16" if args.device == "cuda" else "float32"), seed=args.seed,
                    init_std=args.init_std, num_prompts=args.num_prompts, num_steps=args.num_steps,
                    batch_sizes=tuple(int(b) for b in args.batch_sizes.split(",")), warmup=args.warmup,
                    iters=args.iters, out=args.out, port=port, profile_batch=args.profile_batch)


def main(argv=None) -> int:
    settings = parse_args(argv)
    torch.multiprocessing.spawn(worker, args=(settings,), nprocs=WORLD_SIZE)
    result = json.loads((pathlib.Path(settings.out) / (f"ep_gpu_{settings.device}"
                                                       + ("_small" if settings.small else "") + ".json")).read_text())
    return 0 if result["correctness"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

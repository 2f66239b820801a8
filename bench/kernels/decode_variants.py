"""Graph-replayed decode steps of the serving model under kernel settings, A/B in one run.

    python -m bench.kernels.decode_variants --out DIR [--preset qwen3-30b-a3b] [--layers 48]
        [--batch-sizes 256,128,1] [--context 1024:2048] [--steps 30] [--profile]
        [--variants "name=module.attr:value,module.attr:value;name2=..."]
        [--ranks 2 [--exchanges pull,push,collectives] [--baseline ONE_RANK_DIR/decode_variants.json]]

Lent machines differ by about 6%, so variants are only comparable within one
run: this builds the serving model once (bench/kernels/decode_graph_check.py's build:
random weights of --preset at full width, --layers layers, bf16, triton
attention, one rank) and runs every variant on it. A variant sets module
attributes, `module.attr:value`, the module's dotted path under services.model
or else expert_svc (e.g. kernels.rotary.QKV_ONE_TOKEN_STEPS:64 for
services.model.kernels.rotary, runner.X for expert_svc.runner), the value a Python
literal; unknown names fail before anything runs. It takes effect only where
the code reads the attribute at run time (not a value copied at import).
"base" (no change) runs first; an empty variant ("again=") measures the noise.

Per batch size, each sequence gets a cached context drawn uniformly (seeded by
the batch size) from --context lo:hi of a KV pool filled with noise; every
variant then, under its settings (restored after, whatever happens):
1. Builds a new DecodeGraphRunner (a new capture: the kernels differ) and runs
   the first decode step (one token per sequence at its context) twice
   through it, eager then capture + replay; the replay's fp32 logits against
   base's: largest difference (and the median row's) over the largest logit,
   and argmax agreement. Other kernels may round differently (bf16 ulps amplified
   by depth, or a flipped expert choice in a few rows): recorded, never a failure.
2. Runs the same step and decodes on from it through StepRunner.run_step (plan in,
   tokens on the host out) with a new runner: 3 warm-up steps, then --steps
   timed ones: the median wall time of a step and the GPU time of its graph
   replay (CUDA events around the replay).
3. With --profile, at the largest batch: the top kernels of one eager step.
A variant that raises (a setting that does not compile or capture) gets an error
row and the run goes on; base raising ends it.

--ranks N (expert parallelism, issue 8's N=2): N processes, one GPU each, rank r
holding experts r * E / N .. as an expert service does (random weights drawn
per expert: the same model as one rank's), the ranks in one process group
(NCCL; gloo on the CPU). --batch-sizes are then totals: each rank decodes its
share of one draw of contexts (the same contexts one rank gets), so a row's
step makes as many tokens as the one-rank row of its batch, and --baseline (a
one-rank run's decode_variants.json) gives each row its one-rank base step
over its own: the speed-up over one GPU of the graph-replayed step. On CUDA
each variant runs under each of --exchanges: pull, push and signals,
exchange/symmetric.py's symmetric-memory exchange (the expert service's
--ep-exchange, alone, with --ep-exchange-push, with --ep-exchange-signals),
collectives its NCCL all_gather and reduce_scatter. A row's times are its slower rank's; the logit comparison the
worst rank's (argmax agreement their mean); --profile gives every rank's
kernels. A variant that raises ends a run of several ranks (the others would
wait in a collective).

--device cpu is a smoke test: torch attention, no fused kernels, graphs replaced
by eager re-runs (timed by the host clock), so every variant computes what base does.
Writes decode_variants.json and .md to --out.
"""

import argparse
import ast
import contextlib
import dataclasses
import datetime
import gc
import importlib
import json
import pathlib
import re
import shlex
import socket
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from bench.kernels import kernel_profile
from bench.kernels.decode_graph_check import build
from expert_svc.graph_runner import DecodeGraphRunner, cuda_capture
from expert_svc.runner import StepRunner
from services.kv_pool import KVPool, kv_cache_dtype
from services.model.batch import SeqInput, build_forward_batch
from services.model.exchange.comm import ExpertComm
from services.model.moe_backend import gathers_on
from services.model.moe_dispatch import local_expert_ids
from services.model.qwen3_moe import Qwen3MoeModel
from services.model.random_weights import RandomWeights, preset
from services.step import NewSequence, SamplingSpec, ScheduledSequence, StepPlan

BLOCK_SIZE = 16
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # the serving default (cuda_graph_max_batch 256)
WARMUP_STEPS = 3
TOP_KERNELS = 20
MODULE_PACKAGES = ("services.model", "expert_svc")
# --exchanges of a run of several ranks: exchange.symmetric's modes, or NCCL's collectives.
EXCHANGES = ("pull", "push", "signals", "collectives")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--batch-sizes", default="256,128,1")
    p.add_argument("--context", default="1024:2048", help="cached context per sequence, drawn from lo:hi")
    p.add_argument("--steps", type=int, default=30, help="timed decode steps per variant and batch size")
    p.add_argument("--variants", default="", help="name=module.attr:value,...;... (base always runs first); "
                   "module: a dotted path under services.model or else expert_svc, e.g. "
                   "kernels.rotary.QKV_ONE_TOKEN_STEPS:64")
    p.add_argument("--profile", action="store_true", help="top kernels of one eager step per variant")
    p.add_argument("--rounds", type=int, default=1, help="times each variant runs, interleaved with the "
                   "others (the GPU drifts over a run: base first and once would favour it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-dtype", default="auto", help="the KV pool's type: auto (bf16) or fp8_e4m3")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--ranks", type=int, default=1, help="expert-parallel ranks, one GPU each (--batch-sizes "
                   "are then totals over them)")
    p.add_argument("--exchanges", default="", help=f"with --ranks > 1: comma list of {', '.join(EXCHANGES)} "
                   "(default: pull on CUDA, the expert service's; collectives on the CPU)")
    p.add_argument("--baseline", default="", help="a one-rank run's decode_variants.json at the same batch "
                   "sizes: each row's speed-up over its base step")
    args = p.parse_args(argv)
    args.attention = "triton" if args.device == "cuda" else "torch"
    return args


def parse_exchanges(args) -> list[str]:
    """--exchanges as a list: [""] (none) with one rank; collectives only on the CPU."""
    if args.ranks < 1:
        raise ValueError(f"--ranks must be at least 1, got {args.ranks}")
    if args.ranks == 1:
        if args.exchanges:
            raise ValueError("--exchanges needs --ranks > 1")
        return [""]
    names = [n.strip() for n in args.exchanges.split(",") if n.strip()] or [
        "pull" if args.device == "cuda" else "collectives"]
    allowed = EXCHANGES if args.device == "cuda" else ("collectives",)
    if len(set(names)) != len(names) or not set(names) <= set(allowed):
        raise ValueError(f"--exchanges must be distinct names of {allowed} on {args.device}, got {args.exchanges!r}")
    return names


def load_baseline(path: str, batch_sizes: list[int]) -> dict[int, float]:
    """A one-rank run's base replay ms by batch size ({} without --baseline); ValueError if it
    is not one or lacks a batch size."""
    if not path:
        return {}
    report = json.loads(pathlib.Path(path).read_text())
    if report["args"].get("ranks", 1) != 1:
        raise ValueError(f"--baseline {path} is a run of {report['args']['ranks']} ranks, not one")
    base = {r["batch"]: r["replay_ms"] for r in report["rows"] if r["variant"] == "base" and "error" not in r}
    if missing := [b for b in batch_sizes if b not in base]:
        raise ValueError(f"--baseline {path} has no base row at batch {missing}")
    return base


def parse_context(text: str) -> tuple[int, int]:
    """"lo:hi" as (lo, hi), 1 <= lo <= hi."""
    lo, _, hi = text.partition(":")
    try:
        bounds = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"--context must be lo:hi, got {text!r}") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise ValueError(f"--context must have 1 <= lo <= hi, got {text!r}")
    return bounds


def parse_variants(text: str) -> dict[str, dict[str, object]]:
    """"name=module.attr:value,...;..." as {name: {"module.attr": value}}, "base": {} first.
    Values are Python literals (64, 0.5, True); each target must exist (ValueError)."""
    variants: dict[str, dict[str, object]] = {"base": {}}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        name, _, body = (s.strip() for s in item.partition("="))
        if not name or name in variants:
            raise ValueError(f"variant names must be new and non-empty ('base' is taken), got {name!r} in {text!r}")
        overrides = {}
        # a comma starts a new setting only before "module.attr:", so values may be tuples
        for pair in filter(None, (s.strip() for s in re.split(r",(?=\s*[A-Za-z_][\w.]*\s*:)", body))):
            target, _, value = (s.strip() for s in pair.partition(":"))
            try:
                overrides[target] = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                raise ValueError(f"variant {name!r}: {pair!r} is not module.attr:<Python literal>") from None
            resolve(target)
        variants[name] = overrides
    return variants


def resolve(target: str) -> tuple[object, str]:
    """"module.attr" as (module, attr): services.model.<module>, else expert_svc.<module>; the
    module a dotted path (kernels.rotary.QKV_ONE_TOKEN_STEPS: services.model.kernels.rotary)."""
    module_name, _, attr = target.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"a variant's setting must be module.attr, got {target!r}")
    for package in MODULE_PACKAGES:
        full = f"{package}.{module_name}"
        try:
            module = importlib.import_module(full)
        except ModuleNotFoundError as error:
            if full == error.name or full.startswith(f"{error.name}."):  # the module or a package above it
                continue
            raise
        if not hasattr(module, attr):
            raise ValueError(f"{full} has no attribute {attr!r} (in {target!r})")
        return module, attr
    raise ValueError(f"no module {module_name!r} under {' or '.join(MODULE_PACKAGES)} (in {target!r})")


@contextlib.contextmanager
def overridden(overrides: dict[str, object]):
    """Sets the module attributes for the block, then puts the originals back. A dict given
    to a dataclass attribute replaces those of its fields (MoeTiles, GemvTiles)."""
    originals = []
    try:
        for target, value in overrides.items():
            module, attr = resolve(target)
            original = getattr(module, attr)
            originals.append((module, attr, original))
            if isinstance(value, dict) and dataclasses.is_dataclass(original):
                value = dataclasses.replace(original, **value)
            setattr(module, attr, value)
        yield
    finally:
        for module, attr, value in reversed(originals):
            setattr(module, attr, value)


class ReplayTimer:
    """A DecodeGraphRunner capture whose replays log their duration: CUDA events around
    the graph's replay on the GPU, the host clock around the eager re-run on the CPU."""

    def __init__(self, device: torch.device):
        self.device, self._spans = device, []
        self._capture = cuda_capture(torch.cuda.graph_pool_handle()) if device.type == "cuda" else (lambda fn: fn)

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        replay = self._capture(fn)

        def timed() -> None:
            start = self._mark()
            replay()
            self._spans.append((start, self._mark()))
        return timed

    def _mark(self):
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def reset(self) -> None:
        self._spans.clear()

    def times_ms(self) -> list[float]:
        if self.device.type != "cuda":
            return [1e3 * (end - start) for start, end in self._spans]
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in self._spans]


@dataclasses.dataclass(frozen=True, slots=True)
class Workload:
    """One batch size's sequences, the same for every variant: sequence i has contexts[i]
    cached tokens in block_tables[i], enough for num_steps more."""

    contexts: tuple[int, ...]
    block_tables: tuple[tuple[int, ...], ...]
    num_steps: int  # StepRunner steps: the first (each sequence's token 7 + i), then decodes

    @classmethod
    def draw(cls, num_seqs: int, context: tuple[int, int], num_steps: int, seed: int) -> "Workload":
        g = torch.Generator().manual_seed(seed + num_seqs)
        contexts = torch.randint(context[0], context[1] + 1, (num_seqs,), generator=g).tolist()
        return cls.of(contexts, num_steps)

    @classmethod
    def of(cls, contexts: list[int], num_steps: int) -> "Workload":
        """These contexts, each in its own blocks from block 0 on."""
        tables, start = [], 0
        for c in contexts:
            num_blocks = -(-(c + num_steps) // BLOCK_SIZE)
            tables.append(tuple(range(start, start + num_blocks)))
            start += num_blocks
        return cls(tuple(contexts), tuple(tables), num_steps)

    def shard(self, rank: int, num_ranks: int) -> "Workload":
        """Rank `rank`'s equal share of the sequences (a contiguous slice), in its own KV pool."""
        per_rank = len(self.contexts) // num_ranks
        assert per_rank * num_ranks == len(self.contexts), f"{len(self.contexts)} sequences on {num_ranks} ranks"
        return Workload.of(list(self.contexts[rank * per_rank:(rank + 1) * per_rank]), self.num_steps)

    @property
    def num_blocks(self) -> int:
        return sum(map(len, self.block_tables))

    def first_step(self) -> list[SeqInput]:
        """The first step's inputs, as the graph runner takes them."""
        return [SeqInput(i, [7 + i], c, list(table), True)
                for i, (c, table) in enumerate(zip(self.contexts, self.block_tables, strict=True))]

    def plans(self) -> list[StepPlan]:
        """The first step introducing the sequences, then greedy decodes."""
        greedy, num_seqs = SamplingSpec(temperature=0.0), len(self.contexts)
        pairs = enumerate(zip(self.contexts, self.block_tables, strict=True))
        new = tuple(NewSequence(i, greedy, table, c) for i, (c, table) in pairs)
        first = StepPlan(1, "", 0, new_sequences=new, max_tokens_per_rank=num_seqs,
                         scheduled=tuple(ScheduledSequence(i, (7 + i,)) for i in range(num_seqs)))
        decode = tuple(ScheduledSequence(i) for i in range(num_seqs))
        return [first] + [StepPlan(s, "", 0, scheduled=decode, max_tokens_per_rank=num_seqs)
                          for s in range(2, self.num_steps + 1)]


def noise_pool(config, num_blocks: int, device: torch.device, cache_dtype: str = "auto") -> KVPool:
    """A KV pool of standard-normal noise in the cache type (kv_pool.kv_cache_dtype's names)."""
    kv = KVPool.for_model(config, num_blocks, BLOCK_SIZE, kv_cache_dtype(cache_dtype, torch.bfloat16), device)
    for cache in (kv.k_cache, kv.v_cache):
        for layer_cache in cache:  # a layer at a time: a bf16 draw of the whole cache would not fit beside it
            layer_cache.copy_(torch.randn(layer_cache.shape, dtype=torch.bfloat16, device=device))
    return kv


def graph_width(config) -> int:
    """Block-table columns of the graphs: the serving default (the model's context length)."""
    return -(-config.max_position_embeddings // BLOCK_SIZE)


def run_variant(model, config, kv: KVPool, workload: Workload, device: torch.device) -> tuple[dict, torch.Tensor]:
    """One variant at one batch size, its settings in force: (timings, the first step's replayed logits)."""
    timer = ReplayTimer(device)
    graphs = DecodeGraphRunner(model, kv, BLOCK_SIZE, buckets=BUCKETS, max_blocks=graph_width(config),
                               capture=timer.capture,
                               pad_to_capacity=model.comm.world_size > 1 and gathers_on(device))
    seqs = workload.first_step()
    capacity = model.dispatch_capacity(len(seqs))
    for _ in range(2):  # eager (warm-up), then capture + replay
        logits_SV = graphs.run(seqs, capacity).logits_SV
    logits_SV = logits_SV.clone()
    runner = StepRunner(model, kv, BLOCK_SIZE, vocab_size=config.vocab_size, device=device, graphs=graphs)
    wall_s = []
    for i, plan in enumerate(workload.plans()):
        if i == WARMUP_STEPS:
            timer.reset()
        start = time.perf_counter()
        runner.run_step(plan)
        if i >= WARMUP_STEPS:
            wall_s.append(time.perf_counter() - start)
    replay_ms = timer.times_ms()
    assert len(replay_ms) == len(wall_s), f"{len(replay_ms)} replays in {len(wall_s)} timed steps"
    return {"bucket": graphs.bucket(len(seqs)), "replay_ms": statistics.median(replay_ms),
            "replay_min_ms": min(replay_ms), "wall_ms": 1e3 * statistics.median(wall_s),
            "wall_min_ms": 1e3 * min(wall_s),
            "graph_counts": [graphs.num_eager, graphs.num_captures, graphs.num_replays]}, logits_SV


def compare(logits_SV: torch.Tensor, base_SV: torch.Tensor) -> dict:
    """Against base's logits: the largest difference, and the median row's, over the largest logit.
    A few rows far off and the median near 0: routing flips (a near-tie of the top-k experts)."""
    row_diff_S, scale = (logits_SV - base_SV).abs().amax(-1), base_SV.abs().max().item() or 1.0
    return {"max_abs_diff": row_diff_S.max().item(), "max_abs_logit": scale,
            "rel_diff": row_diff_S.max().item() / scale, "median_row_rel_diff": row_diff_S.median().item() / scale,
            "argmax_agree": (logits_SV.argmax(-1) == base_SV.argmax(-1)).float().mean().item()}


def top_kernels(model, kv: KVPool, workload: Workload, device: torch.device) -> list[dict]:
    """The TOP_KERNELS kernels by CUDA time of one eager first step (after an unprofiled one);
    on the CPU the ops by self CPU time."""
    seqs = workload.first_step()
    batch, capacity = build_forward_batch(seqs, BLOCK_SIZE, device), model.dispatch_capacity(len(seqs))
    model.forward_at_capacity(batch, kv, capacity)
    return kernel_profile.top_kernels(lambda: model.forward_at_capacity(batch, kv, capacity), device, TOP_KERNELS)


def _release(device: torch.device) -> None:
    """Frees the dropped graphs' memory pools before the next capture."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclasses.dataclass(frozen=True, slots=True)
class Place:
    """This process in a run: rank `rank` of `num_ranks`, and the exchanges its model's
    comm takes in turn (name -> exchange.symmetric.SymmetricExchange, or None: collectives;
    one rank: {"": None})."""

    rank: int
    num_ranks: int
    exchanges: dict

    def gather(self, value) -> list:
        """Every rank's value, in rank order."""
        if self.num_ranks == 1:
            return [value]
        everyone = [None] * self.num_ranks
        dist.all_gather_object(everyone, value)
        return everyone

    def label(self, variant: str, exchange: str, rank: int) -> str:
        """A profile's name: the variant, its exchange and its rank where a run has several."""
        return variant + (f" / {exchange}" if exchange else "") + (f", rank {rank}" if self.num_ranks > 1 else "")


def run_batch(model, config, num_seqs: int, variants: dict, args, result: dict, profile: bool,
              place: Place) -> None:
    """Every variant (under every exchange) at one batch size on one KV pool (a variant's first
    step reads only the noise of the cached contexts; later steps read what that variant
    wrote), --rounds times in turn; a variant's times are the median over its rounds of each
    round's median, each round's the slower rank's. Rank 0 keeps the rows."""
    device = torch.device(args.device)
    workload = Workload.draw(num_seqs, parse_context(args.context), WARMUP_STEPS + args.steps, args.seed)
    workload = workload.shard(place.rank, place.num_ranks)
    kv = noise_pool(config, workload.num_blocks, device, args.kv_cache_dtype)
    keys = [(name, exchange) for name in variants for exchange in place.exchanges]
    runs = {key: [] for key in keys}
    rows = {key: {"variant": key[0], "batch": num_seqs} | ({"exchange": key[1]} if key[1] else {}) for key in keys}
    base_SV = None
    for round_ in range(args.rounds):
        for name, exchange in keys:
            row = rows[name, exchange]
            if "error" in row:
                continue
            model.comm.exchange = place.exchanges[exchange]
            try:
                with overridden(variants[name]):
                    timings, logits_SV = run_variant(model, config, kv, workload, device)
                    if profile and not round_:
                        for rank, kernels in enumerate(place.gather(top_kernels(model, kv, workload, device))):
                            result["profiles"][place.label(name, exchange, rank)] = kernels
            except Exception as error:  # a setting that fails to compile or capture: reported, unless base's
                if base_SV is None or place.num_ranks > 1:  # (the other ranks would wait in a collective)
                    raise
                row["error"] = repr(error)[:300]
            else:
                runs[name, exchange].append(slower_rank(place.gather(timings)))
                if base_SV is None:
                    base_SV = logits_SV
                if not round_:
                    row |= worst_rank(place.gather(compare(logits_SV, base_SV)))
                del logits_SV
            if place.rank == 0:
                print(json.dumps(row | {"round": round_} | (runs[name, exchange][-1] if runs[name, exchange] else {})),
                      flush=True)
            _release(device)
    base = _over_rounds(runs[keys[0]])
    one_rank_ms = result["baseline_ms"].get(num_seqs)
    for key in keys:
        row = rows[key]
        if "error" not in row:
            row |= _over_rounds(runs[key])
            row |= {"speedup_replay": base["replay_ms"] / row["replay_ms"],
                    "speedup_wall": base["wall_ms"] / row["wall_ms"]}
            if one_rank_ms:
                row["vs_one_rank"] = one_rank_ms / row["replay_ms"]
        result["rows"].append(row)


def slower_rank(timings: list[dict]) -> dict:
    """One run's timings over the ranks: the slower rank's, and each rank's replay median."""
    return timings[0] | {key: max(t[key] for t in timings) for key in ("replay_ms", "replay_min_ms", "wall_ms",
                                                                      "wall_min_ms")} | {
        "replay_ms_by_rank": [round(t["replay_ms"], 3) for t in timings]}


def worst_rank(comparisons: list[dict]) -> dict:
    """compare()'s results over the ranks: the largest differences, the mean argmax agreement
    (every rank has as many rows)."""
    worst = {key: max(c[key] for c in comparisons) for key in comparisons[0] if key != "argmax_agree"}
    return worst | {"argmax_agree": statistics.fmean(c["argmax_agree"] for c in comparisons)}


def _over_rounds(runs: list[dict]) -> dict:
    """One variant's timings over its rounds: medians of the rounds' medians, the least minimum,
    each round's replay median (and each rank's, in the median round's order)."""
    return {"bucket": runs[0]["bucket"], "graph_counts": runs[0]["graph_counts"],
            "replay_ms": statistics.median(r["replay_ms"] for r in runs),
            "replay_min_ms": min(r["replay_min_ms"] for r in runs),
            "wall_ms": statistics.median(r["wall_ms"] for r in runs),
            "wall_min_ms": min(r["wall_min_ms"] for r in runs),
            "replay_ms_by_round": [round(r["replay_ms"], 3) for r in runs],
            "replay_ms_by_rank": [statistics.median(ms) for ms in zip(*(r["replay_ms_by_rank"] for r in runs))]}


def parse_batch_sizes(text: str, num_ranks: int = 1) -> list[int]:
    """--batch-sizes: totals over the ranks, each an equal share per rank within the graph buckets."""
    sizes = [int(b) for b in text.split(",")]
    if not all(b % num_ranks == 0 and 1 <= b // num_ranks <= BUCKETS[-1] for b in sizes):
        raise ValueError(f"--batch-sizes must be {num_ranks} x 1..{BUCKETS[-1]} (the graph buckets on each of "
                         f"{num_ranks} rank(s)), got {text!r}")
    return sizes


def build_rank(args, place_rank: int, exchange_names: list[str]) -> tuple:
    """(config, model, place) of this rank: one rank, bench.kernels.decode_graph_check's build;
    several, the rank's experts and their exchanges in the default process group."""
    if args.ranks == 1:
        config, model = build(args)
        return config, model, Place(0, 1, {"": None})
    config = dataclasses.replace(preset(args.preset), num_hidden_layers=args.layers)
    device = torch.device(args.device)
    experts = local_expert_ids(config.num_experts, place_rank, args.ranks)
    weights = RandomWeights(config, experts, args.seed, dtype=torch.bfloat16, device=device)
    model = Qwen3MoeModel(config, weights, expert_ids=experts, comm=ExpertComm(dist.group.WORLD),
                          dtype=torch.bfloat16, device=device, attention=args.attention)
    exchanges = {name: None if name == "collectives" else _symmetric_exchange(model, name)
                 for name in exchange_names}
    return config, model, Place(place_rank, args.ranks, exchanges)


def _symmetric_exchange(model, name: str):
    """The expert service's exchange (expert_svc.model_builder) in mode `name` (pull, push or signals):
    buffers for the decode buckets."""
    from services.model.exchange.symmetric import SymmetricExchange  # triton: CUDA only
    from services.model.kernels.moe_ep import row_width

    c = model.config
    return SymmetricExchange(dist.group.WORLD, max(model.max_fixed_capacity_tokens, BUCKETS[-1]),
                             row_width(c.hidden_size, c.num_experts_per_tok, model.dtype), c.hidden_size,
                             model.dtype, model.device, push=name != "pull", signals=name == "signals")


def run_rank(rank: int, args, variants: dict, batch_sizes: list[int], exchanges: list[str], result: dict) -> None:
    """This rank's part of the run; rank 0 writes the report."""
    start = time.perf_counter()
    torch.manual_seed(args.seed)
    config, model, place = build_rank(args, rank, exchanges)
    if args.device == "cuda" and args.attention != "triton":
        raise SystemExit("decode graphs need the triton attention backend")
    if rank == 0:
        print(f"model built in {time.perf_counter() - start:.1f}s: {args.layers} layers, attention "
              f"{args.attention}, {args.ranks} rank(s)", flush=True)
    for num_seqs in batch_sizes:
        run_batch(model, config, num_seqs, variants, args, result, args.profile and num_seqs == max(batch_sizes),
                  place)
    if rank:
        return
    result["wall_s"] = time.perf_counter() - start
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_variants.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "decode_variants.md").write_text(markdown(result))
    print(markdown(result), flush=True)


def _worker(rank: int, args, variants: dict, batch_sizes: list[int], exchanges: list[str], result: dict,
            port: int) -> None:
    """One rank of a run of several (torch.multiprocessing.spawn)."""
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        args.device = f"cuda:{rank}"
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo", rank=rank, world_size=args.ranks,
                            init_method=f"tcp://127.0.0.1:{port}", timeout=datetime.timedelta(minutes=10))
    try:
        run_rank(rank, args, variants, batch_sizes, exchanges, result)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    exchanges = parse_exchanges(args)
    variants, batch_sizes = parse_variants(args.variants), parse_batch_sizes(args.batch_sizes, args.ranks)
    baseline_ms = load_baseline(args.baseline, batch_sizes)
    max_positions = preset(args.preset).max_position_embeddings
    if args.steps < 1 or parse_context(args.context)[1] + WARMUP_STEPS + args.steps > max_positions:
        raise ValueError(f"--steps {args.steps} must be positive, and with --context {args.context} and "
                         f"{WARMUP_STEPS} warm-up steps fit the model's {max_positions} positions")
    if args.ranks > 1 and args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        raise ValueError(f"--ranks {args.ranks} needs as many GPUs, this machine has {torch.cuda.device_count()}")
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    env = {"torch": torch.__version__, "triton": _version("triton"), "gpu": gpu, "cuda": torch.version.cuda}
    result = {"command": "python -m bench.kernels.decode_variants " + shlex.join(argv), "env": env, "args": vars(args),
              "variants": variants, "baseline_ms": baseline_ms, "rows": [], "profiles": {}}
    if args.ranks == 1:
        run_rank(0, args, variants, batch_sizes, exchanges, result)
    else:
        torch.multiprocessing.spawn(_worker, args=(args, variants, batch_sizes, exchanges, result, _free_port()),
                                    nprocs=args.ranks)
    return 0


def _version(package: str) -> str | None:
    try:
        return importlib.import_module(package).__version__
    except ImportError:
        return None


def markdown(result: dict) -> str:
    args, env = result["args"], result["env"]
    ranks, one_rank = args.get("ranks", 1), bool(result.get("baseline_ms"))
    replay = "CUDA events" if args["device"].startswith("cuda") else "host clock of the eager re-run"
    setup = (f"{ranks} ranks (one GPU each; experts split evenly, each rank decoding its share of the batch; "
             "times of the slower rank)" if ranks > 1 else "one rank")
    lines = [f"# Decode step variants: graph replays under kernel settings ({env['gpu']})", "",
             f"Command: `{result['command']}`", "", f"Environment: {json.dumps(env)}", "",
             (f"Model: {args['preset']} shape, {args['layers']} layers, bf16, random weights; attention "
              f"`{args['attention']}`; {setup}; contexts {args['context']} cached tokens (KV pool of noise, "
              f"{args['kv_cache_dtype']}); "
              f"{WARMUP_STEPS} warm-up then {args['steps']} timed decode steps, medians; "
              f"{args['rounds']} round(s), the variants in turn, the median round."), "",
             "Variants: " + "; ".join(f"`{name}` {overrides or '(no change)'}"
                                      for name, overrides in result["variants"].items()), ""]
    if one_rank:
        lines += [f"vs one rank: the one-rank base step of the same batch (`--baseline {args['baseline']}`: "
                  + ", ".join(f"batch {b}: {ms:.3f} ms" for b, ms in result["baseline_ms"].items())
                  + ") over this row's: the speed-up of the graph-replayed step over one GPU.", ""]
    columns = ["variant"] + (["exchange"] if ranks > 1 else []) + ["batch", f"graph replay ms ({replay})", "by round"]
    columns += (["by rank"] if ranks > 1 else []) + ["step wall ms", "speed-up vs base (replay)",
                                                     "speed-up vs base (wall)"]
    columns += (["vs one rank"] if one_rank else []) + ["logit diff / largest", "median row's", "argmax agree"]
    text_columns = {"variant", "exchange", "by round", "by rank"}
    lines += ["| " + " | ".join(columns) + " |",
              "|" + "|".join("---" if c in text_columns else "---:" for c in columns) + "|"]
    for r in result["rows"]:
        cells = [r["variant"]] + ([r.get("exchange", "")] if ranks > 1 else []) + [str(r["batch"])]
        if "error" in r:
            lines.append("| " + " | ".join(cells + [f"error: {r['error']}"] + [""] * (len(columns) - len(cells) - 1))
                         + " |")
            continue
        cells += [f"{r['replay_ms']:.3f}", " / ".join(f"{ms:.2f}" for ms in r["replay_ms_by_round"])]
        cells += [" / ".join(f"{ms:.2f}" for ms in r["replay_ms_by_rank"])] if ranks > 1 else []
        cells += [f"{r['wall_ms']:.3f}", f"{r['speedup_replay']:.3f}x", f"{r['speedup_wall']:.3f}x"]
        cells += [f"{r['vs_one_rank']:.3f}x"] if one_rank else []
        cells += [f"{r['rel_diff']:.3g}", f"{r['median_row_rel_diff']:.3g}", f"{100 * r['argmax_agree']:.1f}%"]
        lines.append("| " + " | ".join(cells) + " |")
    for name, kernels in result["profiles"].items():
        unit = "CUDA" if args["device"].startswith("cuda") else "self CPU"
        lines += ["", f"## Top kernels of one eager step, {name} ({unit} time)", "",
                  "| kernel | calls | total us | us per call |", "|---|---:|---:|---:|"]
        lines += [f"| `{k['name'][:100]}` | {k['calls']} | {k['total_us']:.1f} | {k['us_per_call']:.2f} |"
                  for k in kernels]
    lines += ["", f"Wall time {result['wall_s']:.0f} s", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

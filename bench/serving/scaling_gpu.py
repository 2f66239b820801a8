"""Decode step time of a skewed model on two ranks, before and after rebalancing its experts.

    python3 -m bench.serving.scaling_gpu --out bench/results                # 2 GPUs, NCCL, bf16 (the issue-6 run)
    python3 -m bench.serving.scaling_gpu --device cpu --tiny --out DIR      # 2 CPU processes, gloo (CI smoke)

Self-contained: two processes from torch.multiprocessing run the library's
model code (services.model) directly; no gRPC, no etcd. Each rank draws its
experts with services.model.random_weights (Qwen3-30B-A3B shapes by default,
`--layers` of them), plus `--spares` empty spare slots per MoE layer. The
gate is skewed through a constant hidden feature: dimension 0 of every
embedding is set to 1 and every gate reads it with weight +bias for the
`--hot` experts 0..hot-1 (all on rank 0) and -bias for the rest; nothing
else changes, so a replica drawn from the generator equals its primary.

1. Warm-up decode steps at `--batch` sequences (half per rank, each with
   `--context` tokens of KV) count the hits per expert (model.hit_counts_LE).
2. Before: the median decode step time (the slower rank's), no replicas.
3. The router's rebalance (router_svc/policy.py, greedy bin packing of the
   hottest experts into the spares) plans a placement from those counts;
   each rank draws its replicas from the same generator and installs them
   (expert_svc/placement.apply_placement: in place, as a serving rank does).
4. After: the same timing. The logits of one step before and after are
   compared (bit-identical on the CPU; bf16 GEMMs may round differently for
   other row counts on a GPU, so there the argmax agreement is reported).

The max/mean rank load comes from the measured hit counts, each expert's
hits spread over its replicas (what the dispatch does). Rank 0 writes
scaling_<device>[_tiny].json and .md under --out and prints the table.
"""

import argparse
import dataclasses
import datetime
import json
import pathlib
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from router_svc.policy import imbalance, rebalance
from services.kv_pool import KVPool
from services.model.attention import make_attention_backend
from services.model.batch import SeqInput, build_forward_batch
from services.model.expert_map import apply_placement, replica_tensor_names
from services.model.exchange.comm import ExpertComm
from services.model.moe_dispatch import local_expert_ids
from services.model.qwen3_moe import Qwen3MoeModel
from services.model.random_weights import RandomWeights, preset
from services.placement import Placement

WORLD_SIZE = 2
BLOCK_SIZE = 16


@dataclasses.dataclass(frozen=True)
class Settings:
    device: str = "cuda"
    tiny: bool = False
    layers: int = 48
    batch: int = 256  # sequences in the group, half per rank
    context: int = 256
    spares: int = 8
    hot: int = 8
    # Gate weight on the constant feature (about +-1.6 logits per 0.05 at Qwen3-30B-A3B's shapes).
    bias: float = 0.05
    max_replicas: int = 3
    warmup: int = 10
    iters: int = 30
    seed: int = 0
    cuda_graph: bool = True  # decode steps through the serving CUDA-graph runner (CUDA only)
    out: str = "bench/results"

    @property
    def name(self) -> str:
        return f"scaling_{self.device}" + ("_tiny" if self.tiny else "")


def model_config(s: Settings):
    if s.tiny:
        return preset("tiny")
    return dataclasses.replace(preset("qwen3-30b-a3b"), num_hidden_layers=s.layers)


def _skew(model: Qwen3MoeModel, hot: int, bias: float) -> None:
    """Experts 0..hot-1 hot through a constant feature in dimension 0 (see the module doc)."""
    model.embed_VD[:, 0] = 1.0
    for i in model.config.moe_layers:
        w_gate_ED = model.layers[i].feed_forward.w_gate_ED
        w_gate_ED[:, 0] = -bias
        w_gate_ED[:hot, 0] = bias


def _decode_seqs(s: Settings, rank: int, config) -> list[SeqInput]:
    """Half the batch: one new token per sequence after `context` tokens of KV."""
    blocks_per_seq = -(-(s.context + 1) // BLOCK_SIZE)
    g = torch.Generator().manual_seed(s.seed + rank)
    return [SeqInput(i, [int(torch.randint(config.vocab_size, (1,), generator=g))], s.context,
                     list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)), True)
            for i in range(s.batch // WORLD_SIZE)]


def _stepper(model, kv, seqs: list[SeqInput], s: Settings, device):
    """(step() -> fp32 logits, how it runs): the serving decode path, through the rank's
    CUDA-graph runner (expert_svc/graph_runner.py) where it can capture, else eagerly.
    The replicas are installed in place, so one captured graph serves before and after."""
    capacity = model.dispatch_capacity(len(seqs))
    if device.type == "cuda" and s.cuda_graph:
        from expert_svc.graph_runner import make_graph_runner

        graphs = make_graph_runner(model, kv, BLOCK_SIZE, [len(seqs)], max_context=s.context + 1)
        if graphs is not None and graphs.fits(seqs, capacity):
            return (lambda: graphs.run(seqs, capacity).logits_SV), "CUDA graph"
    batch = build_forward_batch(seqs, BLOCK_SIZE, device)
    return (lambda: model.forward(batch, kv, max_tokens_per_rank=len(seqs))), "eager"


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_steps(step, s: Settings, device) -> list[float]:
    for _ in range(s.warmup):
        step()
    times = []
    for _ in range(s.iters):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


def worker(rank: int, s: Settings, init_file: str) -> None:
    device = torch.device(f"cuda:{rank}" if s.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # two processes on a small machine
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=WORLD_SIZE, timeout=datetime.timedelta(seconds=300))
    try:
        _run(rank, s, device)
    finally:
        dist.destroy_process_group()


def _run(rank: int, s: Settings, device) -> None:
    config, dtype = model_config(s), torch.bfloat16 if device.type == "cuda" else torch.float32
    expert_ids = local_expert_ids(config.num_experts, rank, WORLD_SIZE)
    start = time.perf_counter()
    try:
        make_attention_backend(attention := "triton" if device.type == "cuda" else "torch")
    except ValueError as error:  # no triton: the reference attention, eagerly
        print(f"rank {rank}: {error}; using the torch attention", flush=True)
        attention = "torch"
    model = Qwen3MoeModel(config, RandomWeights(config, expert_ids, s.seed, dtype=dtype, device=device),
                          expert_ids=expert_ids, comm=ExpertComm(dist.group.WORLD), dtype=dtype, device=device,
                          attention=attention, max_fixed_capacity_tokens=max(256, s.batch),
                          num_spare_expert_slots=s.spares)
    _skew(model, s.hot, s.bias)
    seqs = _decode_seqs(s, rank, config)
    kv = KVPool.for_model(config, sum(len(q.block_table) for q in seqs), BLOCK_SIZE, dtype, device)
    load_s = time.perf_counter() - start
    step, mode = _stepper(model, kv, seqs, s, device)

    model.hit_counts_LE.zero_()
    for _ in range(s.warmup):
        step()
    counts_LE = model.hit_counts_LE.clone()
    dist.all_reduce(counts_LE)
    counts = {layer: row for layer, row in zip(config.moe_layers, counts_LE.tolist())}
    before = _time_steps(step, s, device)
    logits_before = step().float().clone()

    empty = Placement(config.num_experts, WORLD_SIZE, s.spares)
    plan = rebalance(empty, counts, s.max_replicas)
    needed = sorted({e for changes in empty.loads_needed(plan, rank).values() for _, e in changes})
    replicas = RandomWeights(config, needed, s.seed, dtype=dtype, device=device)
    start = time.perf_counter()
    apply_placement(model, empty, plan, rank, {n: replicas[n] for n in replica_tensor_names(empty, plan, rank)})
    _sync(device)
    install_s = time.perf_counter() - start
    logits_after = step().float().clone()
    after = _time_steps(step, s, device)

    row = {"rank": rank, "mode": mode, "before_s": before, "after_s": after, "load_s": load_s, "install_s": install_s,
           "max_abs_logit_diff": float((logits_after - logits_before).abs().max()),
           "argmax_agreement": float((logits_after.argmax(-1) == logits_before.argmax(-1)).float().mean()),
           "is_bit_identical": bool(torch.equal(logits_after, logits_before))}
    rows = [None] * WORLD_SIZE
    dist.all_gather_object(rows, row)
    if rank == 0:
        _report(s, config, counts, empty, plan, rows)


def _layer_imbalance(placement: Placement, counts: dict) -> dict:
    values = [imbalance(placement.rank_loads(layer, c)) for layer, c in counts.items()]
    return {"mean": statistics.fmean(values), "max": max(values)}


def _report(s: Settings, config, counts: dict, empty: Placement, plan: Placement, rows: list[dict]) -> None:
    ms = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    before_ms = max(ms(r["before_s"]) for r in rows)
    after_ms = max(ms(r["after_s"]) for r in rows)
    total_hits = sum(sum(c) for c in counts.values())
    hot_share = sum(sum(c[:s.hot]) for c in counts.values()) / total_hits if total_hits else 0.0
    result = {
        "settings": dataclasses.asdict(s),
        "model": {"experts": config.num_experts, "top_k": config.num_experts_per_tok,
                  "hidden": config.hidden_size, "moe_intermediate": config.moe_intermediate_size,
                  "layers": config.num_hidden_layers, "moe_layers": len(config.moe_layers)},
        "environment": {"torch": torch.__version__,
                        "device": torch.cuda.get_device_name(0) if s.device == "cuda" else "cpu"},
        "hot_expert_hit_share": hot_share,
        "replicas_added": sum(n - 1 for layer in config.moe_layers for n in plan.num_replicas(layer)),
        "imbalance_before": _layer_imbalance(empty, counts),
        "imbalance_after": _layer_imbalance(plan, counts),
        "step_ms_before": before_ms, "step_ms_after": after_ms, "speedup": before_ms / after_ms,
        "ranks": [{k: v for k, v in r.items() if not k.endswith("_s") or k in ("load_s", "install_s")}
                  | {"before_ms_median": ms(r["before_s"]), "after_ms_median": ms(r["after_s"])} for r in rows],
    }
    lines = [
        f"# Expert rebalancing: decode step time, {s.device}{' (tiny)' if s.tiny else ''}",
        "",
        f"{result['environment']['device']}, torch {torch.__version__}; {config.num_hidden_layers} layers, "
        f"{config.num_experts} experts top-{config.num_experts_per_tok}, hidden {config.hidden_size}; "
        f"batch {s.batch} ({s.batch // WORLD_SIZE} per rank), context {s.context}; {s.spares} spare slots per "
        f"rank and layer; experts 0..{s.hot - 1} hot ({100 * hot_share:.1f}% of the hits); decode steps "
        f"{rows[0]['mode']}.",
        "",
        "| | max/mean rank load (mean over layers) | worst layer | decode step, median (slower rank) |",
        "|---|---|---|---|",
        f"| before | {result['imbalance_before']['mean']:.3f} | {result['imbalance_before']['max']:.3f} "
        f"| {before_ms:.2f} ms |",
        f"| after rebalance ({result['replicas_added']} replicas) | {result['imbalance_after']['mean']:.3f} "
        f"| {result['imbalance_after']['max']:.3f} | {after_ms:.2f} ms |",
        "",
        f"Speed-up {result['speedup']:.2f}x. Logits of one step before and after: max abs diff "
        f"{max(r['max_abs_logit_diff'] for r in rows):.3g}, argmax agreement "
        f"{min(r['argmax_agreement'] for r in rows):.3f}, bit-identical: "
        f"{all(r['is_bit_identical'] for r in rows)}. Installing the replicas took "
        f"{max(r['install_s'] for r in rows) * 1e3:.1f} ms.",
    ]
    report = "\n".join(lines) + "\n"
    out = pathlib.Path(s.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{s.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{s.name}.md").write_text(report)
    print(report, flush=True)


def parse_args(argv=None) -> Settings:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="the tiny test model, a small batch (CPU smoke test)")
    p.add_argument("--out", default=Settings.out)
    for field in ("layers", "batch", "context", "spares", "hot", "warmup", "iters", "seed", "max_replicas"):
        p.add_argument(f"--{field.replace('_', '-')}", type=int)
    p.add_argument("--bias", type=float)
    p.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false", default=None,
                   help="run the decode steps eagerly on CUDA too")
    args = vars(p.parse_args(argv))
    if args["tiny"]:
        defaults = dict(batch=8, context=16, spares=2, hot=2, bias=3.0, warmup=2, iters=3)
        args = {**defaults, **{k: v for k, v in args.items() if v is not None}}
    return Settings(**{k: v for k, v in args.items() if v is not None})


def main(argv=None) -> None:
    settings = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(worker, args=(settings, f"{tmp}/rendezvous"), nprocs=WORLD_SIZE)


if __name__ == "__main__":
    main()

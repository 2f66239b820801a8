"""GPU speed of the whole mesh on random weights of a released shape (issue 8).

    source bench/gpu_env.sh && python -m bench.serving.gpu_speed --kind nvidia-h200 \\
        --cases b1,c8,c64,c256,mix,hf,profile --output-scale 0.25
    python -m bench.serving.gpu_speed --kind nvidia-h200-x2 --ranks 2 --cases c256,c512

Starts a mesh (moemesh.launcher.Mesh: etcd, schedulers, router, gateway, one
expert service per GPU started with `--random-weights PRESET`), drives it with
bench/serving/serve.py's client and bench/serving/workloads.py's requests, then stops it:

- `b1`: one 1K-in/1K-out request alone: decode tokens/s after the first token.
- `cN`: 1K-in/1K-out at concurrency N (N x --waves requests): output tokens/s,
  TTFT and ITL p50/p99.
- `mix`: the production mix (4K/32, 2K/128, 8K/16) at --mix-concurrency:
  requests/s and p99 latency.

Then, each in its own process once the mesh is gone: `hf`, transformers'
`generate` on the same weights (the preset's random values, the same seed as
the mesh's, copied into transformers' model) at batch 1 and 64; `profile`, one eager decode
step of the serving model (services/model/qwen3_moe.py, no gateway) at batch
1 and 256, timed with CUDA events and profiled with torch.profiler.

Every figure also appears as a share of the HBM bound: the bytes of weights a
decode step reads (the dense part, plus the experts that B tokens of top-K
routing touch, E * (1 - (1 - K/E)^B) per layer if routing is uniform) over
4.25 TB/s, the copy rate measured on the H200; a second bound adds the KV
cache the step reads (every sequence at the case's mean context). Each case
also reads the ranks' and the gateway's /metrics before and after, to say
where the time went: steps run, the mean step time the ranks report
(plan in, tokens out) and how much of the wall time the ranks were busy.
Results: bench/results/gpu_speed_<kind>.md and .json (with the command).
"""

import argparse
import asyncio
import dataclasses
import json
import pathlib
import subprocess
import sys
import tempfile
import time

from bench.serving.serve import RESULTS_DIR, print_role_logs, role_metrics, run_load, summarize, write_result
from bench.serving.workloads import make_workload

HBM_BYTES_PER_S = 4.25e12
BYTES_PER_ELEMENT = 2  # bf16
HF_BASELINE_BATCHES = (1, 64)
PROFILE_BATCHES = (1, 256)
PROFILE_CONTEXT = 1024
# The prefill step profiled: this many prompts of PROFILE_CHUNK new tokens each (the
# gateway's default chunk; 8 x 512 = 4096 tokens).
PROFILE_PREFILL_SEQS, PROFILE_CHUNK = 8, 512


def weight_bytes_per_step(config, batch: int) -> float:
    """Bytes of weights one decode step of `batch` tokens reads (uniform routing)."""
    from services.model.checkpoint import expected_tensors

    shapes = expected_tensors(config, [])  # the trunk and gates, no expert
    dense = sum(_numel(s) for n, s in shapes.items() if n != "model.embed_tokens.weight")
    per_expert = 3 * config.moe_intermediate_size * config.hidden_size
    e, k = config.num_experts, config.num_experts_per_tok
    touched = e * (1 - (1 - k / e) ** batch)
    rows = batch * config.hidden_size  # the embedding rows looked up
    return BYTES_PER_ELEMENT * (dense + rows + len(config.moe_layers) * touched * per_expert)


def kv_bytes_per_token(config, element_bytes: int = BYTES_PER_ELEMENT) -> int:
    """Bytes of K and V one token of context holds (every layer)."""
    return element_bytes * 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim


def kv_cache_dtype(expert_args: list[str]) -> str:
    """The --kv-cache-dtype the expert services were given ("auto" if none)."""
    for i, arg in enumerate(expert_args):
        if arg.startswith("--kv-cache-dtype="):
            return arg.split("=", 1)[1]
        if arg == "--kv-cache-dtype" and i + 1 < len(expert_args):
            return expert_args[i + 1]
    return "auto"


def sampling_params(text: str) -> tuple[float, float]:
    """--sampling "TEMPERATURE,TOP_P" as floats; ValueError for anything else."""
    temperature, top_p = (float(v) for v in text.split(","))
    if temperature <= 0 or not 0 < top_p <= 1:
        raise ValueError(f"--sampling wants a temperature > 0 and top_p in (0, 1], got {text!r}")
    return temperature, top_p


def bound(config, batch: int, num_ranks: int = 1, context: int = 0, kv_element_bytes: int = BYTES_PER_ELEMENT) -> dict:
    """The HBM bound of a decode step of `batch` sequences over num_ranks GPUs
    (each reads the dense weights and its share of the experts); with a
    context, also the bound that adds each GPU's share of the KV reads."""
    from services.model.checkpoint import expected_tensors

    dense = sum(_numel(s) for n, s in expected_tensors(config, []).items() if n != "model.embed_tokens.weight")
    total = weight_bytes_per_step(config, batch)
    per_gpu = BYTES_PER_ELEMENT * dense + (total - BYTES_PER_ELEMENT * dense) / num_ranks
    step_s = per_gpu / HBM_BYTES_PER_S
    kv_s = batch * context * kv_bytes_per_token(config, kv_element_bytes) / num_ranks / HBM_BYTES_PER_S
    return {"weight_gb_per_step": round(total / 1e9, 2), "step_ms": round(1e3 * step_s, 3),
            "tokens_per_s": round(batch / step_s, 1), "step_ms_with_kv": round(1e3 * (step_s + kv_s), 3),
            "tokens_per_s_with_kv": round(batch / (step_s + kv_s), 1)}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# An expert's step-time histograms, by the name step_attribution gives their means
# (device_prefill_ms, launch_decode_ms, launch_cpu_prefill_ms, gap_prefill_ms, ...), each by kind.
STEP_TIMES = {"moemesh_expert_step_device_seconds": "device", "moemesh_expert_step_launch_seconds": "launch",
              "moemesh_expert_step_device_gap_seconds": "gap", "moemesh_expert_step_launch_cpu_seconds": "launch_cpu"}
TIMINGS = tuple((name, kind) for name in STEP_TIMES.values() for kind in ("prefill", "decode"))
# An expert's CUDA allocator counters (expert_svc/observability.py), by the name step_attribution gives their
# differences: a retry synchronizes the device, a cudaMalloc takes host time inside a step.
ALLOCATOR = {"moemesh_expert_cuda_alloc_retries": "alloc_retries", "moemesh_expert_cuda_mallocs": "cuda_mallocs"}


def scrape_steps(metrics: dict[str, str]) -> dict[str, tuple[float, ...]]:
    """Per role, from its /metrics: (sum of seconds, count) of its step-duration histogram, then
    (sum of seconds, count) of its garbage-collector pauses, then the same of its full collections,
    then the prompt tokens served from the prefix cache and those looked up (a gateway's), then
    (sum of seconds, count) of an expert's STEP_TIMES histograms, each for steps with prompt tokens
    and without (TIMINGS' order: device time and device gaps on CUDA, host launch time), then its
    ALLOCATOR counters (CUDA), then (sum of seconds, count) of a gateway's request queue times."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    names = {"moemesh_expert_step_duration_seconds", "moemesh_step_duration_seconds"}
    out = {}
    for role, address in metrics.items():
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
            text = response.read().decode()
        steps, gc_all, gc_full, prefix = (0.0, 0.0), [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]
        timings = {(name, kind): [0.0, 0.0] for name, kind in TIMINGS}
        allocator = dict.fromkeys(ALLOCATOR.values(), 0.0)
        queue = [0.0, 0.0]
        for family in text_string_to_metric_families(text):
            if family.name in names:
                values = {sample.name.rsplit("_", 1)[-1]: sample.value for sample in family.samples
                          if sample.name.endswith(("_sum", "_count"))}
                steps = (values.get("sum", 0.0), values.get("count", 0.0))
            elif family.name == "moemesh_gc_pause_seconds":
                for sample in family.samples:
                    if sample.name.endswith(("_sum", "_count")):
                        i = 0 if sample.name.endswith("_sum") else 1
                        gc_all[i] += sample.value
                        if sample.labels.get("generation") == "2":
                            gc_full[i] += sample.value
            elif family.name in STEP_TIMES:
                for sample in family.samples:
                    key = (STEP_TIMES[family.name], sample.labels.get("kind"))
                    if sample.name.endswith(("_sum", "_count")) and key in timings:
                        timings[key][0 if sample.name.endswith("_sum") else 1] += sample.value
            elif family.name == "moemesh_request_queue_time_seconds":
                for sample in family.samples:
                    if sample.name.endswith(("_sum", "_count")):
                        queue[0 if sample.name.endswith("_sum") else 1] += sample.value
            elif family.name in ALLOCATOR:
                allocator[ALLOCATOR[family.name]] += sum(x.value for x in family.samples if x.name.endswith("_total"))
            elif family.name in ("moemesh_prefix_cache_hit_tokens", "moemesh_prefix_cache_query_tokens"):
                prefix[0 if "hit" in family.name else 1] += sum(x.value for x in family.samples
                                                               if x.name.endswith("_total"))
        out[role] = (*steps, *gc_all, *gc_full, *prefix, *(v for key in TIMINGS for v in timings[key]),
                     *allocator.values(), *queue)
    return out


def step_attribution(before: dict, after: dict, wall_s: float) -> dict:
    """Per role: steps in the case, their mean ms, wall ms per step, and the share of wall time in them;
    where the scrapes have them, an expert's mean device, launch and device-gap ms of steps with and
    without prompt tokens, on CUDA its allocator's retries and cudaMallocs in the case, and a gateway's
    requests first scheduled in the case with their mean ms from queued to first scheduled."""
    out = {}
    for role, values in after.items():
        total, count, gc_s, _, full_s, full_count, hit_tokens, query_tokens, *device = (
            v - v0 for v, v0 in zip(values, before.get(role, (0.0,) * len(values))))
        out[role] = {"steps": int(count), "mean_step_ms": round(1e3 * total / count, 2) if count else None,
                     "wall_ms_per_step": round(1e3 * wall_s / count, 2) if count else None,
                     "busy_share": round(total / wall_s, 3) if wall_s else None,
                     "gc_ms": round(1e3 * gc_s, 1), "gc_full": int(full_count), "gc_full_ms": round(1e3 * full_s, 1)}
        if query_tokens:
            out[role]["prefix_hit_tokens"], out[role]["prefix_query_tokens"] = int(hit_tokens), int(query_tokens)
        num_timings = 2 * len(TIMINGS)
        timings, allocator = device[:num_timings], device[num_timings:num_timings + len(ALLOCATOR)]
        queue_s, queued = (device[num_timings + len(ALLOCATOR):] or [0.0, 0.0])[:2]
        if queued:
            out[role]["queued"], out[role]["queue_ms"] = int(queued), round(1e3 * queue_s / queued, 1)
        for (name, kind), seconds, steps in zip(TIMINGS, timings[::2], timings[1::2]):
            if steps:
                if name == "device":
                    out[role][f"device_{kind}_steps"] = int(steps)
                out[role][f"{name}_{kind}_ms"] = round(1e3 * seconds / steps, 2)
        if any(k.startswith("device_") for k in out[role]):  # a CUDA rank: its allocator's counts, zeros too
            out[role] |= {name: int(count) for name, count in zip(ALLOCATOR.values(), allocator)}
    return out


def _case_concurrency(case: str) -> int:
    return 1 if case == "b1" else int(case[1:])


async def warm_up(target: str, args, max_conc: int) -> None:
    """Every decode batch size up to max_conc (powers of two) once, then full-size prompts alone and
    8 at a time, so that CUDA-graph captures and Triton compiles happen before anything is measured."""
    load = argparse.Namespace(rate=0.0, seed=args.seed, request_timeout_s=args.request_timeout_s, concurrency=1)
    while load.concurrency <= max_conc:
        warm = make_workload("1k1k", load.concurrency, scale=16 / 1024, output_scale=4 / 1024, seed=args.seed + 1)
        await run_load(target, warm, load, f"warmup{load.concurrency}")
        load.concurrency *= 2
    # Full-size prompts once, alone and 8 at a time: the kernels of prefill steps of up to
    # --max-batch-tokens tokens compile (Triton, per tile config) before anything is measured.
    for concurrency in (1, 8):
        load.concurrency = concurrency
        warm = make_workload("1k1k", concurrency, scale=args.prompt_scale, output_scale=4 / 1024, seed=args.seed + 2)
        await run_load(target, warm, load, f"warmup-prefill{concurrency}")


async def _drive(target: str, args, cases: list[str], max_context: int, metrics: dict[str, str]) -> dict:
    load = argparse.Namespace(rate=0.0, seed=args.seed, request_timeout_s=args.request_timeout_s, concurrency=8)
    await warm_up(target, args, max(args.mix_concurrency if c == "mix" else _case_concurrency(c) for c in cases))
    out = {}
    for index, case in enumerate(cases):
        # Each case its own prompts: with one seed, case cN's first prompts were the earlier cases'
        # and hit the prefix cache (c256 after c64: 64 of its 256 prompts cached).
        seed = args.seed + 100 * (index + 1)
        if case == "mix":
            specs = make_workload("mix", args.mix_requests, scale=args.prompt_scale, seed=seed)
            load.concurrency = args.mix_concurrency
        else:
            load.concurrency = _case_concurrency(case)
            specs = make_workload("1k1k", load.concurrency * args.waves, scale=args.prompt_scale,
                                  output_scale=args.output_scale, seed=seed)
        if args.sampling:  # every request samples, each from its own seed
            temperature, top_p = sampling_params(args.sampling)
            specs = [dataclasses.replace(s, temperature=temperature, top_p=top_p, seed=seed + i)
                     for i, s in enumerate(specs)]
        assert max(len(s.prompt_ids) + s.max_new_tokens for s in specs) <= max_context
        before = await asyncio.to_thread(scrape_steps, metrics)
        results, duration_s = await run_load(target, specs, load, case)
        row = summarize(results, duration_s)
        row["steps"] = step_attribution(before, await asyncio.to_thread(scrape_steps, metrics), duration_s)
        row["concurrency"] = load.concurrency
        decoding = [r for r in results if r.error is None and r.first_token_s and r.num_output_tokens > 1]
        if decoding:
            row["decode_tokens_per_s_per_seq"] = round(sum(
                (r.num_output_tokens - 1) / (r.end_s - r.first_token_s) for r in decoding) / len(decoding), 2)
        out[case] = row
        print(f"{case}: {json.dumps(row)}", flush=True)
    return out


def run_mesh(args, cases: list[str], model_dir: pathlib.Path, drive=None) -> dict:
    """Starts the mesh on random weights, runs the serving cases, stops it. `drive(target, args,
    cases, max_context, metrics)`, a coroutine, replaces the cases' driver (bench/serving/goodput.py)."""
    from moemesh.launcher import Mesh, MeshSpec, tail
    from services.model.config import ModelConfig

    drive = drive or _drive
    max_conc = max([_case_concurrency(c) for c in cases if c != "mix"] + [args.mix_concurrency, 8])
    per_rank = max(1, -(-max_conc // args.ranks))
    extra = {"expert_svc": ["--random-weights", args.preset, *args.expert_arg],
             "gateway": ["--max-running-requests", str(per_rank),
                         "--max-batch-tokens", str(max(args.max_batch_tokens, per_rank)), *args.gateway_arg]}
    spec = MeshSpec(model_dir=str(model_dir), num_ranks=args.ranks, device=args.device, extra_args=extra,
                    ready_timeout_s=args.ready_timeout_s)
    mesh, start = Mesh(spec), time.perf_counter()
    try:
        mesh.start()
        startup_s = time.perf_counter() - start
        print(f"mesh serving after {startup_s:.1f} s", flush=True)
        max_context = ModelConfig.from_model_dir(model_dir).max_position_embeddings
        metrics = role_metrics(mesh)
        results = asyncio.run(drive(mesh.gateway_address, args, cases, max_context, metrics))
        logs = {r.name: tail(r.log_path, 12) for r in mesh.roles if r.name.startswith(("expert", "gateway"))}
        exchange = {r.name: _exchange_line(r.log_path) for r in mesh.roles if r.name.startswith("expert")}
        # A quantized preset's compute path and why (services/model/qwen3_moe.py logs it once per format).
        quant_paths = {r.name: _exchange_line(r.log_path, "quantized weights:") for r in mesh.roles
                       if r.name.startswith("expert")}
    except BaseException:
        print_role_logs(mesh)
        raise
    finally:
        mesh.stop()
    return {"startup_s": round(startup_s, 1), "cases": results, "log_tails": logs, "exchange": exchange,
            "quant_paths": {name: line for name, line in quant_paths.items() if line}}


def _exchange_line(log_path, marker: str = "expert exchange") -> str:
    """What an expert service last logged after `marker` (by default about its expert exchange,
    expert_svc/model_builder.py), if anything."""
    lines = [line for line in log_path.read_text(errors="replace").splitlines() if marker in line]
    return lines[-1].split(marker, 1)[1].strip(" :") if lines else ""


def hf_worker(args) -> dict:
    """transformers generate on the mesh's weights (the preset's random values, same seed), bf16, one GPU."""
    import torch
    import transformers

    from services.model.random_weights import RandomWeights, preset

    config = preset(args.preset)
    start, device = time.perf_counter(), args.device
    model = hf_model(config, RandomWeights(config, range(config.num_experts), args.seed, device=device),
                     torch.bfloat16, device)
    out = {"transformers": transformers.__version__, "init_s": round(time.perf_counter() - start, 1),
           "weights": f"random_weights {args.preset} seed {args.seed} (the mesh's)",
           "experts_implementation": str(getattr(model.config, "_experts_implementation", None))}
    gen = torch.Generator(device=device).manual_seed(args.seed)
    for batch in HF_BASELINE_BATCHES:
        ids = torch.randint(1000, 100000, (batch, args.hf_prompt_tokens), device=device, generator=gen)
        kwargs = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kwargs)  # warm-up
        _sync(device)
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=args.hf_new_tokens, min_new_tokens=args.hf_new_tokens, **kwargs)
        _sync(device)
        seconds = time.perf_counter() - start
        out[f"b{batch}"] = {"seconds": round(seconds, 2), "tokens_per_s": round(batch * args.hf_new_tokens / seconds, 1)}
        print(f"hf b{batch}: {out[f'b{batch}']}", flush=True)
    return out


def hf_model(config, weights, dtype, device, **implementations):
    """transformers' Qwen3-MoE of `config` on `device` in `dtype`, holding `weights` (hub names,
    every expert); implementations: from_config's attn_implementation / experts_implementation."""
    import torch
    import transformers

    hub = config.to_hub_dict()
    hf_config = transformers.AutoConfig.for_model(**{k: v for k, v in hub.items() if k != "model_type"},
                                                  model_type="qwen3_moe")
    with torch.device(device):  # its own init (0.9 s on an H200), then overwritten
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype, **implementations).eval()
    load_hub_weights(model, weights, config.num_experts)
    return model


def load_hub_weights(model, weights, num_experts: int) -> None:
    """Copies hub-named tensors (per-expert names, as on disk) into a transformers
    5 Qwen3-MoE model, which keeps each layer's experts fused in memory:
    experts.gate_up_proj [E, 2F, D] (gate rows, then up) and experts.down_proj [E, D, F]."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("experts.gate_up_proj"):
                prefix = name[:-len("gate_up_proj")]
                for e in range(num_experts):
                    param[e].copy_(torch.cat((weights[f"{prefix}{e}.gate_proj.weight"],
                                              weights[f"{prefix}{e}.up_proj.weight"])))
            elif name.endswith("experts.down_proj"):
                prefix = name[:-len("down_proj")]
                for e in range(num_experts):
                    param[e].copy_(weights[f"{prefix}{e}.down_proj.weight"])
            else:
                param.copy_(weights[name])


def profile_worker(args) -> dict:
    """One eager decode step of the serving model at each PROFILE_BATCHES size, and one
    prefill step of PROFILE_PREFILL_SEQS x PROFILE_CHUNK tokens, timed and profiled."""
    import torch

    from expert_svc.config import ExpertConfig
    from services.kv_pool import KVPool
    from services.model.batch import SeqInput, build_forward_batch
    from services.model.qwen3_moe import Qwen3MoeModel
    from services.model.random_weights import RandomWeights, preset

    config, block, device = preset(args.preset), 16, args.device
    start = time.perf_counter()
    attention = {f.name: f.default for f in dataclasses.fields(ExpertConfig)}.get("attention_backend", "torch")
    model = Qwen3MoeModel(config, RandomWeights(config, range(config.num_experts), args.seed, device=device),
                          expert_ids=range(config.num_experts), dtype=torch.bfloat16, device=device,
                          attention=attention)
    _sync(device)
    out = {"model_build_s": round(time.perf_counter() - start, 1),
           "attention": type(model.attention).__name__}
    per_seq = -(-(PROFILE_CONTEXT + 1) // block)
    kv = KVPool.for_model(config, per_seq * max(PROFILE_BATCHES), block, torch.bfloat16, device)
    prefill = [SeqInput(seq_id=i, token_ids=[1000 + i] * PROFILE_CHUNK, num_computed=0,
                        block_table=list(range(i * per_seq, (i + 1) * per_seq)), is_sampled=True)
               for i in range(PROFILE_PREFILL_SEQS)]
    for batch in (*PROFILE_BATCHES, "prefill"):
        seqs = prefill if batch == "prefill" else [
            SeqInput(seq_id=i, token_ids=[1000 + i], num_computed=PROFILE_CONTEXT,
                     block_table=list(range(i * per_seq, (i + 1) * per_seq)), is_sampled=True)
            for i in range(batch)]
        num_tokens = sum(len(s.token_ids) for s in seqs)
        fb = build_forward_batch(seqs, block, device)
        for _ in range(3):
            model.forward(fb, kv, max_tokens_per_rank=num_tokens)
        _sync(device)
        start = time.perf_counter()
        for _ in range(5):
            model.forward(fb, kv, max_tokens_per_rank=num_tokens)
        _sync(device)
        step_ms = (time.perf_counter() - start) * 200  # 5 steps, in ms
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device != "cpu":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            model.forward(fb, kv, max_tokens_per_rank=num_tokens)
            _sync(device)
        sort = "cuda_time_total" if device != "cpu" else "cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=14, max_name_column_width=48)
        key = batch if batch == "prefill" else f"b{batch}"
        out[key] = {"step_ms": round(step_ms, 3), "tokens": num_tokens, "profile": table}
        print(f"profile {key}: {step_ms:.3f} ms/step\n{table}", flush=True)
    return out


def _sync(device: str) -> None:
    import torch

    if device != "cpu":
        torch.cuda.synchronize()


def _in_subprocess(flag: str, argv: list[str], timeout_s: float) -> dict:
    """Runs a worker in a fresh process (the GPU memory of the last one is freed); its JSON result."""
    try:
        proc = subprocess.run([sys.executable, "-m", "bench.serving.gpu_speed", flag, *argv], stdout=subprocess.PIPE,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as error:
        print(error.stdout or "", flush=True)
        return {"error": f"still running after {timeout_s} s"}
    print(proc.stdout, end="", flush=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        return {"error": f"exit status {proc.returncode}"}
    return json.loads(lines[-1][len("RESULT "):])


def add_ratios(report: dict) -> None:
    """Puts each figure beside its HBM bound, and checks the issue's targets."""
    from services.model.random_weights import preset

    config, ranks, setup = preset(report["config"]["preset"]), report["config"]["ranks"], report["config"]
    cases = report.get("mesh", {}).get("cases", {})
    kv_dtype = kv_cache_dtype(setup.get("expert_arg", []))
    kv_element = 1 if kv_dtype == "fp8_e4m3" else BYTES_PER_ELEMENT
    for case, row in cases.items():
        if case == "mix":
            continue
        context = round(1024 * setup["prompt_scale"] + 512 * setup["output_scale"])
        b = bound(config, row["concurrency"], ranks, context, kv_element)
        row["bound"] = b
        row["kv_gb_per_step"] = round(row["concurrency"] * context * kv_bytes_per_token(config, kv_element) / 1e9, 2)
        measured = row.get("decode_tokens_per_s_per_seq", 0) if case == "b1" else row["output_tokens_per_s"]
        row["tokens_per_s_over_bound"] = round(measured / b["tokens_per_s"], 3)
        row["tokens_per_s_over_bound_with_kv"] = round(measured / b["tokens_per_s_with_kv"], 3)
        if row["itl_ms_p50"]:
            row["bound_ms_over_itl_p50"] = round(b["step_ms"] / row["itl_ms_p50"], 3)
    for batch in HF_BASELINE_BATCHES:
        hf = report.get("hf", {}).get(f"b{batch}")
        if hf:
            hf["tokens_per_s_over_bound"] = round(hf["tokens_per_s"] / bound(config, batch)["tokens_per_s"], 3)
    for batch in PROFILE_BATCHES:
        step = report.get("profile", {}).get(f"b{batch}")
        if step:
            step["bound_ms_over_step"] = round(bound(config, batch)["step_ms"] / step["step_ms"], 3)
    targets = {}
    if "b1" in cases:
        targets["batch-1 decode >= 50% of the bound"] = cases["b1"]["tokens_per_s_over_bound"] >= 0.5
    # A run off the issue's setting (a bf16 cache, greedy decoding) says so in its targets' names.
    setting_note = "" if kv_dtype == "auto" else f" (KV cache {kv_dtype})"
    if setup.get("sampling"):
        setting_note += f" (sampled: temperature, top_p {setup['sampling']})"
    if "c256" in cases and ranks == 1:
        targets[f"c256 >= 8,000 output tok/s on one H200{setting_note}"] = cases["c256"]["output_tokens_per_s"] >= 8000
    base = report.get("one_gpu_baseline") or {}
    for case in ("c256", "c512"):
        if ranks > 1 and case in cases and base.get(case):
            speedup = cases[case]["output_tokens_per_s"] / base[case]
            cases[case]["speedup_over_one_gpu"] = round(speedup, 2)
            targets[f"N={ranks} {case} >= 1.7x one GPU{setting_note}"] = speedup >= 1.7
    report["targets"] = targets


def markdown(report: dict) -> str:
    """The results page: setup, the serving table, the baseline, the profile, the targets."""
    cfg = report["config"]
    lines = [f"# GPU speed: {cfg['preset']} random weights, {cfg['kind']}, N={cfg['ranks']}", "",
             f"Command: `{report['command']}`", "", f"Date: {report['date']}", "",
             f"Setup: {json.dumps(report.get('setup', {}))}", ""]
    mesh = report.get("mesh", {})
    if mesh.get("error"):
        lines += [f"The mesh run failed: `{mesh['error']}`", ""]
    if mesh.get("cases"):
        exchange = {name: line for name, line in mesh.get("exchange", {}).items() if line}
        if exchange:
            lines += [f"Expert exchange (the expert logs): {json.dumps(exchange)}", ""]
        lines += [f"Mesh startup (random weights drawn on the GPU, to gateway SERVING): {mesh.get('startup_s')} s", "",
                  "| case | conc | ok/sent | req/s | out tok/s | decode tok/s/seq | TTFT p50/p99 ms | "
                  "ITL p50/p99 ms | E2E p99 ms | bound tok/s (weights) | share of bound | "
                  "bound tok/s (weights + KV) | share | bound ms / ITL p50 | KV GB/step |", "|" + "---|" * 15]
        for case, r in mesh.get("cases", {}).items():
            b = r.get("bound", {})
            lines.append(
                f"| {case} | {r['concurrency']} | {r['num_ok']}/{r['num_requests']} | {r['requests_per_s']} | "
                f"{r['output_tokens_per_s']} | {r.get('decode_tokens_per_s_per_seq', '')} | "
                f"{r['ttft_ms_p50']} / {r['ttft_ms_p99']} | {r['itl_ms_p50']} / {r['itl_ms_p99']} | "
                f"{r['e2e_ms_p99']} | {b.get('tokens_per_s', '')} | {r.get('tokens_per_s_over_bound', '')} | "
                f"{b.get('tokens_per_s_with_kv', '')} | {r.get('tokens_per_s_over_bound_with_kv', '')} | "
                f"{r.get('bound_ms_over_itl_p50', '')} | {r.get('kv_gb_per_step', '')} |")
        lines += ["", "Where the time went (from /metrics, per case: steps, mean step ms as each role "
                  "reports it (the gateway: the slowest rank's), wall ms per step, share of the case's "
                  "wall time in steps):", "",
                  "| case | " + " | ".join(roles := sorted({role for r in mesh["cases"].values()
                                                             for role in r.get("steps", {})})) + " |",
                  "|---|" + "---|" * len(roles)]
        for case, r in mesh["cases"].items():
            cells = [_steps_cell(r.get("steps", {}).get(role)) for role in roles]
            lines.append(f"| {case} | " + " | ".join(cells) + " |")
        lines.append("")
    if report.get("hf"):
        lines += ["transformers generate, the same weights, bf16:", "",
                  "```", json.dumps(report["hf"], indent=1), "```", ""]
    for batch in PROFILE_BATCHES:
        step = report.get("profile", {}).get(f"b{batch}")
        if step:
            lines += [f"One eager decode step at batch {batch}, context {PROFILE_CONTEXT} (model only, no gateway): "
                      f"{step['step_ms']} ms; bound/step = {step.get('bound_ms_over_step')}", "",
                      "```", step["profile"], "```", ""]
    if step := report.get("profile", {}).get("prefill"):
        lines += [f"One eager prefill step, {PROFILE_PREFILL_SEQS} prompts x {PROFILE_CHUNK} tokens (model only): "
                  f"{step['step_ms']} ms, {round(step['tokens'] / step['step_ms'] * 1e3)} tokens/s", "",
                  "```", step["profile"], "```", ""]
    lines += ["Targets:", ""] + [f"- {name}: {'met' if ok else 'NOT met'}" for name, ok in report["targets"].items()]
    if report.get("notes"):  # written by hand after a run: what the numbers mean, where the time goes
        lines += ["", "Notes:", ""] + [f"- {note}" for note in report["notes"]]
    return "\n".join(lines) + "\n"


def _steps_cell(steps: dict | None) -> str:
    if steps is None:
        return ""
    gc = (f", GC {steps['gc_ms']} ms ({steps['gc_full']} full: {steps['gc_full_ms']} ms)"
          if "gc_ms" in steps else "")
    if "prefix_query_tokens" in steps:
        gc += f", prefix-cache hits {steps['prefix_hit_tokens']} of {steps['prefix_query_tokens']} prompt tokens"
    return (f"{steps['steps']} steps, {steps['mean_step_ms']} ms in step, {steps.get('wall_ms_per_step')} ms "
            f"wall/step, busy {steps['busy_share']}{gc}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.serving.gpu_speed", description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", default="nvidia-h200", help="machine name, for the result files")
    parser.add_argument("--preset", default="qwen3-30b-a3b", help="random-weights shape")
    parser.add_argument("--ranks", type=int, default=1, help="expert services, one per GPU")
    parser.add_argument("--cases", default="b1,c8,c64,c256,mix,hf,profile",
                        help="comma list of b1, cN (concurrency N), mix, hf, profile")
    parser.add_argument("--prompt-scale", type=float, default=1.0, help="multiplies the prompt lengths")
    parser.add_argument("--output-scale", type=float, default=1.0, help="multiplies the 1K output length")
    parser.add_argument("--waves", type=int, default=1, help="cN sends N x waves requests")
    parser.add_argument("--mix-requests", type=int, default=64)
    parser.add_argument("--mix-concurrency", type=int, default=32)
    parser.add_argument("--max-batch-tokens", type=int, default=8192, help="the gateway's --max-batch-tokens")
    parser.add_argument("--gateway-arg", action="append", default=[], metavar="ARG")
    parser.add_argument("--expert-arg", action="append", default=[], metavar="ARG")
    parser.add_argument("--hf-prompt-tokens", type=int, default=128)
    parser.add_argument("--hf-new-tokens", type=int, default=64)
    parser.add_argument("--sampling", default="", metavar="TEMPERATURE,TOP_P",
                        help="every request samples (e.g. 0.8,0.95) instead of decoding greedily")
    parser.add_argument("--baseline-json", type=pathlib.Path, help="a one-GPU result, for the N>1 speed-up")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke run (tiny preset)")
    parser.add_argument("--request-timeout-s", type=float, default=600.0)
    parser.add_argument("--ready-timeout-s", type=float, default=300.0)
    parser.add_argument("--worker-timeout-s", type=float, default=300.0, help="limit of the hf and profile runs")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS_DIR)
    parser.add_argument("--hf-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--profile-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.sampling:
        try:
            sampling_params(args.sampling)
        except ValueError as error:
            parser.error(str(error))
    return args


def _setup() -> dict:
    """What the serving path used: torch, the GPU, the attention backend and CUDA-graph defaults."""
    import torch

    from expert_svc.config import ExpertConfig

    fields = {f.name: f.default for f in dataclasses.fields(ExpertConfig) if "attention" in f.name or "graph" in f.name}
    return {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "num_gpus": torch.cuda.device_count(),
            "expert_defaults": {k: str(v) for k, v in fields.items() if v is not None},
            "graph_runner_present": (pathlib.Path(__file__).parents[2] / "expert_svc" / "graph_runner.py").exists()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.hf_worker or args.profile_worker:
        print("RESULT " + json.dumps(hf_worker(args) if args.hf_worker else profile_worker(args)), flush=True)
        return 0
    cases = [c for c in args.cases.split(",") if c]
    bad = [c for c in cases if c not in ("b1", "mix", "hf", "profile") and not (c[0] == "c" and c[1:].isdigit())]
    if bad:
        raise SystemExit(f"unknown case(s) {bad}")
    from services.model.random_weights import write_model_dir

    report = {"command": " ".join(["python -m bench.serving.gpu_speed", *(argv if argv is not None else sys.argv[1:])]),
              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "config": {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()
                         if not k.endswith("worker")},
              "setup": _setup()}
    if args.baseline_json and args.baseline_json.is_file():
        base = json.loads(args.baseline_json.read_text()).get("mesh", {}).get("cases", {})
        report["one_gpu_baseline"] = {c: r["output_tokens_per_s"] for c, r in base.items()}
    serving = [c for c in cases if c not in ("hf", "profile")]
    if serving:
        with tempfile.TemporaryDirectory(prefix="gpu-speed-") as tmp:
            model_dir = write_model_dir(pathlib.Path(tmp) / args.preset, args.preset)
            try:
                report["mesh"] = run_mesh(args, serving, model_dir)
            except Exception as error:  # the workers below still run; the report says what failed
                report["mesh"] = {"error": repr(error)[-2000:]}
        _write(report, args)
    worker_argv = ["--preset", args.preset, "--seed", str(args.seed), "--device", args.device, "--hf-prompt-tokens",
                   str(args.hf_prompt_tokens), "--hf-new-tokens", str(args.hf_new_tokens)]
    for case, flag in (("profile", "--profile-worker"), ("hf", "--hf-worker")):
        if case in cases:
            report[case] = _in_subprocess(flag, worker_argv, args.worker_timeout_s)
            _write(report, args)
    print(markdown(report))
    return 0 if "error" not in report.get("mesh", {}) else 1


def _write(report: dict, args) -> None:
    """Writes the results so far (a run cut short still leaves them)."""
    add_ratios(report)
    write_result(args.out, f"gpu_speed_{args.kind}", report, markdown(report))


if __name__ == "__main__":
    sys.exit(main())

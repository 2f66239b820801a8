"""Static SASS figures and time bounds of the batch-1 GEMV kernels for an H200 (sm_90), without a GPU.

    python -m bench.kernels.sass_stats --out bench/results/                   # every case
    python -m bench.kernels.sass_stats --kernels awq_moe_gate_up,bf16_gemv_qkv

Each case calls the production wrapper (quant_awq_moe.one_token_gate_up, quant_awq.linear, gemv.linear,
...) at Qwen3-30B-A3B's batch-1 shapes (hidden 2048, expert width 768, 128 experts, 8 a token; q|k|v
2048 -> 5120, o 4096 -> 2048; AWQ group 128) on meta tensors, with PDL launches as on an H200; the
launch is caught instead of run (JITFunction.run), and the kernel is compiled for sm_90 with the
arguments' specialisations as Triton's launcher makes them (16-divisible ints and aligned pointers,
ints equal to 1 as constants). Of the cubin, `cuobjdump -res-usage` gives registers, local memory
(spills) and static shared memory (Triton's dynamic shared memory, from its metadata, added);
`nvdisasm -c` the SASS, whose hot loop sass_parse.find_hot_loop finds (the innermost backward-branch
loop with the most global loads). The instruction counts, global loads by width and bytes per thread
are that loop's, per iteration (a kernel whose loop was unrolled away: the whole listing, one pass
over a program's share of the weights); sass_bounds gives the issue, memory-parallelism and latency
bounds from them. Weight bytes: the streamed tensor (bf16 / float8 weight, AWQ qweight; AWQ's zeros
and scales, 4% more, left out). Static estimates, not measurements.

Writes sass_stats_sm90.md and .json to --out.
"""

import argparse
import contextlib
import dataclasses
import json
import pathlib
import re
import subprocess
import sys
import tempfile
from unittest import mock

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction, create_function_from_signature

from bench.kernels import sass_bounds, sass_parse

TARGET = GPUTarget("cuda", 90, 32)
BIN = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


@dataclasses.dataclass(frozen=True, slots=True)
class Launch:
    """A caught kernel launch: the JIT function, its arguments and the grid."""

    fn: JITFunction
    args: tuple
    kwargs: dict
    grid: tuple


@contextlib.contextmanager
def caught_launches():
    """Yields a list that every JIT kernel launch in the block is appended to (as a Launch), none run;
    single-token kernels launch with PDL as on an H200 (launch.uses_pdl of a one-row tensor)."""
    launches: list[Launch] = []

    def run(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(self, args, kwargs, tuple(grid)))

    def uses_pdl(x):
        return x.shape[0] == 1

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(JITFunction, "run", run))
        for name, module in list(sys.modules.items()):
            if name.startswith("services.model.kernels") and hasattr(module, "uses_pdl"):
                stack.enter_context(mock.patch.object(module, "uses_pdl", uses_pdl))
        yield launches


def compile_launch(launch: Launch):
    """The launch's kernel compiled for sm_90 as the launcher would specialise it (triton's CompiledKernel)."""
    backend = CUDABackend(TARGET)
    binder = create_function_from_signature(launch.fn.signature, launch.fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = launch.fn._pack_args(backend, launch.kwargs, bound, specialization,
                                                                 options)
    return triton.compile(ASTSource(launch.fn, signature, constexprs, attrs), target=TARGET,
                          options=options.__dict__)


def cubin_texts(cubin: bytes) -> tuple[str, str]:
    """(nvdisasm -c listing, cuobjdump -res-usage text) of a cubin; needs the binaries triton ships."""
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        sass = subprocess.run([str(BIN / "nvdisasm"), "-c", str(path)], check=True, capture_output=True, text=True)
        usage = subprocess.run([str(BIN / "cuobjdump"), "-res-usage", str(path)], check=True, capture_output=True,
                               text=True)
    return sass.stdout, usage.stdout


def resources(usage: str) -> dict[str, int]:
    """REG, SHARED, LOCAL (spills) and STACK bytes of cuobjdump -res-usage's text."""
    found = {key: int(value) for key, value in re.findall(r"\b(REG|SHARED|LOCAL|STACK):(\d+)", usage)}
    if "REG" not in found:
        raise ValueError(f"no register count in the resource usage {usage[:200]!r}")
    return found


def analyse(name: str, case) -> dict:
    """The figures and bounds of one case (a sass_cases.Case; a JSON-able dict)."""
    with caught_launches() as launches:
        case.launch()
    if not launches:
        raise ValueError(f"case {name!r} launched no kernel")
    launch = launches[0]
    kernel = compile_launch(launch)
    sass, usage = cubin_texts(kernel.asm["cubin"])
    res = resources(usage)
    # Triton's shared memory is dynamic (its metadata, set at launch); the cubin's static SHARED is reserved space.
    shared = res.get("SHARED", 0) + kernel.metadata.shared
    stats = sass_parse.loop_stats(sass)
    warps, stages = launch.kwargs.get("num_warps", 4), launch.kwargs.get("num_stages", 3)
    programs = int(torch.tensor(launch.grid).prod())
    if stats.found:
        step_bytes, depth = case.step_bytes(launch.kwargs), max(1, stages - 1) if stats.async_copies else 1
    else:  # no loop left (unrolled): the listing is one pass over a program's share of the weights
        step_bytes, depth = -(-case.weight_bytes // programs), 1
    figures = sass_bounds.KernelFigures(
        case.weight_bytes, step_bytes, warps, programs, res["REG"], shared, stats.instructions,
        stats.outside, depth, stats.async_copies or stats.prefetched)
    b = sass_bounds.bounds(figures)
    spills = sum(1 for line in sass.splitlines() if re.search(r"\b(STL|LDL)\b", line))
    return {"kernel": name, "function": launch.fn.__name__, "about": case.about, "grid": list(launch.grid),
            "constexprs": {k: v for k, v in launch.kwargs.items() if isinstance(v, (int, bool, str))},
            "registers": res["REG"], "local_bytes": res.get("LOCAL", 0), "spill_instructions": spills,
            "shared": shared, "loop": dataclasses.asdict(stats), "figures": dataclasses.asdict(figures),
            "bounds": dataclasses.asdict(b)}


def _us_gbs(seconds: float, weight_bytes: int) -> str:
    return f"{seconds * 1e6:.1f} us ({weight_bytes / seconds / 1e9:,.0f} GB/s)"


def markdown(rows: list[dict]) -> str:
    """The table of every case, then each case's bounds' arithmetic."""
    head = ("| kernel | grid x warps | regs | spill | smem B | blocks/SM | loop instr | global loads in loop "
            "| LDG B/thread | LOP3/shift | FFMA/FMUL/FADD | int | cvt | LDS/STS, BAR | instr/B | KB in flight/SM "
            "| issue bound | memory bound | latency bound | HBM |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        loop, b, c = r["loop"], r["bounds"], r["loop"]["classes"]
        loads = ", ".join(f"{n} {op}" for op, n in loop["loads"].items())
        lines.append(
            f"| {r['kernel']} | {'x'.join(map(str, r['grid']))} x {r['figures']['warps']} | {r['registers']} | "
            f"{r['local_bytes']} | {r['shared']} | {b['blocks_per_sm']:.2f} of {b['occupancy_blocks']} | "
            f"{loop['instructions']}{'' if loop['found'] else ' (no loop)'} | {loads} | "
            f"{loop['load_bytes_per_thread']} | {c.get('LOP3/shift', 0)} | {c.get('FFMA', 0)}/{c.get('FMUL', 0)}/"
            f"{c.get('FADD', 0)} | {c.get('integer', 0) + c.get('uniform', 0)} | {c.get('convert', 0)} | "
            f"{c.get('shared LDS/STS', 0)}, {c.get('barrier', 0)} | {b['instructions_per_byte']:.3f} | "
            f"{b['in_flight_per_sm'] / 1024:.1f} | {_us_gbs(b['issue_s'], r['figures']['weight_bytes'])} | "
            f"{_us_gbs(b['memory_s'], r['figures']['weight_bytes'])} | "
            f"{_us_gbs(b['latency_s'], r['figures']['weight_bytes'])} | {b['hbm_s'] * 1e6:.1f} us |")
    lines.append("")
    for r in rows:
        lines += [f"- **{r['kernel']}** ({r['about']}; {r['function']} {r['constexprs']}):",
                  f"  issue: {r['bounds']['issue_text']};", f"  memory: {r['bounds']['memory_text']};",
                  f"  latency ({'prefetched' if r['figures']['prefetched'] else 'loads waited for'}): "
                  f"{r['bounds']['latency_text']}."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from bench.kernels import sass_cases  # imports the model's kernels: not at import (tests set TRITON_INTERPRET)

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", default=",".join(sass_cases.CASES), help="comma-separated, of: "
                   + ", ".join(sass_cases.CASES))
    p.add_argument("--out", default=None, help="folder for sass_stats_sm90.md / .json (none: print only)")
    args = p.parse_args(argv)
    names = args.kernels.split(",")
    unknown = [n for n in names if n not in sass_cases.CASES]
    if unknown:
        raise ValueError(f"unknown kernels {unknown}; known: {list(sass_cases.CASES)}")
    rows = [analyse(name, sass_cases.CASES[name]) for name in names]
    text = markdown(rows)
    print(text)
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "sass_stats_sm90.md").write_text("# Static SASS figures, sm_90 (python -m bench.kernels.sass_stats)\n\n"
                                                "Static estimates, not measurements.\n\n" + text)
        (out / "sass_stats_sm90.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

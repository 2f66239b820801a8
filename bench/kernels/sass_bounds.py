"""Static time bounds of a weight-streaming kernel on an H200 from its SASS figures (bench/kernels/sass_stats.py).

Two bounds, each a floor on the kernel's time that a kernel cannot beat whatever its bytes:

- issue: every warp instruction takes one of the 132 SMs x 4 schedulers' issue slots (1 a clock at
  ~1.98 GHz): (hot-loop warp instructions per weight byte x the weight bytes + the instructions
  outside the loops x warps x programs) / (132 x 4 x 1.98e9).
- memory parallelism (Little's law): HBM delivers bandwidth = bytes in flight / latency, so an SM
  must have ~4.8 TB/s x 700 ns / 132 ~= 25 KB of loads outstanding to keep its share of the bus
  busy. Bytes in flight per SM = resident warps (the least of the registers', shared memory's,
  the 64-warp and 32-block limits, and the grid's programs spread over 132 SMs) x the weight
  bytes a warp has outstanding: its share of one loop step's weights x the prefetch depth (a
  cp.async pipeline (LDGSTS): num_stages - 1 steps; loads in registers: 1 step). The bandwidth
  this gives, capped at ~4.25 TB/s (what an H200's HBM delivers to a good stream), over the bytes.

A third, the latency bound, is the time a program's loop takes when its loads wait: waves of
programs (the grid over 132 SMs x the blocks one holds) x (trips of the loop (the weight bytes
over programs x step bytes) x (the latency, unless the loads are prefetched: cp.async or registers
filled for the next iteration) + the resident warps' loop instructions per scheduler at one a
clock) + one latency.

These are estimates from static counts (predicated-off instructions counted, latencies
hidden or not as the model says), not measurements.
"""

import dataclasses
import math

SMS = 132
SCHEDULERS = 4  # per SM, one warp instruction a clock each
CLOCK_HZ = 1.98e9
HBM_PEAK = 4.8e12  # B/s
HBM_EFFECTIVE = 4.25e12  # B/s a good stream reaches
LATENCY_S = 700e-9  # a loaded DRAM access
REGISTERS = 65536  # per SM
SHARED = 228 * 1024  # per SM
SHARED_RESERVED = 1024  # per block
MAX_WARPS, MAX_BLOCKS = 64, 32
NEEDED_IN_FLIGHT = HBM_PEAK * LATENCY_S / SMS  # ~25.5 KB an SM


@dataclasses.dataclass(frozen=True, slots=True)
class KernelFigures:
    """What the bounds take: the launch, the resources, and the hot loop's static counts."""

    weight_bytes: int  # every weight byte the call reads (the whole projection's)
    step_bytes: int  # weight bytes a program reads per hot-loop iteration
    warps: int
    programs: int
    registers: int
    shared: int
    loop_instructions: int  # per warp and iteration
    outside_instructions: int  # per warp, about once a program
    depth: int  # loop steps of loads outstanding
    prefetched: bool  # the loop's weight loads are for a later iteration (latency hidden behind its FMAs)


@dataclasses.dataclass(frozen=True, slots=True)
class Bounds:
    """The two bounds and the figures they come from, with the arithmetic spelled out."""

    blocks_per_sm: float  # resident (occupancy, capped by the grid)
    occupancy_blocks: int  # what registers and shared memory allow
    instructions_per_byte: float  # hot-loop warp instructions per weight byte
    in_flight_per_sm: float  # B
    issue_s: float
    memory_s: float
    latency_s: float
    hbm_s: float
    issue_text: str
    memory_text: str
    latency_text: str


def occupancy_blocks(registers: int, shared: int, warps: int) -> int:
    """Blocks an SM holds at once by registers (allocated per warp in 256s), shared memory, and the warp
    and block caps."""
    if registers < 1 or warps < 1 or shared < 0:
        raise ValueError(f"registers {registers}, warps {warps} and shared {shared} must be positive")
    per_warp = math.ceil(registers * 32 / 256) * 256
    by_registers = (REGISTERS // per_warp) // warps
    by_shared = SHARED // (shared + SHARED_RESERVED)
    return max(0, min(by_registers, by_shared, MAX_WARPS // warps, MAX_BLOCKS))


def bounds(f: KernelFigures) -> Bounds:
    """The issue and memory-parallelism bounds of a kernel (see the module docstring)."""
    if f.step_bytes < 1 or f.weight_bytes < 1 or f.programs < 1:
        raise ValueError(f"weight bytes, step bytes and programs must be positive: {f}")
    per_byte = f.loop_instructions * f.warps / f.step_bytes
    outside = f.outside_instructions * f.warps * f.programs
    issue_s = (per_byte * f.weight_bytes + outside) / (SMS * SCHEDULERS * CLOCK_HZ)
    occupancy = occupancy_blocks(f.registers, f.shared, f.warps)
    blocks = min(occupancy, f.programs / SMS)
    per_warp = f.step_bytes / f.warps * f.depth
    in_flight = blocks * f.warps * per_warp
    bandwidth = min(HBM_EFFECTIVE, SMS * in_flight / LATENCY_S)
    memory_s = f.weight_bytes / bandwidth
    issue_text = (f"({f.loop_instructions} x {f.warps} / {f.step_bytes} B = {per_byte:.3f} instr/B) x "
                  f"{f.weight_bytes / 1e6:.2f} MB + {f.outside_instructions} x {f.warps} x {f.programs} = "
                  f"{(per_byte * f.weight_bytes + outside) / 1e6:.2f} M / ({SMS} x {SCHEDULERS} x "
                  f"{CLOCK_HZ / 1e9:.2f} GHz) = {issue_s * 1e6:.1f} us")
    memory_text = (f"min({occupancy}, {f.programs}/{SMS}) = {blocks:.2f} blocks x {f.warps} warps x "
                   f"{per_warp:.0f} B ({f.step_bytes} B / {f.warps} x depth {f.depth}) = {in_flight / 1024:.1f} KB "
                   f"a SM (needs {NEEDED_IN_FLIGHT / 1024:.1f}) -> min(4.25, {SMS} x {in_flight / 1024:.1f} KB / "
                   f"{LATENCY_S * 1e9:.0f} ns) = {bandwidth / 1e12:.2f} TB/s -> {memory_s * 1e6:.1f} us")
    latency_s, latency_text = _latency(f, occupancy, blocks)
    return Bounds(blocks, occupancy, per_byte, in_flight, issue_s, memory_s, latency_s, f.weight_bytes / HBM_EFFECTIVE,
                  issue_text, memory_text, latency_text)


def _latency(f: KernelFigures, occupancy: int, blocks: float) -> tuple[float, str]:
    """The latency bound (module docstring) and its arithmetic."""
    waves = math.ceil(f.programs / (SMS * max(occupancy, 1)))
    trips = f.weight_bytes / (f.programs * f.step_bytes)
    exposed = 0.0 if f.prefetched else LATENCY_S
    per_trip = exposed + f.loop_instructions * blocks * f.warps / SCHEDULERS / CLOCK_HZ
    seconds = waves * (trips * per_trip + LATENCY_S)
    return seconds, (f"{waves} wave(s) x ({trips:.1f} trips x ({exposed * 1e9:.0f} ns exposed + {f.loop_instructions}"
                     f" x {blocks * f.warps:.1f} warps / {SCHEDULERS} / {CLOCK_HZ / 1e9:.2f} GHz) + "
                     f"{LATENCY_S * 1e9:.0f} ns) = {seconds * 1e6:.1f} us")

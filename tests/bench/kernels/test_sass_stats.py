"""bench/kernels/sass_parse.py, sass_bounds.py and sass_stats.py: the SASS parsing and the bounds'
arithmetic on a small listing written in nvdisasm's format, and one tiny kernel compiled for sm_90
(skipped where triton's ptxas and nvdisasm are not installed).

Interpreted kernel tests later in the session import the model's kernel modules once: TRITON_INTERPRET=1
must be set before triton is first imported, so this file sets it first; the compile test runs its kernel
(tests/bench/kernels/sass_tiny_kernel.py) in a process of its own without it.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import dataclasses  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import triton  # noqa: E402

from bench.kernels import sass_bounds, sass_parse  # noqa: E402

# A prologue, an outer loop (0x30-0xd0) around an inner one (0x40-0xb0), the epilogue, and
# nvdisasm's closing branch to itself.
LISTING = """
_kernel:
.text._kernel:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E R2, desc[UR4][R2.64] ;
        /*0020*/               @P0 BRA `(.L_x_2) ;
.L_x_0:
        /*0030*/                   IADD3 R4, R4, 0x1, RZ ;
.L_x_1:
        /*0040*/                   LDG.E.128 R8, desc[UR4][R6.64] ;
        /*0050*/              @!P1 LDG.E.U16 R12, desc[UR4][R24.64] ;
        /*0060*/                   LOP3.LUT R13, R8, 0xf, RZ, 0xc0, !PT ;
        /*0070*/                   FFMA R20, R13, R12, R20 ;
        /*0080*/                   HADD2.F32 R14, -RZ, R12.H0_H0 ;
        /*0090*/                   STS [R3], R14 ;
        /*00a0*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*00b0*/              @!P2 BRA `(.L_x_1) ;
        /*00c0*/                   LDG.E.64 R16, desc[UR4][R6.64] ;
        /*00d0*/              @!P3 BRA `(.L_x_0) ;
.L_x_2:
        /*00e0*/                   STG.E desc[UR4][R2.64], R20 ;
        /*00f0*/                   EXIT ;
.L_x_3:
        /*0100*/                   BRA `(.L_x_3);
.L_x_4:
"""


def test_parse_reads_instructions_labels_and_load_widths():
    listing = sass_parse.parse(LISTING)
    assert len(listing.instructions) == 17
    assert listing.labels == {".L_x_0": 0x30, ".L_x_1": 0x40, ".L_x_2": 0xE0, ".L_x_3": 0x100, ".L_x_4": 0x110}
    by_offset = {i.offset: i for i in listing.instructions}
    assert (by_offset[0x50].predicate, by_offset[0x50].opcode) == ("@!P1", "LDG.E.U16")
    assert [by_offset[o].load_bytes() for o in (0x10, 0x40, 0x50, 0xC0, 0xE0)] == [4, 16, 2, 8, 0]


def test_the_hot_loop_is_the_innermost_loading_one():
    listing = sass_parse.parse(LISTING)
    assert {(lp.start, lp.end) for lp in sass_parse.loops(listing)} == {(0x40, 0xB0), (0x30, 0xD0), (0x100, 0x100)}
    assert sass_parse.find_hot_loop(listing) == sass_parse.Loop(0x40, 0xB0, True)


def test_loop_stats_count_the_hot_loop():
    stats = sass_parse.loop_stats(LISTING)
    assert stats.found and stats.instructions == 8 and stats.load_bytes_per_thread == 18
    assert stats.loads == {"LDG.E.128": 1, "LDG.E.U16": 1}
    assert stats.classes == {"global load": 2, "LOP3/shift": 1, "FFMA": 1, "convert": 1, "shared LDS/STS": 1,
                             "barrier": 1, "control": 1}
    assert stats.outside == 17 - 11  # every instruction of the loops with loads (0x30-0xd0) left out
    assert not stats.async_copies and not stats.prefetched  # R8 of the LDG.E.128 is read after it


def test_a_load_read_only_before_it_is_a_prefetch():
    prefetching = LISTING.replace("LOP3.LUT R13, R8,", "LOP3.LUT R13, R30,").replace(
        "/*0040*/                   LDG.E.128 R8,", "/*0040*/                   FADD R9, R9, R9 ;\n"
        "        /*0045*/                   LDG.E.128 R8,")
    assert sass_parse.loop_stats(prefetching).prefetched


def test_a_listing_without_a_loading_loop_has_no_hot_loop():
    flat = "\n".join(line for line in LISTING.splitlines() if "BRA `(.L_x_0)" not in line
                     and "BRA `(.L_x_1)" not in line)
    stats = sass_parse.loop_stats(flat)
    assert not stats.found and stats.instructions == 15 and stats.outside == 0


def test_parse_refuses_text_without_instructions():
    with pytest.raises(ValueError, match="no SASS instructions"):
        sass_parse.parse("not a listing")


FIGURES = sass_bounds.KernelFigures(weight_bytes=12_582_912, step_bytes=1024, warps=4, programs=384, registers=68,
                                    shared=1024, loop_instructions=263, outside_instructions=841, depth=1,
                                    prefetched=True)


def test_occupancy_by_registers_shared_memory_and_caps():
    assert sass_bounds.occupancy_blocks(68, 1024, 4) == 7  # 68 regs: 2,304 a warp, 28 warps
    assert sass_bounds.occupancy_blocks(32, 0, 4) == 16  # the 64-warp cap
    assert sass_bounds.occupancy_blocks(32, 100_000, 4) == 2  # shared memory
    assert sass_bounds.occupancy_blocks(255, 0, 8) == 1 and sass_bounds.occupancy_blocks(255, 0, 16) == 0
    with pytest.raises(ValueError, match="registers 0"):
        sass_bounds.occupancy_blocks(0, 0, 4)


def test_bounds_arithmetic():
    b = sass_bounds.bounds(FIGURES)
    assert b.instructions_per_byte == pytest.approx(263 * 4 / 1024)
    issue = (263 * 4 / 1024 * 12_582_912 + 841 * 4 * 384) / (132 * 4 * 1.98e9)
    assert b.issue_s == pytest.approx(issue) and "13.6 us" in b.issue_text
    in_flight = 384 / 132 * 4 * 256  # the grid, not the occupancy (7), limits the resident blocks
    assert b.in_flight_per_sm == pytest.approx(in_flight)
    assert b.memory_s == pytest.approx(12_582_912 / (132 * in_flight / 700e-9))
    trips = 12_582_912 / (384 * 1024)
    assert b.latency_s == pytest.approx(trips * 263 * 384 / 132 * 4 / 4 / 1.98e9 + 700e-9)
    waited = sass_bounds.bounds(_replace(prefetched=False))
    assert waited.latency_s == pytest.approx(b.latency_s + trips * 700e-9)


def _replace(**changes) -> sass_bounds.KernelFigures:
    return dataclasses.replace(FIGURES, **changes)


def test_memory_bound_is_capped_at_the_hbm_rate():
    b = sass_bounds.bounds(_replace(depth=64, programs=132 * 7))
    assert b.memory_s == pytest.approx(b.hbm_s) and b.hbm_s == pytest.approx(12_582_912 / 4.25e12)


def test_bounds_refuse_empty_figures():
    with pytest.raises(ValueError, match="must be positive"):
        sass_bounds.bounds(_replace(step_bytes=0))



def _compiler_binaries() -> bool:
    """Whether triton ships ptxas, nvdisasm and cuobjdump (where sass_stats.BIN looks)."""
    bin_dir = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    return all((bin_dir / name).exists() for name in ("ptxas", "nvdisasm", "cuobjdump"))


@pytest.mark.skipif(not _compiler_binaries(), reason="triton's ptxas, nvdisasm and cuobjdump are not installed")
def test_a_tiny_kernel_compiles_for_sm90_and_its_loop_is_found():
    """sass_tiny_kernel's launch is caught (not run) on meta tensors, compiled for sm_90, and its loop of
    LDG.E.128 found; in a process of its own without TRITON_INTERPRET."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.bench.kernels.sass_tiny_kernel"], env=env, check=True,
                          capture_output=True, text=True, cwd=pathlib.Path(__file__).parents[3], timeout=300)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["launches"] == [[[8], 128]] and result["registers"] > 0
    loop = result["loop"]
    assert loop["found"] and loop["loads"].get("LDG.E.128", 0) >= 1 and loop["load_bytes_per_thread"] >= 16

"""The kernels bench/kernels/sass_stats.py compiles: Qwen3-30B-A3B's batch-1 GEMVs, called through their wrappers.

Each Case calls a production wrapper on meta tensors (sass_stats catches the launch), and says the
weight bytes the call streams and the weight bytes one program reads per step of its hot loop
(from the launch's constexprs). Shapes: hidden D 2048, expert width F 768, E 128 experts, K 8 a
token; q|k|v [5120, 2048] and o [2048, 4096] (bf16 and FP8 [N, K]; AWQ stores [K, N/8]); group 128.
"""

import dataclasses
from typing import Callable
from unittest import mock

import torch

from services.model.kernels import gemv, quant_awq, quant_awq_moe, quant_fp8, quant_fp8_moe
from services.model.kernels.quant_awq_moe import AwqWeights

D, F, E, TOP_K, GROUP = 2048, 768, 128, 8, 128
DENSE = {"qkv": (5120, 2048), "o": (2048, 4096)}  # [N, K]


@dataclasses.dataclass(frozen=True, slots=True)
class Case:
    """One kernel: launch() calls its wrapper (the first kernel launched is the one), weight_bytes the
    streamed weight bytes of the call, step_bytes(constexprs) a program's weight bytes a loop step."""

    about: str
    launch: Callable[[], None]
    weight_bytes: int
    step_bytes: Callable[[dict], int]


def _meta(*shape, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def _awq(experts: tuple[int, ...], k: int, n: int) -> AwqWeights:
    """AWQ weights of k x n (qweight [.., k, n/8], qzeros, scales), leading dimensions `experts`."""
    return AwqWeights(_meta(*experts, k, n // 8, dtype=torch.int32), _meta(*experts, k // GROUP, n // 8,
                      dtype=torch.int32), _meta(*experts, k // GROUP, n, dtype=torch.float16))


def _ids() -> torch.Tensor:
    return _meta(1, TOP_K, dtype=torch.int32)


def _awq_moe(tiles: quant_awq_moe.OneTokenTiles, what: str) -> dict[str, Case]:
    gate_up, down = _awq((E,), D, 2 * F), _awq((E,), F, D)
    return {
        f"awq_moe_gate_up{what}": Case(
            f"AWQ one-token gate|up, {tiles.gemv} GEMV", lambda: quant_awq_moe.one_token_gate_up(
                _meta(1, D), _ids(), gate_up, tiles), TOP_K * D * 2 * F // 2,
            lambda c: (c["GROUP"] if c["GROUPS"] else c["BLOCK_D"]) * c["BLOCK_F"] // 8 * 4),
        f"awq_moe_down{what}": Case(
            f"AWQ one-token down, {tiles.gemv} GEMV", lambda: quant_awq_moe.one_token_down(
                _meta(TOP_K, F), _ids(), _meta(1, TOP_K), down, tiles), TOP_K * F * D // 2,
            lambda c: (c["GROUP"] if c["GROUPS"] else c["BLOCK_F"]) * c["BLOCK_O"] // 8 * 4)}


def _awq_dense(name: str, gemv_name: str) -> Case:
    n, k = DENSE[name]
    w = _awq((), k, n)

    def launch():
        with mock.patch.object(quant_awq, "ONE_ROW_GEMV", gemv_name):
            quant_awq.linear(_meta(1, k), w.qweight, w.qzeros, w.scales)

    def step_bytes(c: dict) -> int:
        return c["GROUP"] * c["BLOCK_C"] * 4 if "BLOCK_C" in c else c["BLOCK_K"] * c["BLOCK_N"] // 8 * 4
    return Case(f"AWQ {name} linear at one row, {gemv_name} GEMV", launch, n * k // 2, step_bytes)


def _bf16_dense(name: str) -> Case:
    n, k = DENSE[name]
    return Case(f"bf16 {name} GEMV (gemv.linear)", lambda: gemv.linear(_meta(1, k), _meta(n, k)), n * k * 2,
                lambda c: c["BLOCK_N"] * c["BLOCK_K"] * 2)


def _fp8_gemv(launch: Callable[[], None], pipelined: bool) -> Callable[[], None]:
    """launch with quant_fp8.GEMV_PIPELINED set to pipelined."""
    def run():
        with mock.patch.object(quant_fp8, "GEMV_PIPELINED", pipelined):
            launch()
    return run


def _fp8_dense(name: str, pipelined: bool = False) -> Case:
    n, k = DENSE[name]
    return Case(f"FP8 weight-only {name} at one row{', pipelined' if pipelined else ''}", _fp8_gemv(
        lambda: quant_fp8.linear(_meta(1, k), _meta(n, k, dtype=torch.float8_e4m3fn), _meta(
            (n + 127) // 128, (k + 127) // 128, dtype=torch.float32), "weight-only"), pipelined),
        n * k, lambda c: c["BLOCK_N"] * c["BLOCK_K"])


def _fp8_moe() -> dict[str, Case]:
    w_gate_up, s_gate_up = _meta(E, 2 * F, D, dtype=torch.float8_e4m3fn), _meta(E, 2 * F // 128, D // 128,
                                                                              dtype=torch.float32)
    w_down, s_down = _meta(E, D, F, dtype=torch.float8_e4m3fn), _meta(E, D // 128, F // 128, dtype=torch.float32)

    def gate_up(pipelined: bool) -> Case:
        return Case(f"FP8 one-token gate|up (two GEMV loops, gate's then up's){', pipelined' if pipelined else ''}",
                    _fp8_gemv(lambda: quant_fp8_moe.one_token_gate_up(_meta(1, D), _ids(), w_gate_up, s_gate_up),
                              pipelined), TOP_K * 2 * F * D, lambda c: c["BLOCK_F"] * c["BLOCK_D"])

    def down(pipelined: bool) -> Case:
        return Case(f"FP8 one-token down (every expert's rows a step){', pipelined' if pipelined else ''}",
                    _fp8_gemv(lambda: quant_fp8_moe.one_token_down(_meta(TOP_K, F), _ids(), _meta(1, TOP_K), w_down,
                                                                   s_down), pipelined), TOP_K * D * F,
                    lambda c: c["BLOCK_K"] * c["BLOCK_O"] * c["BLOCK_F"])
    return {
        "fp8_moe_gate_up": gate_up(False),
        "fp8_moe_gate_up_pipelined": gate_up(True),
        "fp8_moe_down": down(False),
        "fp8_moe_down_pipelined": down(True)}


CASES: dict[str, Case] = {
    **_awq_moe(quant_awq_moe.NIBBLE_TILES, ""),
    **_awq_moe(quant_awq_moe.GROUPED_TILES, "_groups"),
    "awq_linear1_qkv": _awq_dense("qkv", "nibbles"),
    "awq_linear1_o": _awq_dense("o", "nibbles"),
    "awq_linear1_qkv_groups": _awq_dense("qkv", "groups"),
    "awq_linear1_o_groups": _awq_dense("o", "groups"),
    "bf16_gemv_qkv": _bf16_dense("qkv"),
    "bf16_gemv_o": _bf16_dense("o"),
    "fp8_gemv_qkv": _fp8_dense("qkv"),
    "fp8_gemv_o": _fp8_dense("o"),
    "fp8_gemv_qkv_pipelined": _fp8_dense("qkv", True),
    "fp8_gemv_o_pipelined": _fp8_dense("o", True),
    **_fp8_moe(),
}

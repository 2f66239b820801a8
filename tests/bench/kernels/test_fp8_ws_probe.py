"""bench/kernels/fp8_ws_probe.py's GEMM in the interpreter: with and without the warp specialization it
computes the block-FP8 product as the tensor-core path defines it (activations quantized per row and
128-column group, weights per 128 x 128 block), at edges that are not multiples of its tiles.

The probe's kernel is decorated when its module is first imported: TRITON_INTERPRET=1 is set first."""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from bench.kernels import fp8_ws_probe  # noqa: E402
from services.model.kernels import quant_ref as ref  # noqa: E402
from tests.triton_interpreter import index_fix  # noqa: E402


@pytest.fixture(autouse=True)
def fixed_interpreter():
    with index_fix():
        yield


@pytest.mark.parametrize("warp_specialize", [False, True])
def test_the_probe_gemm_is_the_block_fp8_product(warp_specialize):
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(40, 384, generator=g), torch.randn(200, 384, generator=g) * 0.05
    w[150:] *= 9  # the second 128-row weight block: scales unlike the first's
    (xq, xs), (w8, s) = ref.quant_act_fp8(x), ref.quant_fp8(w)
    expected = (xq.float() * xs.repeat_interleave(128, 1)) @ ref.dequant_fp8(w8, s).T
    y = fp8_ws_probe.ws_linear(xq, xs, w8, s, (32, 32, 4, 1), warp_specialize, out_dtype=torch.float32)
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-5)


def test_a_tile_across_weight_blocks_is_refused():
    x8 = torch.zeros(8, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(AssertionError, match="one weight-scale block"):
        fp8_ws_probe.ws_linear(x8, torch.ones(8, 1), x8, torch.ones(1, 1), (32, 256, 4, 1), False)

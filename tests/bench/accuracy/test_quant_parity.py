"""bench/accuracy/hf_parity.py --quant on the CPU (tiny model): the weight-only path against transformers on the
dequantized weights passes the bf16 bounds, a broken scale fails them; the FP8 tensor-core path's verdict."""

import pytest

from bench.accuracy import hf_parity, quant_parity


def _args(tmp_path, method):
    return hf_parity.parse_args(["--device", "cpu", "--preset", "tiny", "--batches", "1,3", "--mixed", "4",
                                 "--prompt-tokens", "20", "--decode-tokens", "4", "--quant", method,
                                 "--out", str(tmp_path)])


@pytest.mark.parametrize("method", ["fp8", "awq"])
def test_the_weight_only_path_passes_against_the_dequantized_weights(tmp_path, method):
    result = hf_parity.run(_args(tmp_path, method))
    assert result["ok"] and result["config"]["quant"] == method and result["config"]["path"] == "reference"
    assert all(row["error_ratio"] < hf_parity.MAX_ERROR_RATIO for row in result["rows"])
    text = hf_parity.render(result, "cmd")
    assert f"Quantized: {method}, served on the `reference` path" in text and "every row passes" in text


def test_a_broken_scale_fails(tmp_path):
    def corrupt(model):
        w = model.layers[2].w_o_DHK  # an AWQ projection of a MoE layer
        w.tensors["scales"].mul_(1.1)
        w._dense = None  # the CPU path's cached dequantized weight, recomputed from the scales
        return model

    result = hf_parity.run(_args(tmp_path, "awq"), corrupt=corrupt)
    assert not result["ok"]


def test_the_fp8_verdict_allows_the_activation_rounding_and_no_more():
    base = {"mean_abs_err": 0.01, "worst_row_err": 0.02, "argmax_agree": 0.99}
    ok = quant_parity.fp8_verdict({"mean_abs_err": 0.12, "worst_row_err": 0.5, "argmax_agree": 0.95}, base)
    assert ok["ok"] and ok["error_ratio"] == pytest.approx(12.0) and ok["argmax_drop"] == pytest.approx(0.04)
    for bad in ({"mean_abs_err": 0.17, "worst_row_err": 0.5, "argmax_agree": 0.99},   # mean error
                {"mean_abs_err": 0.05, "worst_row_err": 1.0, "argmax_agree": 0.99},   # worst position
                {"mean_abs_err": 0.05, "worst_row_err": 0.2, "argmax_agree": 0.93}):  # argmax agreement
        assert not quant_parity.fp8_verdict(bad, base)["ok"], bad

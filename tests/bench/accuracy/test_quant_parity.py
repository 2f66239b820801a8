"""bench/accuracy/hf_parity.py --quant on the CPU (tiny model): the weight-only path against transformers on the
dequantized weights passes the bf16 bounds, a broken scale fails them; the FP8 tensor-core path's verdict."""

import pytest
import torch

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
    # FP8 on the weight-only path: the rounding the tensor-core path would add is reported beside it, not judged.
    assert all(("hf_fp8_inputs" in row) == (method == "fp8") for row in result["rows"])
    assert ("transformers fp32, FP8 inputs" in text) == (method == "fp8") and "same FP8 rounding" not in text


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


def test_the_fp8_verdict_takes_its_argmax_bound_from_the_rounding_alone():
    base = {"mean_abs_err": 0.01, "worst_row_err": 0.02, "argmax_agree": 0.98}
    rounding = {"mean_abs_err": 0.03, "worst_row_err": 0.05, "argmax_agree": 0.90}
    near = {"mean_abs_err": 0.04, "worst_row_err": 0.06, "argmax_agree": 0.88}  # 10 points below bf16
    assert not quant_parity.fp8_verdict(near, base)["ok"]
    verdict = quant_parity.fp8_verdict(near, base, rounding)
    assert verdict["ok"] and verdict["argmax_drop"] == pytest.approx(0.02)
    assert not quant_parity.fp8_verdict({**near, "argmax_agree": 0.84}, base, rounding)["ok"]


def test_the_fp8_argmax_bound_allows_what_few_positions_cannot_measure():
    """A 7-point drop: within the bound on 128 positions of which 15 disagree between the two (its
    standard error about 3 points), beyond it on 4,096 positions of which 400 do (0.5 points)."""
    base = {"mean_abs_err": 0.01, "worst_row_err": 0.02, "argmax_agree": 0.96}
    rounding = {"mean_abs_err": 0.04, "worst_row_err": 0.05, "argmax_agree": 0.94}
    few = {"mean_abs_err": 0.04, "worst_row_err": 0.05, "argmax_agree": 0.87, "positions": 128}
    verdict = quant_parity.fp8_verdict(few, base, rounding, discordant=15)
    assert verdict["ok"] and verdict["argmax_drop_bound"] == pytest.approx(0.05 + 2 * 15 ** 0.5 / 128)
    assert not quant_parity.fp8_verdict(few, base, rounding)["ok"]  # no paired count: the bare bound
    many = {**few, "positions": 4096}
    verdict = quant_parity.fp8_verdict(many, base, rounding, discordant=400)
    assert not verdict["ok"] and verdict["argmax_drop_bound"] == pytest.approx(0.05 + 2 * 20 / 4096)


def test_discordant_counts_the_positions_where_one_of_two_agrees():
    a, b = hf_parity.RowErrors.empty((2, 4)), hf_parity.RowErrors.empty((2, 4))
    a.agree_BL[:] = torch.tensor([[True, True, False, False], [True, False, True, True]])
    b.agree_BL[:] = torch.tensor([[True, False, True, False], [False, False, True, True]])
    assert a.discordant(b, 2, slice(0, 4)) == 3
    assert a.discordant(b, 1, slice(0, 2)) == 1 and a.discordant(b, 2, slice(2, 4)) == 1


def test_fp8_inputs_round_the_quantized_projections_inputs_only():
    """Inside fp8_inputs a projection (its name has "_proj", an expert's slice of a stacked weight
    included) sees its input rounded per row and 128-channel group; the gate does not."""
    import torch
    from torch.nn import functional

    from services.model.kernels.quant_ref import quant_act_fp8

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = torch.nn.Linear(200, 8, bias=False)
            self.gate = torch.nn.Linear(200, 4, bias=False)
            self.gate_up_proj = torch.nn.Parameter(torch.randn(3, 6, 200))

    torch.manual_seed(0)
    block, x = Block(), torch.randn(5, 200) * torch.linspace(0.01, 30, 200)
    xq, xs = quant_act_fp8(x)
    rounded = xq.float() * xs.repeat_interleave(128, 1)[:, :200]
    assert not torch.equal(rounded, x)
    assert torch.equal(quant_parity.round_fp8_input(x.reshape(1, 5, 200)), rounded.reshape(1, 5, 200))
    with quant_parity.fp8_inputs(block):
        assert torch.equal(block.q_proj(x), functional.linear(rounded, block.q_proj.weight))
        assert torch.equal(functional.linear(x, block.gate_up_proj[1]), rounded @ block.gate_up_proj[1].T)
        assert torch.equal(block.gate(x), x @ block.gate.weight.T)
    assert torch.equal(block.q_proj(x), x @ block.q_proj.weight.T)  # restored on leaving


def test_the_rounding_baseline_runs_transformers_with_rounded_inputs(tmp_path):
    """score_fp8_rounding on the tiny model: every position scored, off the oracle, close to it."""
    args = _args(tmp_path, "fp8")
    config = hf_parity.preset(args.preset)
    tokens_BL = hf_parity.make_tokens(config, 3, 12, args.seed)
    ref_BLV = hf_parity.oracle(config, args, tokens_BL)
    summary = hf_parity.score_fp8_rounding(config, args, tokens_BL, ref_BLV).summary(3, slice(0, 12))
    assert summary["positions"] == 36
    assert 0 < summary["mean_abs_err"] < 0.1 * ref_BLV.abs().mean().item()


def test_an_fp8_report_shows_the_rounding_column(tmp_path):
    result = hf_parity.run(_args(tmp_path, "fp8"))
    result["config"]["path"] = "fp8"  # as on a GPU with FP8 tensor cores (the CPU runs the reference path)
    for row in result["rows"]:
        row["hf_fp8_inputs"] = row["hf_bf16"]
        row.update(quant_parity.fp8_verdict(row["moemesh"], row["hf_bf16"], row["hf_fp8_inputs"], 0))
    text = hf_parity.render(result, "cmd")
    header = next(line for line in text.splitlines() if line.startswith("| batch"))
    assert "transformers fp32, FP8 inputs" in header and "same FP8 rounding" in text
    assert "agree drop / bound" in header
    widths = {line.count("|") for line in text.splitlines() if line.startswith("|")}
    assert len(widths) == 1  # every row has the header's columns

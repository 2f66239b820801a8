"""bench/accuracy/hf_parity.py on the CPU (tiny model, eager decode steps): the serving model passes against
transformers on the same weights, and a model with one wrong weight fails."""

import pytest

from bench.accuracy import hf_parity


def _args(tmp_path):
    return hf_parity.parse_args(["--device", "cpu", "--preset", "tiny", "--batches", "1,3", "--mixed", "4",
                                 "--prompt-tokens", "20", "--decode-tokens", "4", "--out", str(tmp_path)])


def test_the_serving_model_passes_at_every_batch_and_phase(tmp_path):
    assert hf_parity.main(["--device", "cpu", "--preset", "tiny", "--batches", "1,3", "--mixed", "5",
                           "--prompt-tokens", "21", "--decode-tokens", "4", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "hf_parity.md").read_text()
    assert "every row passes" in text
    # batch 1 decodes MIN_SEQS sequences one by one: 8 x 21 prompt positions, 8 x 4 decode positions;
    # the mixed run's 5 sequences: 2 prefilled whole, 3 in chunks of 10 and 11 beside their decodes
    assert "| 1 | prefill | 168 |" in text and "| 1 | decode | 32 |" in text and "| 3 | decode | 32 |" in text
    assert "| 5 mixed | prefill | 105 |" in text and "| 5 mixed | decode | 20 |" in text


def test_mixed_runs_need_two_sequences_and_two_decode_tokens(tmp_path):
    for flags in (["--mixed", "1"], ["--decode-tokens", "1"]):
        with pytest.raises(ValueError, match="--mixed"):
            hf_parity.run(hf_parity.parse_args(["--device", "cpu", "--preset", "tiny", *flags]))


@pytest.mark.parametrize("fault", ["o_proj", "one_expert"])
def test_a_wrong_weight_fails(tmp_path, fault):
    def corrupt(model):
        layer = model.layers[2]  # a MoE layer (1 is dense)
        if fault == "o_proj":  # everywhere: every position's error grows
            layer.w_o_DHK.mul_(1.1)
        else:  # one expert of one layer: only the positions routed to it
            layer.feed_forward.w_down_LDF[3].mul_(-1.0)
        return model

    result = hf_parity.run(_args(tmp_path), corrupt=corrupt)
    assert not result["ok"]
    assert all(row["hf_bf16"]["mean_abs_err"] > 0 for row in result["rows"])


def test_a_float8_cache_costs_decode_accuracy_and_says_so(tmp_path):
    """The KV cache in float8 (3 mantissa bits): decode steps read it back, so their error
    against the oracle grows past the bf16 cache's on the same positions."""
    bf16 = hf_parity.run(_args(tmp_path))
    args = _args(tmp_path)
    args.kv_cache_dtype = "fp8_e4m3"
    fp8 = hf_parity.run(args)
    assert bf16["config"]["kv_cache_dtype"] == "bfloat16" and fp8["config"]["kv_cache_dtype"] == "float8_e4m3fn"
    for a, b in zip(bf16["rows"], fp8["rows"]):
        if a["phase"] == "decode":
            assert b["moemesh"]["mean_abs_err"] > 1.5 * a["moemesh"]["mean_abs_err"], (a, b)

"""bench/kernels/decode_variants.py in miniature on the CPU: every variant at every batch size timed and
compared with base under its settings, which are put back after; bad settings refused before
anything runs.

The variant overrides an attribute of kernels.rotary, a kernel module: TRITON_INTERPRET=1 must be
set before it is first imported (interpreted kernel tests later in the session reuse the module),
so this file sets it first.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import json  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from bench.kernels import decode_variants  # noqa: E402
from tests.triton_interpreter import interpreted  # noqa: E402

ARGS = ["--device", "cpu", "--preset", "tiny", "--layers", "2", "--batch-sizes", "3,1", "--context", "8:40",
        "--steps", "2"]


def test_parse_variants_reads_literals_and_puts_base_first():
    assert decode_variants.parse_variants("a = graph_runner.log:None, runner.GREEDY:1.5; b=; c=runner.time:True") == {
        "base": {}, "a": {"graph_runner.log": None, "runner.GREEDY": 1.5}, "b": {}, "c": {"runner.time": True}}
    assert decode_variants.parse_variants("") == {"base": {}}
    for text in ("base=runner.time:1", "a=;a=", "=runner.time:1"):
        with pytest.raises(ValueError, match="variant names"):
            decode_variants.parse_variants(text)
    with pytest.raises(ValueError, match="literal"):
        decode_variants.parse_variants("a=runner.time:fast")


def test_variants_run_against_base_under_their_settings_then_restore(tmp_path, monkeypatch):
    with interpreted("kernels.rotary") as rotary:
        original, seen = rotary.QKV_ONE_TOKEN_STEPS, []
        run_variant = decode_variants.run_variant

        def spy(*args, **kwargs):
            seen.append(rotary.QKV_ONE_TOKEN_STEPS)
            return run_variant(*args, **kwargs)

        monkeypatch.setattr(decode_variants, "run_variant", spy)
        assert decode_variants.main(ARGS + ["--variants", "qkv64=kernels.rotary.QKV_ONE_TOKEN_STEPS:64", "--profile",
                                            "--rounds", "2", "--out", str(tmp_path)]) == 0
    # Two rounds per batch size, the variants in turn.
    assert seen == [original, 64] * 4 and rotary.QKV_ONE_TOKEN_STEPS == original
    report = json.loads((tmp_path / "decode_variants.json").read_text())
    rows = report["rows"]
    assert [(r["variant"], r["batch"], r["bucket"]) for r in rows] == [
        ("base", 3, 4), ("qkv64", 3, 4), ("base", 1, 1), ("qkv64", 1, 1)]
    for row in rows:
        assert "error" not in row and 0 < row["replay_ms"] <= row["wall_ms"], row
        assert len(row["replay_ms_by_round"]) == 2, row
        # One eager step, one capture, then a replay per step: the check's, and each StepRunner step.
        assert row["graph_counts"] == [1, 1, 1 + decode_variants.WARMUP_STEPS + 2], row
        # The CPU runs the torch code whatever the setting: same inputs, same logits.
        assert row["max_abs_diff"] == 0 and row["argmax_agree"] == 1 and row["max_abs_logit"] > 0, row
    assert set(report["profiles"]) == {"base", "qkv64"}
    assert all(0 < len(kernels) <= decode_variants.TOP_KERNELS for kernels in report["profiles"].values())
    table = (tmp_path / "decode_variants.md").read_text()
    for variant, batch in (("base", 3), ("qkv64", 3), ("base", 1), ("qkv64", 1)):
        assert f"\n| {variant} | {batch} | " in table


def test_a_dict_replaces_fields_of_a_dataclass_setting_then_the_original_is_back():
    with interpreted("kernels.moe_small") as moe_small:
        original = moe_small.ONE_TOKEN_MOE_TILES
        variants = decode_variants.parse_variants(
            "d=kernels.moe_small.ONE_TOKEN_MOE_TILES:{'down_o': 1, 'down_f': 1024}")
        with decode_variants.overridden(variants["d"]):
            tiles = moe_small.moe_tiles(1)
            assert (tiles.down_o, tiles.down_f) == (1, 1024)
            assert tiles.gate_up_d == original.gate_up_d and tiles.one_token
        assert moe_small.ONE_TOKEN_MOE_TILES is original


def test_the_gpu_sessions_variants_name_existing_knobs():
    """bench/gpu_session.sh's vars step: every knob of DECODE_VARIANTS resolves (else the run
    fails only on the lent GPU machine)."""
    script = (pathlib.Path(__file__).resolve().parents[3] / "bench" / "gpu_session.sh").read_text()
    text = re.search(r'^DECODE_VARIANTS="(.*?)"$', script, re.M | re.S).group(1).replace("\\\n", "")
    variants = decode_variants.parse_variants(text)
    assert len(variants) == 10 and "kernels.rotary.QKV_ONE_TOKEN_STEPS" in variants["qkv_blocks64"]


@pytest.mark.parametrize("flags, message", [
    (["--variants", "x=graph_runner.NO_SUCH:1"], "has no attribute 'NO_SUCH'"),  # found in expert_svc
    (["--variants", "x=no_such_module.A:1"], "no module 'no_such_module'"),
    (["--variants", "x=no_such_package.rotary.A:1"], "no module 'no_such_package.rotary'"),
    (["--variants", "x=kernels.rotary.NO_SUCH:1"], "services.model.kernels.rotary has no attribute"),
    (["--variants", "x=runner.time:1;y=moe.NO_SUCH:2"], "services.model.moe has no attribute"),
    (["--variants", "x=QKV_ONE_TOKEN_STEPS:1"], "must be module.attr"),
    (["--context", "4000:4096"], "fit the model's 4096 positions"),
    (["--exchanges", "pull"], "needs --ranks > 1"),
    (["--ranks", "2", "--exchanges", "push"], "distinct names of \\('collectives',\\) on cpu"),
    (["--ranks", "2", "--batch-sizes", "3"], "must be 2 x 1..256"),
    (["--ranks", "0"], "at least 1"),
])
def test_bad_settings_fail_before_anything_runs(tmp_path, monkeypatch, flags, message):
    monkeypatch.setattr(decode_variants, "build", lambda args: pytest.fail("built the model"))
    with pytest.raises(ValueError, match=message):
        decode_variants.main(ARGS + flags + ["--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_float8_cache(tmp_path):
    """--kv-cache-dtype fp8_e4m3: the pool in float8 (noise drawn in bf16, then narrowed)."""
    pools = []
    noise_pool = decode_variants.noise_pool

    def spy(*args):
        pools.append(noise_pool(*args))
        return pools[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decode_variants, "noise_pool", spy)
        assert decode_variants.main(ARGS + ["--batch-sizes", "3", "--kv-cache-dtype", "fp8_e4m3",
                                            "--out", str(tmp_path)]) == 0
    assert [pool.k_cache.dtype for pool in pools] == [torch.float8_e4m3fn]
    assert pools[0].k_cache.float().abs().max() > 0 and pools[0].v_cache.float().abs().max() > 0
    assert "fp8_e4m3" in (tmp_path / "decode_variants.md").read_text()


def test_two_ranks_split_the_batch_and_compare_with_one(tmp_path):
    """--ranks 2 (gloo on the CPU): each rank decodes half of each batch, its experts half of
    the model's; rows carry the slower rank's times and each rank's, the profile every rank's,
    and --baseline (a one-rank run) the speed-up over one rank. A two-rank baseline is refused."""
    common = ARGS[:ARGS.index("--batch-sizes")] + ["--batch-sizes", "4,2", "--context", "8:40", "--steps", "2"]
    assert decode_variants.main(common + ["--out", str(tmp_path / "one")]) == 0
    one = json.loads((tmp_path / "one" / "decode_variants.json").read_text())
    assert decode_variants.main(common + ["--ranks", "2", "--variants", "again=", "--profile", "--baseline",
                                          str(tmp_path / "one" / "decode_variants.json"),
                                          "--out", str(tmp_path / "two")]) == 0
    report = json.loads((tmp_path / "two" / "decode_variants.json").read_text())
    rows = report["rows"]
    assert [(r["variant"], r["exchange"], r["batch"], r["bucket"]) for r in rows] == [
        ("base", "collectives", 4, 2), ("again", "collectives", 4, 2),
        ("base", "collectives", 2, 1), ("again", "collectives", 2, 1)]
    base_ms = {r["batch"]: r["replay_ms"] for r in one["rows"]}
    for row in rows:
        assert "error" not in row and len(row["replay_ms_by_rank"]) == 2, row
        assert row["replay_ms"] == pytest.approx(max(row["replay_ms_by_rank"]), abs=1e-3), row
        assert row["vs_one_rank"] == pytest.approx(base_ms[row["batch"]] / row["replay_ms"]), row
        assert row["graph_counts"] == [1, 1, 1 + decode_variants.WARMUP_STEPS + 2], row
        assert row["max_abs_diff"] == 0 and row["argmax_agree"] == 1 and row["max_abs_logit"] > 0, row
    assert set(report["profiles"]) == {f"{v} / collectives, rank {r}" for v in ("base", "again") for r in (0, 1)}
    table = (tmp_path / "two" / "decode_variants.md").read_text()
    assert "\n| again | collectives | 2 | " in table and "vs one rank" in table
    with pytest.raises(ValueError, match="a run of 2 ranks, not one"):
        decode_variants.main(common + ["--baseline", str(tmp_path / "two" / "decode_variants.json"),
                                       "--out", str(tmp_path / "three")])


def test_the_gpu_sessions_exchanges_parse():
    """gpu_session.sh's `step` part asks for every exchange on CUDA: accepted there, in order;
    pull alone by default; only the collectives on the CPU."""
    args = decode_variants.parse_args(["--out", "x", "--ranks", "2", "--exchanges", "pull,push,signals,collectives"])
    assert decode_variants.parse_exchanges(args) == ["pull", "push", "signals", "collectives"]
    assert decode_variants.parse_exchanges(decode_variants.parse_args(["--out", "x", "--ranks", "2"])) == ["pull"]
    cpu = decode_variants.parse_args(["--out", "x", "--ranks", "2", "--device", "cpu"])
    assert decode_variants.parse_exchanges(cpu) == ["collectives"]
    step = next(line for line in (decode_variants.pathlib.Path(__file__).parents[3] / "bench" / "gpu_session.sh")
                .read_text().splitlines() if "STEP_EXCHANGES:-" in line and "--exchanges" in line)
    assert "pull,push,signals,collectives" in step

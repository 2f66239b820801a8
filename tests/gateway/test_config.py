"""The gateway's configuration: flags, env vars, validation, and docs/configuration.md."""

import dataclasses
import pathlib

import pytest

from expert_svc.config import ExpertConfig
from gateway.config import GatewayConfig
from services import settings

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


@pytest.mark.parametrize("cls", [GatewayConfig, ExpertConfig])
def test_every_knob_is_documented_with_its_flag_and_env_var(cls):
    text = DOC.read_text()
    for field in dataclasses.fields(cls):
        row = next((line for line in text.splitlines() if f"`{settings.flag(field.name)}`" in line), None)
        assert row is not None, f"{field.name} is missing from {DOC.name}"
        assert f"`{settings.env_var(field.name)}`" in row, field.name


def test_scheduler_knobs_come_from_flags_and_env():
    config = settings.parse_config(
        GatewayConfig, ["--member-id", "gw", "--model", "m", "--prefill-chunk-size", "64", "--policy", "lpm",
                        "--no-enable-prefix-cache"],
        env={"MOEMESH_MAX_WAITING_REQUESTS": "7", "MOEMESH_PREFILL_CHUNK_SIZE": "9",
             "MOEMESH_OVERLAP_STEPS": "off"})
    assert (config.prefill_chunk_size, config.policy, config.max_waiting_requests) == (64, "lpm", 7)
    assert config.enable_prefix_cache is False and config.overlap_steps is False


@pytest.mark.parametrize("field,value,needle", [
    ("prefill_chunk_size", -1, "prefill_chunk_size must be >= 0 (0: off), got -1"),
    ("tpot_target_ms", float("nan"), "tpot_target_ms must be >= 0 (0: off), got nan"),
    ("ttft_target_ms", -5.0, "ttft_target_ms must be >= 0 (0: off), got -5.0"),
    ("max_waiting_requests", -1, "max_waiting_requests must be positive, got -1"),
    ("policy", "sjf", "policy must be one of fcfs, lpm, got 'sjf'"),
    ("stats_interval_s", -1.0, "stats_interval_s must be >= 0, got -1.0"),
    ("max_running_requests", 9000, "max_running_requests (9000) must not exceed max_batch_tokens (8192)"),
])
def test_bad_values_are_refused_naming_the_value(field, value, needle):
    with pytest.raises(ValueError) as err:
        GatewayConfig(member_id="gw", model="m", **{field: value})
    assert needle in str(err.value)


def test_expert_kv_cache_dtype_from_flag_and_env():
    config = settings.parse_config(ExpertConfig, ["--member-id", "e0", "--model", "m", "--kv-cache-dtype", "fp8_e4m3"])
    assert config.kv_cache_dtype == "fp8_e4m3"
    config = settings.parse_config(ExpertConfig, ["--member-id", "e0", "--model", "m"],
                                   env={"MOEMESH_KV_CACHE_DTYPE": "fp8_e4m3"})
    assert config.kv_cache_dtype == "fp8_e4m3"
    assert ExpertConfig(member_id="e0", model="m").kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .*got 'fp16'"):
        ExpertConfig(member_id="e0", model="m", kv_cache_dtype="fp16")


def test_expert_ep_exchange_choices_and_device():
    config = settings.parse_config(ExpertConfig, ["--member-id", "e0", "--model", "m", "--device", "cuda",
                                                  "--ep-exchange", "symmetric"])
    assert config.ep_exchange == "symmetric"
    assert ExpertConfig(member_id="e0", model="m").ep_exchange == "auto"  # on the CPU: gloo, as nccl
    with pytest.raises(ValueError, match="ep_exchange must be one of .*got 'nvshmem'"):
        ExpertConfig(member_id="e0", model="m", device="cuda", ep_exchange="nvshmem")
    with pytest.raises(ValueError, match="ep_exchange 'symmetric' needs a CUDA device, got device 'cpu'"):
        ExpertConfig(member_id="e0", model="m", ep_exchange="symmetric")

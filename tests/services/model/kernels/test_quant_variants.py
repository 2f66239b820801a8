"""--quant-gemv-variants: the expert service's switch for the quantized kernels' batch-1 GEMV variants."""

import pytest
import torch

from expert_svc.config import ExpertConfig
from services.model.kernels import quant_awq, quant_awq_moe, quant_fp8
from services.model.kernels.quant_moe import ExpertGemms
from services.model.kernels.quant_variants import use_gemv_variants
from services.model.quant.experts import QuantExperts
from services.model.quant.formats import QuantConfig
from services.model.quant.linear import QuantWeight
from services.settings import parse_config


@pytest.fixture
def restore_knobs():
    yield
    use_gemv_variants(())


def test_the_flag_and_its_env_var_are_checked():
    assert ExpertConfig(member_id="e0", model="m").quant_gemv_variants == ()
    cfg = parse_config(ExpertConfig, ["--member-id", "e0", "--model", "m"],
                       env={"MOEMESH_QUANT_GEMV_VARIANTS": "awq-nibbles,fp8-pipelined"})
    assert cfg.quant_gemv_variants == ("awq-nibbles", "fp8-pipelined")
    with pytest.raises(ValueError, match=r"takes awq-nibbles, fp8-pipelined; not awq-tiles"):
        ExpertConfig(member_id="e0", model="m", quant_gemv_variants=("awq-nibbles", "awq-tiles"))


def test_variants_turn_the_knobs_on_and_off(restore_knobs):
    assert (quant_awq.ONE_ROW_GEMV, quant_awq_moe.ONE_TOKEN_TILES, quant_fp8.GEMV_PIPELINED) == (
        "groups", quant_awq_moe.GROUPED_TILES, False)
    assert quant_awq.default_tiles(1, 4096, 2048).gemv == "groups"
    assert use_gemv_variants(["awq-nibbles"]) == ("awq-nibbles",)
    assert quant_awq.default_tiles(1, 4096, 2048).gemv == "nibbles"
    assert quant_awq.default_tiles(2, 4096, 2048).gemv == "nibbles"  # only one row's GEMV changes
    assert quant_awq_moe.ONE_TOKEN_TILES == quant_awq_moe.NIBBLE_TILES
    assert not quant_fp8.GEMV_PIPELINED and quant_fp8.gemv_stages(3) == 0
    use_gemv_variants(("fp8-pipelined",))
    assert quant_fp8.GEMV_PIPELINED and quant_fp8.gemv_stages(3) == 3
    assert quant_awq.ONE_ROW_GEMV == "groups" and quant_awq_moe.ONE_TOKEN_TILES == quant_awq_moe.GROUPED_TILES
    with pytest.raises(ValueError, match="not fp8-tiles"):
        use_gemv_variants(("fp8-tiles",))


def test_a_layers_awq_experts_take_the_tiles_of_the_knob_when_built(restore_knobs):
    """ExpertGemms is built per step from the layer's stored tensors: it takes the one-token tiles
    the knob names then (cut to the checkpoint's group), so the variant needs no rebuilt model."""
    torch.manual_seed(0)
    awq = QuantConfig("awq", group_size=32)
    one = [tuple(QuantWeight.quantize(torch.randn(n, k), awq) for n, k in ((64, 160), (64, 160), (160, 64)))
           for _ in range(2)]
    experts = QuantExperts(*[QuantWeight.stack([w[p] for w in one], 0) for p in range(3)],
                           dtype=torch.float32, cache_dense=False)
    tiles = ExpertGemms(experts).one_token_tiles
    assert tiles.gemv == "groups"
    assert (tiles.gate_up_d, tiles.down_f) == (16, 8)  # GROUPED_TILES' slices fit a group of 32
    use_gemv_variants(("awq-nibbles",))
    tiles = ExpertGemms(experts).one_token_tiles
    assert tiles.gemv == "nibbles"
    assert (tiles.gate_up_d, tiles.down_f) == (32, 32)  # NIBBLE_TILES' 64 rows cut to the group


def test_the_expert_service_turns_them_on_before_it_builds_the_model(restore_knobs, caplog):
    from expert_svc.model_builder import ModelBuilder

    class Stop(Exception):
        pass

    def connect():  # the rendezvous comes after the weights: the knobs are set by then
        raise Stop

    builder = ModelBuilder(ExpertConfig(member_id="e0", random_weights="tiny", kv_blocks=64,
                                        quant_gemv_variants=("fp8-pipelined",)))
    with caplog.at_level("INFO", logger="expert_svc"), pytest.raises(Stop):
        builder.build(range(4), connect)
    assert quant_fp8.GEMV_PIPELINED and quant_awq.ONE_ROW_GEMV == "groups"
    assert "quantized GEMV variants on: fp8-pipelined" in caplog.text

"""The quantized layouts' arithmetic: AWQ's interleaved packing, FP8 block scales with
partial edge blocks, and the quantization_config a checkpoint declares."""

import pytest
import torch

from services.model.quant.formats import (
    AWQ_PACK_ORDER, FP8_MAX, QuantConfig, awq_dequantize, awq_pack, awq_quantize, awq_unpack, fp8_dequantize,
    fp8_quantize, fp8_scale_shape)


def test_awq_packs_columns_in_autoawqs_interleaved_order():
    # Columns 0..7 hold 0..7: bits 4i..4i+3 hold column AWQ_PACK_ORDER[i] = 0, 2, 4, 6, 1, 3, 5, 7.
    packed = awq_pack(torch.arange(8)[None, :])
    expected = sum(v << (4 * i) for i, v in enumerate((0, 2, 4, 6, 1, 3, 5, 7)))
    assert packed.dtype == torch.int32 and packed.tolist() == [[expected]]
    assert list(AWQ_PACK_ORDER) == [0, 2, 4, 6, 1, 3, 5, 7]


def test_awq_pack_unpack_round_trips_every_nibble_including_the_sign_bit():
    values = torch.randint(0, 16, (5, 3, 64), generator=torch.Generator().manual_seed(0))
    values[0, 0, :8] = 15  # all bits set: the int32 is -1
    packed = awq_pack(values)
    assert packed.shape == (5, 3, 8) and packed[0, 0, 0].item() == -1
    assert torch.equal(awq_unpack(packed).long(), values)


def test_awq_refuses_a_width_that_is_not_a_multiple_of_8():
    with pytest.raises(ValueError, match="width 12 is not a multiple of 8"):
        awq_pack(torch.zeros(2, 12, dtype=torch.int64))


def test_awq_quantize_stores_autoawq_shapes_and_dequantizes_within_half_a_step():
    w_NK = torch.randn(48, 96, generator=torch.Generator().manual_seed(1))
    qweight, qzeros, scales = awq_quantize(w_NK, 32)
    assert (qweight.shape, qzeros.shape, scales.shape) == ((96, 6), (3, 6), (3, 48))
    assert (qweight.dtype, qzeros.dtype, scales.dtype) == (torch.int32, torch.int32, torch.float16)
    back_NK = awq_dequantize(qweight, qzeros, scales, 32)
    step_NK = scales.float().repeat_interleave(32, 0).T
    assert ((back_NK - w_NK).abs() <= step_NK * 0.5 + 1e-3).all()
    # The weight is (q - z) * s of its group: recompute one element by hand.
    q, z = awq_unpack(qweight).float(), awq_unpack(qzeros).float()
    n, k = 5, 70
    assert back_NK[n, k] == (q[k, n] - z[k // 32, n]) * scales[k // 32, n].float()


def test_fp8_scales_have_one_per_block_with_partial_edge_blocks():
    n, k = 200, 160  # 2 x 2 blocks: the second row of blocks has 72 rows, the second column 32
    assert fp8_scale_shape(n, k) == (2, 2)
    w_NK = torch.zeros(n, k)
    amax = {(0, 0): 1.0, (0, 1): 2.0, (1, 0): 4.0, (1, 1): 8.0}
    for (bi, bj), value in amax.items():
        w_NK[bi * 128 + 3, bj * 128 + 5] = -value  # the block's largest magnitude, in its partial part too
        w_NK[bi * 128, bj * 128] = value / 3
    weight, scale_inv = fp8_quantize(w_NK)
    assert weight.dtype == torch.float8_e4m3fn and weight.shape == (n, k)
    assert scale_inv.dtype == torch.float32
    assert torch.equal(scale_inv, torch.tensor([[1.0, 2.0], [4.0, 8.0]]) / FP8_MAX)
    back = fp8_dequantize(weight, scale_inv)
    for (bi, bj), value in amax.items():
        assert weight[bi * 128 + 3, bj * 128 + 5].float() == -FP8_MAX  # the largest maps to -448
        assert back[bi * 128 + 3, bj * 128 + 5] == pytest.approx(-value, rel=1e-6)
    # Each element uses its own block's scale, edge blocks included.
    assert back[199, 159] == 0 and back[128, 128] == pytest.approx(8.0 / 3, rel=2 ** -3)


def test_fp8_quantize_dequantize_stays_within_fp8_rounding():
    w_NK = torch.randn(130, 257, generator=torch.Generator().manual_seed(2))
    weight, scale_inv = fp8_quantize(w_NK)
    assert scale_inv.shape == (2, 3)
    back = fp8_dequantize(weight, scale_inv)
    assert ((back - w_NK).abs() <= w_NK.abs() * 2 ** -4 + scale_inv.max() * 2 ** -9).all()


def test_quant_config_reads_the_published_configs_and_refuses_others():
    fp8 = QuantConfig.from_dict({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                 "weight_block_size": [128, 128]})
    assert fp8 == QuantConfig("fp8")
    awq = QuantConfig.from_dict({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                                 "version": "GEMM", "modules_to_not_convert": ["mlp.gate"]})
    assert awq == QuantConfig("awq", 128, ("mlp.gate",))
    assert QuantConfig.from_dict(awq.to_hub_dict()) == awq and QuantConfig.from_dict(fp8.to_hub_dict()) == fp8
    assert not awq.converts("model.layers.3.mlp.gate") and awq.converts("model.layers.3.mlp.gate_proj")
    for raw, message in [({"quant_method": "gptq"}, "quant_method 'gptq'"),
                         ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "weight_block_size"),
                         ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme"),
                         ({"quant_method": "awq", "bits": 8}, "bits 8"),
                         ({"quant_method": "awq", "version": "gemv"}, "version 'gemv'"),
                         ({"quant_method": "awq", "zero_point": False}, "zero_point False"),
                         # The wrong JSON types: refused by name, not an AttributeError or TypeError.
                         ("fp8", "must be a JSON object, got 'fp8'"),
                         ({"quant_method": "awq", "modules_to_not_convert": 3},
                          "modules_to_not_convert must be a list"),
                         ({"quant_method": "fp8", "modules_to_not_convert": ["lm_head", 128]},
                          "modules_to_not_convert must be a list of module names"),
                         ({"quant_method": "awq", "group_size": True}, "group_size True")]:
        with pytest.raises(ValueError, match=message):
            QuantConfig.from_dict(raw)

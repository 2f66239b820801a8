"""GetModelInfo: the ModelInfo built from a checkpoint's config, and the call over real gRPC."""

import asyncio

from gateway.model_info import FEATURE_CONSTRAINTS, FEATURE_N, FEATURE_PREFIX_CACHE, model_info
from moe.gateway.v1 import gateway_pb2
from services.model.config import ModelConfig
from tests.gateway.fakes import MODEL_INFO
from tests.gateway.test_engine import Gateway, make_engine, run

CONFIG = {
    "model_type": "qwen3_moe", "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_experts": 16, "num_experts_per_tok": 4, "max_position_embeddings": 2048, "torch_dtype": "bfloat16",
}


def test_model_info_comes_from_the_checkpoint_config_and_the_flags(tmp_path):
    model_dir = tmp_path / "qwen3-moe-demo"
    model_dir.mkdir()
    model = ModelConfig.from_dict(CONFIG)
    info = model_info(str(model_dir) + "/", model, context_length=1024, enable_prefix_cache=True)
    assert (info.model_name, info.architecture, info.context_length, info.vocab_size, info.dtype) == (
        "qwen3-moe-demo", "Qwen3MoeForCausalLM", 1024, 1000, "bfloat16")
    assert (info.num_experts, info.num_experts_per_tok) == (16, 4)
    assert info.features == (FEATURE_PREFIX_CACHE, FEATURE_CONSTRAINTS, FEATURE_N)
    float32 = {key: value for key, value in CONFIG.items() if key != "torch_dtype"} | {"dtype": "float32"}
    no_cache = model_info(str(model_dir), ModelConfig.from_dict(float32), context_length=2048,
                          enable_prefix_cache=False)
    assert no_cache.features == (FEATURE_CONSTRAINTS, FEATURE_N) and no_cache.dtype == "float32"


def test_get_model_info_reports_the_model_and_the_ranks_of_the_group():
    async def scenario():
        async with Gateway() as gw:
            without_group = await gw.stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=5)
            gw.engine, _ = make_engine(num_ranks=2)
            gw.loop_task = asyncio.create_task(gw.engine.run())
            with_group = await gw.stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=5)
            return without_group, with_group

    without_group, with_group = run(scenario())
    assert without_group.num_ranks == 0 and with_group.num_ranks == 2
    for answer in (without_group, with_group):
        assert (answer.model_name, answer.architecture, answer.context_length, answer.vocab_size, answer.dtype) == (
            MODEL_INFO.model_name, MODEL_INFO.architecture, MODEL_INFO.context_length, MODEL_INFO.vocab_size,
            MODEL_INFO.dtype)
        assert (answer.num_experts, answer.num_experts_per_tok) == (MODEL_INFO.num_experts,
                                                                    MODEL_INFO.num_experts_per_tok)
        assert list(answer.features) == ["prefix_cache"]

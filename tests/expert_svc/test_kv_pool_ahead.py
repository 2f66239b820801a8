"""ModelBuilder.prepare_kv_pool: a standby allocates its KV pool before any assignment, and
the join's build takes that pool (once) instead of allocating one on the recovery path; on CUDA
the build also warms the prompt attention (warm_prompt_attention) and the LM head's row counts
(warm_logits)."""

import pytest

from expert_svc.config import ExpertConfig
from expert_svc.model_builder import ModelBuilder


def test_the_pool_prepared_ahead_is_used_once():
    builder = ModelBuilder(ExpertConfig(member_id="e", random_weights="tiny", kv_blocks=64))
    builder.prepare_kv_pool()
    ahead = builder._ready_kv_pool
    assert ahead is not None and ahead.num_blocks == 64
    builder.prepare_kv_pool()  # idempotent: still the same pool
    assert builder.kv_pool() is ahead
    later = builder.kv_pool()  # a later build (after a failed rendezvous) gets a fresh one
    assert later is not ahead and later.num_blocks == 64


def test_a_pool_sized_by_free_cuda_memory_is_not_prepared_ahead(monkeypatch):
    builder = ModelBuilder(ExpertConfig(member_id="e", random_weights="tiny"))
    monkeypatch.setattr(type(builder.config), "is_cuda", property(lambda self: True))
    builder.prepare_kv_pool()  # kv_memory_fraction of what the weights leave free: only at the build
    assert builder._ready_kv_pool is None


class _Attention:
    def __init__(self):
        self.calls = []

    def warm_whole_prompts(self, *args):
        self.calls.append(args)
        return [1024, 2048]


class _Model:
    def __init__(self):
        self.attention = _Attention()
        self.warmed_rows = []

    def warm_logits(self, max_rows):
        self.warmed_rows.append(max_rows)


def test_prompt_attention_is_warmed_on_cuda_up_to_the_configured_tokens(monkeypatch):
    """On CUDA the build warms the prompt attention over its KV pool with the model's query heads and
    dtype up to --warm-prompt-tokens; not on the CPU, nor with 0."""
    builder = ModelBuilder(ExpertConfig(member_id="e", random_weights="tiny", kv_blocks=8, warm_prompt_tokens=2048))
    model, pool = _Model(), builder.kv_pool()
    builder.warm_prompt_attention(model, pool)
    assert model.attention.calls == []  # the CPU: nothing to prepare
    monkeypatch.setattr(type(builder.config), "is_cuda", property(lambda self: True))
    builder.warm_prompt_attention(model, pool)
    assert model.attention.calls == [(pool, builder.model_config.num_attention_heads, builder.dtype, 2048)]
    builder = ModelBuilder(ExpertConfig(member_id="e", random_weights="tiny", warm_prompt_tokens=0))
    builder.warm_prompt_attention(model, pool)
    assert len(model.attention.calls) == 1


def test_logits_are_warmed_on_cuda_up_to_the_configured_rows(monkeypatch):
    """On CUDA the build runs the LM head at every row count up to --warm-logit-rows (512 by
    default); not on the CPU, nor with 0; a negative count is refused."""
    builder, model = ModelBuilder(ExpertConfig(member_id="e", random_weights="tiny")), _Model()
    assert builder.config.warm_logit_rows == 512
    builder.warm_logits(model)
    assert model.warmed_rows == []  # the CPU: no lazily loaded kernels
    monkeypatch.setattr(type(builder.config), "is_cuda", property(lambda self: True))
    builder.warm_logits(model)
    assert model.warmed_rows == [512]
    ModelBuilder(ExpertConfig(member_id="e", random_weights="tiny", warm_logit_rows=0)).warm_logits(model)
    assert model.warmed_rows == [512]
    with pytest.raises(ValueError, match="warm_logit_rows must be >= 0"):
        ExpertConfig(member_id="e", model="m", warm_logit_rows=-1)

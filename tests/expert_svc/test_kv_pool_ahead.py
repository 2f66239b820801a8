"""ModelBuilder.prepare_kv_pool: a standby allocates its KV pool before any assignment, and
the join's build takes that pool (once) instead of allocating one on the recovery path."""

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

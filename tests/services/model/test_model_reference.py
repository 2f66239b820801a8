"""The serving forward against transformers' Qwen3-MoE, and paged KV against the full forward."""

import dataclasses
import random

import pytest
import torch

from services.kv_pool import KVPool
from services.model.batch import SeqInput, build_forward_batch
from services.model.checkpoint import load_weights
from services.model.config import ModelConfig
from services.model.make_model import make_random_checkpoint
from services.model.qwen3_moe import Qwen3MoeModel

BLOCK_SIZE = 4
NUM_BLOCKS = 48

BASE = ModelConfig(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # heads * head_dim = 128 != hidden
    intermediate_size=96,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    max_position_embeddings=256,
    dtype=torch.float32,
)

CONFIGS = {
    "untied": BASE,
    "tied-unnormalised": dataclasses.replace(BASE, tie_word_embeddings=True, norm_topk_prob=False),
    "dense-mixed": dataclasses.replace(BASE, num_hidden_layers=4, mlp_only_layers=(3,), decoder_sparse_step=2),
    "mha-hidden-eq": dataclasses.replace(BASE, num_key_value_heads=4, head_dim=16),
}


def _checkpoint(tmp_path, config, *, dtype=torch.float32, num_shards=1):
    make_random_checkpoint(tmp_path, config, seed=7, dtype=dtype, num_shards=num_shards, with_tokenizer=False)
    return tmp_path


def _model(model_dir, config) -> Qwen3MoeModel:
    weights = load_weights(model_dir, config, range(config.num_experts))
    return Qwen3MoeModel(config, weights, expert_ids=range(config.num_experts))


def _pool(config) -> KVPool:
    return KVPool.for_model(config, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu")


def _prompt(config, length, seed=0) -> list[int]:
    return torch.randint(config.vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _all_logits(model, config, token_ids, block_table) -> torch.Tensor:
    """Logits of every position of one prompt in one forward."""
    batch = build_forward_batch([SeqInput(0, token_ids, 0, block_table, True)], BLOCK_SIZE, "cpu")
    batch = dataclasses.replace(batch, sample_indices_S=torch.arange(len(token_ids)))
    return model.forward(batch, _pool(config))


def _hf_logits(model_dir, token_ids) -> torch.Tensor:
    from transformers import Qwen3MoeForCausalLM

    hf = Qwen3MoeForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers(tmp_path, name):
    config = CONFIGS[name]
    model_dir = _checkpoint(tmp_path, config)
    prompt = _prompt(config, 13)
    ours = _all_logits(_model(model_dir, config), config, prompt, list(range(4)))
    torch.testing.assert_close(ours, _hf_logits(model_dir, prompt), atol=1e-4, rtol=0)


def test_sharded_bf16_checkpoint_matches_transformers(tmp_path):
    config = CONFIGS["dense-mixed"]
    model_dir = _checkpoint(tmp_path, config, dtype=torch.bfloat16, num_shards=3)
    prompt = _prompt(config, 11)
    weights = load_weights(model_dir, config, range(config.num_experts))
    assert weights["model.norm.weight"].dtype == torch.bfloat16
    model = Qwen3MoeModel(config, weights, expert_ids=range(config.num_experts), dtype=torch.float32)
    ours = _all_logits(model, config, prompt, list(range(3)))
    torch.testing.assert_close(ours, _hf_logits(model_dir, prompt), atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def dense_mixed(tmp_path_factory):
    config = CONFIGS["dense-mixed"]
    model_dir = _checkpoint(tmp_path_factory.mktemp("dense-mixed"), config)
    return config, _model(model_dir, config)


def test_chunked_prefill_then_decode_through_scrambled_blocks(dense_mixed):
    config, model = dense_mixed
    tokens = _prompt(config, 21, seed=1)
    full = _all_logits(model, config, tokens, list(range(6)))
    kv = _pool(config)
    block_table = random.Random(0).sample(range(NUM_BLOCKS), 6)  # scattered, out of order
    # Prefill 12 tokens in chunks of 5, 4, 3 (crossing block edges), then decode one at a time.
    steps = [(0, 5), (5, 9), (9, 12)] + [(p, p + 1) for p in range(12, len(tokens))]
    for start, end in steps:
        seq = SeqInput(0, tokens[start:end], start, block_table, is_sampled=True)
        logits = model.forward(build_forward_batch([seq], BLOCK_SIZE, "cpu"), kv)
        torch.testing.assert_close(logits[0], full[end - 1], atol=1e-4, rtol=0)


def test_varlen_batch_equals_each_sequence_alone(dense_mixed):
    config, model = dense_mixed
    prompts = [_prompt(config, n, seed=n) for n in (9, 3, 14)]
    tables = [[0, 1, 2], [7], [3, 9, 4, 5]]
    alone = [_all_logits(model, config, p, t)[-1] for p, t in zip(prompts, tables)]
    # Sequence 0 decodes its last token, 1 prefills whole, 2 prefills a mid-sequence chunk.
    kv = _pool(config)
    warmup = [SeqInput(0, prompts[0][:8], 0, tables[0], False), SeqInput(2, prompts[2][:6], 0, tables[2], False)]
    model.forward(build_forward_batch(warmup, BLOCK_SIZE, "cpu"), kv)
    seqs = [
        SeqInput(0, prompts[0][8:], 8, tables[0], True),
        SeqInput(1, prompts[1], 0, tables[1], True),
        SeqInput(2, prompts[2][6:], 6, tables[2], True),
    ]
    logits = model.forward(build_forward_batch(seqs, BLOCK_SIZE, "cpu"), kv)
    torch.testing.assert_close(logits, torch.stack(alone), atol=1e-4, rtol=0)


def test_empty_batch_runs_and_counts_routed_tokens(dense_mixed):
    config, model = dense_mixed
    before = model.hit_counts_LE.clone()
    assert model.forward(build_forward_batch([], BLOCK_SIZE, "cpu"), _pool(config)).shape == (0, config.vocab_size)
    assert torch.equal(model.hit_counts_LE, before)
    _all_logits(model, config, _prompt(config, 5), [0, 1])
    added = model.hit_counts_LE - before
    assert added.shape == (len(config.moe_layers), config.num_experts)
    assert added.sum(dim=1).tolist() == [5 * config.num_experts_per_tok] * len(config.moe_layers)


def test_warm_logits_runs_the_lm_head_at_every_row_count(dense_mixed, monkeypatch):
    """warm_logits(n) takes the LM head through 1..n rows of the model's dtype, once each, and
    leaves the model's logits as they were."""
    config, model = dense_mixed
    tokens = _prompt(config, 7, seed=3)
    before = _all_logits(model, config, tokens, [0, 1])
    seen, real = [], model.logits

    def logits(x_SD, logits_SV=None):
        seen.append((x_SD.shape, x_SD.dtype))
        return real(x_SD, logits_SV)

    monkeypatch.setattr(model, "logits", logits)
    model.warm_logits(5)
    assert seen == [((rows, config.hidden_size), model.lm_head_VD.dtype) for rows in range(1, 6)]
    monkeypatch.undo()
    torch.testing.assert_close(_all_logits(model, config, tokens, [0, 1]), before, atol=0, rtol=0)


def test_rejects_expert_ids_other_than_the_rank_slice(dense_mixed):
    config, _ = dense_mixed
    with pytest.raises(ValueError, match="expert_ids"):
        Qwen3MoeModel(config, {}, expert_ids=range(4))


def test_build_forward_batch_slots_and_validation():
    seqs = [SeqInput(5, [1, 2, 3], 3, [9, 2], True), SeqInput(6, [4], 0, [7], False)]
    batch = build_forward_batch(seqs, BLOCK_SIZE, "cpu")
    assert batch.positions_T.tolist() == [3, 4, 5, 0]
    assert batch.slot_mapping_T.tolist() == [9 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1, 7 * 4]
    assert batch.sample_indices_S.tolist() == [2]
    assert batch.block_tables_BM.tolist() == [[9, 2], [7, 0]]
    assert (batch.q_lens, batch.context_lens) == ((3, 1), (6, 1))
    with pytest.raises(ValueError, match="needs 2"):
        build_forward_batch([SeqInput(1, [1, 2], 3, [0], True)], BLOCK_SIZE, "cpu")

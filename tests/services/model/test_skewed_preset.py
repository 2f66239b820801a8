"""The skewed random-weights presets: A tokens route to each layer's A experts (first half),
B tokens to its B experts (second half), the same from the same seed."""

import pytest
import torch

from services.kv_pool import KVPool
from services.model import random_weights
from services.model.batch import SeqInput, build_forward_batch
from services.model.qwen3_moe import Qwen3MoeModel
from services.model.random_weights import SKEW_B_MODULUS, RandomWeights, Skew, preset, preset_skew

CONFIG = preset("tiny-skewed")
SEED = 3


@pytest.fixture(scope="module")
def model():
    weights = RandomWeights.for_preset("tiny-skewed", CONFIG, range(CONFIG.num_experts), SEED,
                                       dtype=torch.float32, device="cpu")
    return Qwen3MoeModel(CONFIG, weights, expert_ids=range(CONFIG.num_experts))


def _hits(model, ids: list[int]) -> torch.Tensor:
    kv = KVPool.for_model(CONFIG, 16, 16, torch.float32, "cpu")
    before = model.hit_counts_LE.clone()
    model.forward(build_forward_batch([SeqInput(0, ids, 0, list(range(16)), True)], 16, "cpu"), kv)
    return model.hit_counts_LE - before


def test_the_skewed_presets_have_their_base_shapes_and_a_bias():
    assert preset("tiny-skewed") == preset("tiny")
    assert preset("qwen3-30b-a3b-skewed") == preset("qwen3-30b-a3b")
    assert preset_skew("tiny", CONFIG, 0) is None and preset_skew("tiny-skewed", CONFIG, 0) == Skew(CONFIG, 0)
    assert "tiny-skewed" in random_weights.preset_names()


def test_hot_experts_are_top_k_of_each_half_and_follow_the_seed():
    E, K = CONFIG.num_experts, CONFIG.num_experts_per_tok
    for layer in CONFIG.moe_layers:
        a, b = Skew(CONFIG, SEED).hot_experts(layer)
        assert len(a) == len(b) == K and all(e < E // 2 for e in a) and all(e >= E // 2 for e in b)
        assert Skew(CONFIG, SEED).hot_experts(layer) == (a, b)
    draws = {tuple(map(tuple, Skew(CONFIG, seed).hot_experts(0))) for seed in range(8)}
    assert len(draws) > 1, "the hot experts should depend on the seed"


@pytest.mark.parametrize("kind", ["A", "B"])
def test_tokens_of_a_kind_route_to_its_hot_experts(model, kind):
    ids = [SKEW_B_MODULUS * i + (SKEW_B_MODULUS - 1 if kind == "B" else 3) for i in range(1, 41)]
    hits = _hits(model, ids)
    for index, layer in enumerate(CONFIG.moe_layers):
        hot = Skew(CONFIG, SEED).hot_experts(layer)[kind == "B"]
        share = hits[index, hot].sum().item() / hits[index].sum().item()
        assert share >= 0.9, f"layer {layer}: {kind} tokens gave their hot experts {share:.2f} of the hits"


def test_random_prompts_load_the_first_half_most(model):
    ids = torch.randint(0, CONFIG.vocab_size, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    hits = _hits(model, ids)
    first, second = hits[:, :CONFIG.num_experts // 2].sum().item(), hits[:, CONFIG.num_experts // 2:].sum().item()
    assert first > 3 * second

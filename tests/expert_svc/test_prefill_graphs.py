"""The prefill graph runner (expert_svc/prefill_graphs.py) on the CPU: buckets, padding, the
pieces around an eager attention, padding hits taken back out, and a StepRunner routing its
steps with prompt tokens through it. The layer loop's kernels run under Triton's interpreter
(the pieces are the fused loop's); a stand-in "capture" returns the function itself, so a
replay runs the piece eagerly on the static buffers. The real capture runs on a GPU
(docs/performance.md, goodput).

TRITON_INTERPRET=1 must be set before the kernels are defined, so this file sets it first.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from expert_svc.config import ExpertConfig  # noqa: E402
from expert_svc.prefill_graphs import (EAGER_MAX_TOKENS, PrefillGraphRunner, make_prefill_graph_runner,  # noqa: E402
                                      prefill_buckets)
from expert_svc.runner import StepRunner  # noqa: E402
from services.kv_pool import KVPool  # noqa: E402
from services.model import qwen3_moe  # noqa: E402
from services.model.batch import SeqInput, build_forward_batch  # noqa: E402
from services.model.config import ModelConfig  # noqa: E402
from services.model.make_model import random_weights  # noqa: E402
from services.step import NewSequence, SamplingSpec, ScheduledSequence, StepPlan  # noqa: E402
from tests.expert_svc.test_graph_runner import StandInCapture  # noqa: E402
from tests.triton_interpreter import interpreted_fixture  # noqa: E402

fused_layer = interpreted_fixture("kernels.fused_layer")

BLOCK_SIZE = 4
BUCKETS = (24, 32, 48)
CONFIG = ModelConfig(vocab_size=96, hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, intermediate_size=64, moe_intermediate_size=24,
                     num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=64,
                     dtype=torch.float32)


@pytest.fixture(scope="module")
def weights():
    return random_weights(CONFIG, seed=11)


def _model(weights) -> qwen3_moe.Qwen3MoeModel:
    return qwen3_moe.Qwen3MoeModel(CONFIG, weights, expert_ids=range(CONFIG.num_experts))


def _pool() -> KVPool:
    return KVPool.for_model(CONFIG, 40, BLOCK_SIZE, torch.float32, "cpu")


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(CONFIG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prefill_buckets():
    assert prefill_buckets(300, per_octave=4, min_step=16) == (16, 32, 48, 64, 96, 128, 192, 256, 384)
    assert prefill_buckets(64, per_octave=4, min_step=16)[-1] == 64
    default = prefill_buckets(8192)
    assert default[0] == 64 and default[-1] == 8192 and len(default) == 40
    # No bucket pads a step by more than 1/16 of the power of two above it (at least 64 rows).
    assert all(b - a <= max(64, (1 << (a - 1).bit_length()) // 16 * 2) for a, b in zip(default, default[1:]))
    with pytest.raises(ValueError, match="positive"):
        prefill_buckets(0)


def test_config_flags():
    config = ExpertConfig(member_id="e", model="m")
    assert config.prefill_graph_tokens == 8192 and config.prefill_graph_lengths_per_octave == 16
    assert ExpertConfig(member_id="e", model="m", prefill_graph_tokens=0).prefill_graph_tokens == 0
    with pytest.raises(ValueError, match="prefill_graph_tokens must be >= 0"):
        ExpertConfig(member_id="e", model="m", prefill_graph_tokens=-1)
    with pytest.raises(ValueError, match="prefill_graph_lengths_per_octave must be positive"):
        ExpertConfig(member_id="e", model="m", prefill_graph_lengths_per_octave=0)


def test_no_runner_off_cuda_or_when_off(weights):
    model = _model(weights)
    assert make_prefill_graph_runner(model, 0) is None
    assert make_prefill_graph_runner(model, 512) is None  # the CPU: eager


def test_pieces_give_the_eager_forward(fused_layer, weights, monkeypatch):
    """Steps of 30, 21 and 41 tokens (buckets 32, 24 and 48: padded, the second over rows the first
    wrote), a prompt beside another, its next chunk beside a decode, then a decode beside a chunk:
    the logits, KV cache and expert hits of the eager fused loop, every bucket captured once
    before the first step; steps of up to EAGER_MAX_TOKENS tokens stay eager."""
    monkeypatch.setattr(qwen3_moe, "fused_kernels", lambda device: fused_layer.fused_layer_kernels())
    graphed, eager = _model(weights), _model(weights)
    pools = _pool(), _pool()
    capture = StandInCapture()
    runner = PrefillGraphRunner(graphed, fused_layer.fused_layer_kernels(), BUCKETS, capture)
    runner.capture_all()
    assert capture.num_captured == len(BUCKETS) * (CONFIG.num_hidden_layers + 1)
    assert int(graphed.hit_counts_LE.abs().sum()) == 0  # the capture's own runs are not counted
    a, b = _tokens(46, 1), _tokens(46, 2)
    tables = list(range(0, 12)), list(range(12, 24))
    steps = [[SeqInput(0, a[:25], 0, tables[0], True), SeqInput(1, b[:5], 0, tables[1], True)],
             [SeqInput(0, a[25:45], 25, tables[0], True), SeqInput(1, b[5:6], 5, tables[1], True)],
             [SeqInput(0, a[45:46], 45, tables[0], True), SeqInput(1, b[6:46], 6, tables[1], True)]]
    for seqs in steps:
        batch = build_forward_batch(seqs, BLOCK_SIZE, "cpu")
        assert runner.fits(batch.num_tokens)
        logits = runner.run(batch, pools[0])
        expected = eager.forward_at_capacity(batch, pools[1], eager.dispatch_capacity(batch.num_tokens))
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    assert runner.num_replays == len(steps)
    torch.testing.assert_close(pools[0].k_cache, pools[1].k_cache, atol=1e-5, rtol=0)
    torch.testing.assert_close(pools[0].v_cache, pools[1].v_cache, atol=1e-5, rtol=0)
    assert torch.equal(graphed.hit_counts_LE, eager.hit_counts_LE)
    assert runner.fits(EAGER_MAX_TOKENS + 1) and not runner.fits(EAGER_MAX_TOKENS) and not runner.fits(49)


def test_step_runner_takes_the_pieces_for_prompt_steps(fused_layer, weights, monkeypatch):
    """A StepRunner with prefill graphs samples the tokens of one without: a 60-token prompt (over
    the largest bucket: eager), a 20-token prompt beside a decode (replayed), two decodes (eager)."""
    monkeypatch.setattr(qwen3_moe, "fused_kernels", lambda device: fused_layer.fused_layer_kernels())
    greedy = SamplingSpec(temperature=0.0)
    prompts = _tokens(60, 3), _tokens(20, 4)
    steps = [dict(new_sequences=(NewSequence(0, greedy, tuple(range(0, 16))),),
                  scheduled=(ScheduledSequence(0, tuple(prompts[0])),)),
             dict(new_sequences=(NewSequence(1, greedy, tuple(range(16, 24))),),
                  scheduled=(ScheduledSequence(0), ScheduledSequence(1, tuple(prompts[1])))),
             dict(scheduled=(ScheduledSequence(0), ScheduledSequence(1)))]
    results = []
    for with_graphs in (False, True):
        model = _model(weights)
        graphs = None
        if with_graphs:
            graphs = PrefillGraphRunner(model, fused_layer.fused_layer_kernels(), BUCKETS, StandInCapture())
            graphs.capture_all()
        runner = StepRunner(model, _pool(), BLOCK_SIZE, vocab_size=CONFIG.vocab_size, prefill_graphs=graphs)
        results.append([runner.run_step(StepPlan(step_id=i + 1, group_id="", placement_epoch=0, **step)).tokens
                        for i, step in enumerate(steps)])
        if graphs is not None:
            assert graphs.num_replays == 1
    assert results[0] == results[1]
    assert all(tokens for tokens in results[1])

"""Piecewise prefill graphs (expert_svc/prefill_graphs.py) on a GPU, real captures (skipped without
one): steps with prompt tokens, padded to their buckets, give the eager forward's logits and
argmax, write the same KV, and count the same expert hits (bf16, FP8 and AWQ weights); a whole prompt of 1,024+ tokens
(torch's fused attention between the pieces), a chunk after a cached prefix and decodes beside it.

    python -m pytest -q tests/expert_svc/test_prefill_graphs_cuda.py
"""

import dataclasses

import pytest
import torch

from expert_svc.prefill_graphs import make_prefill_graph_runner
from services.kv_pool import KVPool
from services.model.batch import SeqInput, build_forward_batch
from services.model.qwen3_moe import Qwen3MoeModel
from services.model.random_weights import RandomWeights, preset

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BLOCK_SIZE = 16


def _model(name: str) -> Qwen3MoeModel:
    config = dataclasses.replace(preset(name), num_hidden_layers=2)
    weights = RandomWeights.for_preset(name, config, range(config.num_experts), 0, dtype=torch.bfloat16, device="cuda")
    return Qwen3MoeModel(config, weights, expert_ids=range(config.num_experts), dtype=torch.bfloat16,
                         device="cuda", attention="triton")


def _steps() -> list[list[SeqInput]]:
    """A 1,100-token prompt beside a 40-token one; then the first's 300-token chunk after its 1,100
    cached beside the second's decode; then a decode beside a 30-token chunk (1,140 / 301 / 31
    tokens: buckets 1,152, 320 and 64)."""
    def table(seq: int) -> list[int]:
        return list(range(seq * 100, seq * 100 + 100))

    long, short = [(7 * i) % 5000 + 3 for i in range(1400)], [11 * i % 3000 + 5 for i in range(41)]
    return [[SeqInput(0, long[:1100], 0, table(0), True), SeqInput(1, short[:40], 0, table(1), True)],
            [SeqInput(0, long[1100:1400], 1100, table(0), True), SeqInput(1, short[40:41], 40, table(1), True)],
            [SeqInput(0, [5], 1400, table(0), True), SeqInput(1, [9] * 30, 41, table(1), True)]]


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "qwen3-30b-a3b-fp8", "qwen3-30b-a3b-awq"])
def test_captured_pieces_give_the_eager_steps(name):
    graphed, eager = _model(name), _model(name)
    runner = make_prefill_graph_runner(graphed, 2048)
    assert runner is not None and runner.num_captures == len(runner.buckets) * (graphed.config.num_hidden_layers + 1)
    assert int(graphed.hit_counts_LE.abs().sum()) == 0
    pools = [KVPool.for_model(graphed.config, 200, BLOCK_SIZE, torch.bfloat16, "cuda") for _ in range(2)]
    for seqs in _steps():
        batch = build_forward_batch(seqs, BLOCK_SIZE, "cuda")
        assert runner.fits(batch.num_tokens)
        logits = runner.run(batch, pools[0])
        expected = eager.forward(batch, pools[1], max_tokens_per_rank=batch.num_tokens)
        # The pieces run the bucket's rows: the GEMMs may take other tiles than at the step's own
        # size, so a few bf16 roundings differ (the eager paths' own tolerance, docs/performance.md).
        torch.testing.assert_close(logits, expected, atol=0.1, rtol=0.02)
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    torch.testing.assert_close(pools[0].k_cache.float(), pools[1].k_cache.float(), atol=0.05, rtol=0.02)
    # Every real row counted K times a layer, no padding row: the same totals; near ties may route apart.
    assert torch.equal(graphed.hit_counts_LE.sum(-1), eager.hit_counts_LE.sum(-1))
    assert int((graphed.hit_counts_LE - eager.hit_counts_LE).abs().sum()) <= 0.02 * int(eager.hit_counts_LE.sum())
    assert runner.num_replays == 3 and not runner.fits(16)

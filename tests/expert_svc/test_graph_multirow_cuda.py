"""Expanded graph steps on a GPU (skipped without one): sequences with 1-8 new tokens each run as
a decode row per token through the decode graph runner, with real CUDA graph captures and the
Triton attention (every row's K/V stored before the decode kernel, which writes none). Their
logits and argmax are the eager chunk step's (the prefill kernel over the same tokens), their KV
too; the captured replay gives what the key's first, eager expanded step gave; and a StepRunner
taking jump-like chunks through the graphs samples the greedy tokens of one that runs eagerly.

    python -m pytest -q tests/expert_svc/test_graph_multirow_cuda.py
"""

import pytest
import torch

from expert_svc.graph_runner import DecodeGraphRunner
from expert_svc.runner import StepRunner
from services.kv_pool import KVPool
from services.model.batch import SeqInput, build_forward_batch
from services.model.checkpoint import load_weights
from services.model.qwen3_moe import Qwen3MoeModel
from services.step import NewSequence, SamplingSpec, ScheduledSequence, StepPlan
from tests.expert_svc.conftest import SMALL

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BLOCK_SIZE, BLOCKS_PER_SEQ, NUM_SEQS = 16, 4, 5
BUCKETS = (1, 2, 4, 8, 16)  # steps of up to 16 tokens: fused_moe's kernels in fp32 (see test_logprobs_cuda.py)
# fp32 on both sides, in other kernels and summation orders (the prefill kernel and row-batched
# GEMMs against the decode kernel); a wrong row (another position, a stale or missing K/V) is
# off by far more.
TOL = 1e-3
# Per case: (new tokens, cached context) of each sequence; rows <= 16.
CASES = {
    "mixed": [(1, 20), (3, 9), (8, 33), (2, 0), (2, 47)],
    "two long": [(8, 5), (8, 31)],
    "one chunk among decodes": [(1, 12), (5, 16), (1, 1), (1, 40)],
}


@pytest.fixture(scope="module")
def model(small_model_dir):
    weights = load_weights(small_model_dir, SMALL, range(SMALL.num_experts), dtype=torch.float32, device="cuda")
    return Qwen3MoeModel(SMALL, weights, expert_ids=range(SMALL.num_experts), dtype=torch.float32,
                         device="cuda", attention="triton")


def _pool(model) -> KVPool:
    """A KV pool of seeded noise: the sequences' cached contexts (the same in every pool)."""
    kv = KVPool.for_model(model.config, NUM_SEQS * BLOCKS_PER_SEQ, BLOCK_SIZE, torch.float32, "cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    kv.k_cache.normal_(0, 1, generator=g)
    kv.v_cache.normal_(0, 1, generator=g)
    return kv


def _seqs(case: str, seed: int) -> list[SeqInput]:
    g = torch.Generator().manual_seed(seed)
    return [SeqInput(i, torch.randint(0, SMALL.vocab_size, (n,), generator=g).tolist(), context,
                     list(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ)), True)
            for i, (n, context) in enumerate(CASES[case])]


@pytest.mark.parametrize("case", sorted(CASES))
def test_expanded_graph_steps_give_the_eager_chunks_logits_and_replays_the_eager_expanded_step(model, case):
    eager_kv, graph_kv = _pool(model), _pool(model)
    graphs = DecodeGraphRunner(model, graph_kv, BLOCK_SIZE, buckets=BUCKETS, max_blocks=BLOCKS_PER_SEQ)
    seqs = _seqs(case, seed=1)
    num_rows = sum(len(s.token_ids) for s in seqs)
    capacity = model.dispatch_capacity(num_rows)
    assert graphs.fits(seqs, capacity) and num_rows > len(seqs)
    expected_SV = model.forward(build_forward_batch(seqs, BLOCK_SIZE, "cuda"), eager_kv, max_tokens_per_rank=num_rows)
    first = graphs.run(seqs, capacity)  # the key's first step: eager, expanded
    first_SV, first_S = first.logits_SV.clone(), first.greedy_S.clone()
    assert graphs.num_eager == 1 and graphs.num_replays == 0
    torch.testing.assert_close(first_SV, expected_SV, atol=TOL, rtol=TOL)
    assert first_S.tolist() == expected_SV.argmax(-1).tolist()
    torch.testing.assert_close(graph_kv.k_cache, eager_kv.k_cache, atol=TOL, rtol=TOL)
    torch.testing.assert_close(graph_kv.v_cache, eager_kv.v_cache, atol=TOL, rtol=TOL)
    # The same step again (it rewrites the same K/V): captured, then replayed.
    replayed = graphs.run(seqs, capacity)
    assert graphs.num_captures == 1 and graphs.num_replays == 1
    torch.testing.assert_close(replayed.logits_SV, first_SV, atol=1e-6, rtol=1e-6)
    assert replayed.greedy_S.tolist() == first_S.tolist()
    # Other tokens and contexts of the same rows: a replay, against the eager chunk step.
    other = [SeqInput(s.seq_id, [(t * 7 + 3) % SMALL.vocab_size for t in s.token_ids], s.num_computed + 1,
                      s.block_table, True) for s in seqs]
    expected_SV = model.forward(build_forward_batch(other, BLOCK_SIZE, "cuda"), eager_kv,
                                max_tokens_per_rank=num_rows)
    out = graphs.run(other, capacity)
    assert graphs.num_replays == 2
    torch.testing.assert_close(out.logits_SV, expected_SV, atol=TOL, rtol=TOL)
    assert out.greedy_S.tolist() == expected_SV.argmax(-1).tolist()


def _plans() -> list[StepPlan]:
    """Prompts in one step, then decodes with a jump-like chunk of 1-7 forced tokens for one
    sequence in turn (the others fed from the device in the same step)."""
    d, greedy = ScheduledSequence, SamplingSpec(temperature=0.0)
    new = tuple(NewSequence(i, greedy, tuple(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ)))
                for i in range(3))
    plans = [StepPlan(1, "", 0, new, tuple(d(i, (5 + i, 9, 13, 2)) for i in range(3)), max_tokens_per_rank=12)]
    for step in range(2, 16):
        jumper, forced = step % 3, 1 + step % 7
        scheduled = [d(i) for i in range(3)]
        if step % 2:
            scheduled[jumper] = d(jumper, (40 + step, *range(60, 60 + forced)), num_forced=forced)
        plans.append(StepPlan(step, "", 0, scheduled=tuple(scheduled),
                              max_tokens_per_rank=sum(len(s.token_ids) or 1 for s in scheduled)))
    return plans


def test_a_runner_taking_chunks_through_graphs_samples_the_eager_runners_tokens(model):
    eager = StepRunner(model, _pool(model), BLOCK_SIZE, vocab_size=SMALL.vocab_size, device="cuda")
    kv = _pool(model)
    graphs = DecodeGraphRunner(model, kv, BLOCK_SIZE, buckets=BUCKETS, max_blocks=BLOCKS_PER_SEQ)
    graphed = StepRunner(model, kv, BLOCK_SIZE, vocab_size=SMALL.vocab_size, device="cuda", graphs=graphs)
    for plan in _plans():
        assert graphed.run_step(plan).tokens == eager.run_step(plan).tokens, plan.step_id
    assert graphs.num_replays > 0 and any(key[2] for key in graphs._replays)

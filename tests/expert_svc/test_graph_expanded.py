"""Expanded graph steps on the CPU: sequences with a few new tokens each (jump-forward chunks,
short prompt chunks) run through the decode graph runner as a decode row per token. Their logits,
KV and expert hits are the eager chunk step's; eligibility (the per-sequence cap, prompt logprobs,
the largest bucket) and the key's flag; fed tokens and draws through StepRunner. A stand-in
"capture" replays the captured work eagerly on the static tensors; the real capture runs on a GPU
(tests/expert_svc/test_graph_multirow_cuda.py)."""

import pytest
import torch

from expert_svc.graph_inputs import StaticInputs
from expert_svc.graph_runner import DecodeGraphRunner
from expert_svc.runner import StepRunner
from services.kv_pool import KVPool
from services.model.batch import SeqInput, build_decode_batch, build_forward_batch
from services.step import NewSequence, SamplingSpec, ScheduledSequence, StepPlan
from tests.expert_svc.conftest import SMALL
from tests.expert_svc.test_graph_runner import (BLOCK_SIZE, BLOCKS_PER_SEQ, NUM_BLOCKS, DeviceLensAttention,
                                                StandInCapture, make_model, rows_per_token, weights)

__all__ = ["weights"]  # the module fixture, shared with test_graph_runner.py
BUCKETS = (1, 2, 4, 8, 16)
GREEDY = SamplingSpec(temperature=0.0)
DRAWN = SamplingSpec(temperature=0.9, top_p=0.9, seed=7)


def graph_runner(model, capture=None, max_seq_tokens: int = 16) -> DecodeGraphRunner:
    model.attention = DeviceLensAttention()
    kv = KVPool.for_model(SMALL, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu")
    return DecodeGraphRunner(model, kv, BLOCK_SIZE, buckets=BUCKETS, max_blocks=BLOCKS_PER_SEQ,
                             capture=capture or StandInCapture(), max_seq_tokens=max_seq_tokens)


def table(seq_id: int) -> list[int]:
    return list(range(seq_id * BLOCKS_PER_SEQ, (seq_id + 1) * BLOCKS_PER_SEQ))


def test_fits_expanded_steps_within_the_cap_the_bucket_and_without_prompt_scores(weights):
    graphs = graph_runner(make_model(weights), max_seq_tokens=4)
    model = graphs.model
    decode = [SeqInput(i, [7], 5, table(i), True) for i in range(3)]
    chunk = SeqInput(5, [1, 2, 3, 4], 9, table(5), True)
    assert graphs.fits([*decode, chunk], model.dispatch_capacity(7))  # 7 rows: bucket 8
    assert graphs.step_bucket(7, model.dispatch_capacity(7)) == 8
    assert not graphs.fits([*decode, SeqInput(5, [1] * 5, 9, table(5), True)], model.dispatch_capacity(8))  # > cap
    assert not graphs.fits([*decode, chunk], 4 * rows_per_token())  # bucket 8 overflows 4 tokens' capacity
    scored = SeqInput(6, [1, 2], 0, table(6), False, is_scored=True)
    assert not graphs.fits([*decode, scored], model.dispatch_capacity(5))  # wants a row per token
    assert graphs.fits([*decode, SeqInput(6, [1], 0, table(6), True, is_scored=True)], model.dispatch_capacity(4))
    many = [SeqInput(i, [1, 2, 3], 0, table(i), True) for i in range(6)]  # 18 rows > the largest bucket
    assert not graphs.fits(many, model.dispatch_capacity(18))
    assert graphs.fits(many[:5], model.dispatch_capacity(15))


def _prefilled(weights, prompts: dict[int, list[int]]):
    """(graph runner, eager model, eager pool), both pools holding the prompts' KV."""
    graphs, eager_model = graph_runner(make_model(weights)), make_model(weights)
    eager_kv = KVPool.for_model(SMALL, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu")
    prefill = [SeqInput(i, p, 0, table(i), True) for i, p in prompts.items()]
    for model, kv in ((graphs.model, graphs.kv_pool), (eager_model, eager_kv)):
        model.forward(build_forward_batch(prefill, BLOCK_SIZE, "cpu"), kv)
    return graphs, eager_model, eager_kv


def test_expanded_rows_give_the_eager_chunks_logits_kv_and_hits_then_capture_and_replay(weights):
    prompts = {0: [5, 9, 13, 2, 44], 1: [3, 8, 100], 2: [400, 17, 17, 1, 9, 30, 7], 3: [71, 72]}
    graphs, eager_model, eager_kv = _prefilled(weights, prompts)
    # Several sequences with 1-4 new tokens each (a chunk starting mid-block), then the same key again.
    steps = [[SeqInput(0, [11, 12, 13], 5, table(0), True), SeqInput(1, [21], 3, table(1), True),
              SeqInput(2, [31, 32], 7, table(2), True), SeqInput(3, [41, 42, 43, 44], 2, table(3), True)],
             [SeqInput(0, [14, 15], 8, table(0), True), SeqInput(1, [22, 23, 24], 4, table(1), True),
              SeqInput(2, [33], 9, table(2), True)],
             [SeqInput(3, [45, 46, 47], 6, table(3), True), SeqInput(0, [16, 17, 18, 19], 10, table(0), True)]]
    for seqs in steps:
        num_rows = sum(len(s.token_ids) for s in seqs)
        capacity = graphs.model.dispatch_capacity(num_rows)
        assert graphs.fits(seqs, capacity)
        expected_SV = eager_model.forward(build_forward_batch(seqs, BLOCK_SIZE, "cpu"), eager_kv)
        out = graphs.run(seqs, capacity)
        torch.testing.assert_close(out.logits_SV, expected_SV, rtol=1e-5, atol=1e-5)
        assert out.greedy_S.tolist() == expected_SV.argmax(-1).tolist()
        torch.testing.assert_close(graphs.kv_pool.k_cache, eager_kv.k_cache)
        torch.testing.assert_close(graphs.kv_pool.v_cache, eager_kv.v_cache)
        # The chunk rows' hits count (as the eager chunk's tokens); the padding rows' are taken out.
        assert torch.equal(graphs.model.hit_counts_LE, eager_model.hit_counts_LE)
    # 10 rows, 6 rows: bucket 16 then 8 (eager, probed); 7 rows: bucket 8 again, captured and replayed.
    assert set(graphs._warmed) == {(16, graphs.model.dispatch_capacity(10), True),
                                   (8, graphs.model.dispatch_capacity(6), True)}
    assert (graphs.num_eager, graphs.num_captures, graphs.num_replays) == (2, 1, 1)


def test_static_inputs_of_an_expanded_step_are_build_decode_batchs_rows():
    inputs = StaticInputs(rows=8, max_blocks=4, device=torch.device("cpu"))
    seqs = [SeqInput(7, [11, 12, 13], 3, [3, 4], True), SeqInput(9, [14], 9, [5, 6, 7], True),
            SeqInput(2, [15, 16], 0, [1], False)]
    inputs.upload(seqs, BLOCK_SIZE, 8)
    host = build_decode_batch(seqs, BLOCK_SIZE, "cpu", num_rows=8, max_blocks=3, max_seq_tokens=3)
    assert host.is_expanded and host.is_decode and host.q_lens == (1,) * 8
    assert host.input_ids_T.tolist() == inputs.input_ids_R.tolist() == [11, 12, 13, 14, 15, 16, 0, 0]
    assert host.positions_T.tolist() == inputs.positions_R.tolist() == [3, 4, 5, 9, 0, 1, 0, 0]
    assert host.slot_mapping_T.tolist() == inputs.slots_R.tolist() == [15, 16, 17, 29, 4, 5, -1, -1]
    assert host.context_lens_B.tolist() == inputs.context_lens_R.tolist() == [4, 5, 6, 10, 1, 2, 0, 0]
    # Sequence i's logits row is its last token's row; then rows nobody reads.
    assert host.sample_indices_S.tolist() == inputs.sample_rows_R.tolist() == [2, 3, 5, 3, 4, 5, 6, 7]
    assert inputs.block_tables_RM[:, :3].tolist() == host.block_tables_BM.tolist() == [
        [3, 4, 0], [3, 4, 0], [3, 4, 0], [5, 6, 7], [1, 0, 0], [1, 0, 0], [0, 0, 0], [0, 0, 0]]
    # A decode step after it: row i is sequence i again.
    inputs.upload([SeqInput(1, [5], 6, [2, 8], True)], BLOCK_SIZE, 2)
    assert inputs.sample_rows_R.tolist()[:2] == [0, 1] and inputs.context_lens_R.tolist()[:2] == [7, 0]
    with pytest.raises(ValueError, match="do not fit"):
        inputs.upload(seqs, BLOCK_SIZE, 4)


def _new(seq_id, sampling=GREEDY):
    return NewSequence(seq_id, sampling, tuple(table(seq_id)))


def _plans() -> list[StepPlan]:
    """Short prompts as one expanded prefill step, decodes fed from the device around
    jump-like chunks (explicit tokens, forced ones among them), a new sequence's short prompt
    beside decodes, a chunk longer than the cap (eager), an idle step."""
    d = ScheduledSequence
    steps = [dict(new_sequences=(_new(0), _new(1, DRAWN), _new(2)),
                  scheduled=(d(0, (5, 9, 13, 2)), d(1, (3, 8, 100)), d(2, (400, 17, 17, 1, 9)))),
             dict(scheduled=(d(0), d(1), d(2)))]
    for i in range(3):  # the same expanded key thrice (eager, capture, replay), decodes fed after a chunk
        steps += [dict(scheduled=(d(i, (60 + i, 61, 62), num_forced=2), *(d(j) for j in range(3) if j != i)))]
        steps += [dict(scheduled=(d(0), d(1), d(2)))]
    steps += [dict(new_sequences=(_new(3, DRAWN),), scheduled=(d(0), d(3, (71, 72, 73)), d(1), d(2)))]
    steps += [dict(scheduled=(d(0), d(1, (80, 81, 82, 83, 84, 85)), d(2), d(3)))]  # > max_seq_tokens 5: eager
    steps += [dict(), dict(scheduled=(d(0), d(1), d(2), d(3)))]
    return [StepPlan(i + 1, "", 0, **step, max_tokens_per_rank=sum(len(s.token_ids) or 1 for s in
                                                                  step.get("scheduled", ())))
            for i, step in enumerate(steps)]


def test_steps_with_chunks_give_the_eager_tokens_through_expanded_graphs(weights):
    eager_model, graph_model = make_model(weights), make_model(weights)
    eager = StepRunner(eager_model, KVPool.for_model(SMALL, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu"),
                       BLOCK_SIZE, vocab_size=SMALL.vocab_size)
    graphs = graph_runner(graph_model, max_seq_tokens=5)
    graphed = StepRunner(graph_model, graphs.kv_pool, BLOCK_SIZE, vocab_size=SMALL.vocab_size, graphs=graphs)
    for plan in _plans():
        assert graphed.run_step(plan).tokens == eager.run_step(plan).tokens, plan.step_id
    assert torch.equal(graph_model.hit_counts_LE, eager_model.hit_counts_LE)
    expanded = {key for key in graphs._warmed if key[2]}
    # The prefill (12 rows: bucket 16); the chunks (5 rows) and the new prompt (6 rows) share bucket 8.
    assert {key[0] for key in expanded} == {16, 8} and len(expanded) == 2
    assert any(key in graphs._replays for key in expanded)
    assert graphs.num_eager == len(graphs._warmed)  # every key ran eagerly once, then was captured

"""Jump-forward in the batcher: forced tokens a rank reports become one chunk of the sequence, under
overlap or not, within max_new_tokens and the token budget, cut by a stop string, and only on."""

import dataclasses

import pytest

from gateway.requests import FinishReason
from services.step import LogprobSpec
from tests.gateway.fakes import make_request
from tests.gateway.test_batcher import add, make_batcher, outputs_of

F = (40, 41, 42, 43)   # the forced tokens a rank reports (letters o, p, q, r)


def plan_of(batch, seq):
    (sched,) = [s for s in batch.plans[0].scheduled if s.seq_id == seq.seq_id]
    return sched


def tokens_of(events, seq) -> list[int]:
    return [t for o in outputs_of(events, seq) for t in o.token_ids]


def prefilled(batcher, num_prompt=4, **request):
    """A sequence whose prompt step has been sent (its first token in flight), and that step."""
    seq = add(batcher, make_request(num_prompt, **request))
    return seq, batcher.schedule()


def test_under_overlap_the_forced_tokens_after_the_decode_in_flight_are_one_chunk():
    batcher = make_batcher(jump_forward=True)
    seq, first = prefilled(batcher)
    second = batcher.schedule()                          # a decode feeding the first token, in flight
    assert plan_of(second, seq).token_ids == ()
    events = batcher.apply_results(first.step_id, {seq.seq_id: 30}, forced={seq.seq_id: F})
    third = batcher.schedule()                           # planned before the second step's token is known
    chunk = plan_of(third, seq)
    # The rank emits F[0] at the second step; the chunk feeds it and the rest, sampling after F[-1].
    assert chunk.token_ids == F and chunk.num_forced == 3 and chunk.is_sampled
    assert third.plans[0].num_tokens == 4 and seq.num_computed == 4 + 1 + 4
    events += batcher.apply_results(second.step_id, {seq.seq_id: F[0]})
    events += batcher.apply_results(third.step_id, {seq.seq_id: 35})
    assert tokens_of(events, seq) == [30, *F, 35]
    assert [len(o.token_ids) for o in outputs_of(events, seq)] == [1] * 6   # streamed like sampled ones
    assert outputs_of(events, seq)[-1].completion_tokens == 6
    assert batcher.stats.num_jump_forward_tokens == 3
    assert plan_of(batcher.schedule(), seq).token_ids == ()                # then decodes again


def test_without_overlap_the_chunk_feeds_the_last_token_and_every_forced_one():
    batcher = make_batcher(jump_forward=True)
    seq, first = prefilled(batcher)
    events = batcher.apply_results(first.step_id, {seq.seq_id: 30}, forced={seq.seq_id: F})
    chunk = plan_of(second := batcher.schedule(), seq)
    assert chunk.token_ids == (30, *F) and chunk.num_forced == 4
    events += batcher.apply_results(second.step_id, {seq.seq_id: 35})
    assert tokens_of(events, seq) == [30, *F, 35]


def test_max_new_tokens_and_the_token_budget_cut_the_chunk():
    batcher = make_batcher(jump_forward=True)
    seq, first = prefilled(batcher, max_new_tokens=4)
    batcher.apply_results(first.step_id, {seq.seq_id: 30}, forced={seq.seq_id: F})
    # One token out, the chunk's sampled one last: two forced tokens fit.
    chunk = plan_of(second := batcher.schedule(), seq)
    assert chunk.token_ids == (30, *F[:2]) and chunk.num_forced == 2
    events = batcher.apply_results(second.step_id, {seq.seq_id: 35})
    assert tokens_of(events, seq) == [*F[:2], 35] and outputs_of(events, seq)[-1].finish_reason is FinishReason.LENGTH

    batcher = make_batcher(max_batch_tokens=3, max_running_requests=2, jump_forward=True)
    seq, first = prefilled(batcher, 2, max_new_tokens=50)
    batcher.apply_results(first.step_id, {seq.seq_id: 30}, forced={seq.seq_id: F})
    assert plan_of(batcher.schedule(), seq).token_ids == (30, *F[:2])


def test_a_stop_string_inside_the_forced_tokens_ends_the_request_there():
    batcher = make_batcher(jump_forward=True)
    seq, first = prefilled(batcher, stops=("pq",))
    batcher.apply_results(first.step_id, {seq.seq_id: 30}, forced={seq.seq_id: F})
    second = batcher.schedule()
    events = batcher.apply_results(second.step_id, {seq.seq_id: 35})
    last = outputs_of(events, seq)[-1]
    assert last.finish_reason is FinishReason.STOP and last.matched_stop == "pq"
    assert tokens_of(events, seq) == [40, 41, 42] and seq.is_finished   # the rest and the sampled token dropped


def test_off_or_with_a_chunk_in_flight_reports_are_ignored():
    batcher = make_batcher(jump_forward=False)
    seq, first = prefilled(batcher)
    batcher.apply_results(first.step_id, {seq.seq_id: 30}, forced={seq.seq_id: F})
    assert plan_of(batcher.schedule(), seq).token_ids == ()

    batcher = make_batcher(jump_forward=True)
    seq, first = prefilled(batcher)
    second = batcher.schedule()
    batcher.apply_results(first.step_id, {seq.seq_id: 30}, forced={seq.seq_id: F})
    third = batcher.schedule()                           # the chunk
    # The rank reports what is forced after F[0] too; the chunk in flight covers it already.
    batcher.apply_results(second.step_id, {seq.seq_id: F[0]}, forced={seq.seq_id: F[1:]})
    assert plan_of(batcher.schedule(), seq).token_ids == ()
    batcher.apply_results(third.step_id, {seq.seq_id: 35})


def test_a_token_that_is_not_the_one_the_chunk_in_flight_feeds_is_refused():
    batcher = make_batcher(jump_forward=True)
    seq, first = prefilled(batcher)
    second = batcher.schedule()
    batcher.apply_results(first.step_id, {seq.seq_id: 30}, forced={seq.seq_id: F})
    batcher.schedule()
    with pytest.raises(ValueError, match="jump-forward chunk in flight feeds 40"):
        batcher.apply_results(second.step_id, {seq.seq_id: 39})


def test_a_sequence_that_reports_logprobs_decodes_each_forced_token():
    """Every output token of a request with logprobs carries its log-probability, which only a
    sampled token has: its forced tokens come one decode step each (the rank still forces them)."""
    batcher = make_batcher(jump_forward=True)
    seq = add(batcher, dataclasses.replace(make_request(4), logprobs=LogprobSpec(logprobs=True)))
    first = batcher.schedule()
    second = batcher.schedule()
    batcher.apply_results(first.step_id, {seq.seq_id: 30}, forced={seq.seq_id: F})
    assert plan_of(batcher.schedule(), seq).token_ids == ()      # a decode, not a chunk
    batcher.apply_results(second.step_id, {seq.seq_id: F[0]}, forced={seq.seq_id: F[1:]})
    assert seq.jump is None and batcher.stats.num_jump_forward_tokens == 0


def test_a_run_shorter_than_the_minimum_is_decoded_step_by_step():
    batcher = make_batcher(jump_forward=True, jump_forward_min_tokens=5)
    seq, first = prefilled(batcher)
    events = batcher.apply_results(first.step_id, {seq.seq_id: 30}, forced={seq.seq_id: F})   # 4 forced
    second = batcher.schedule()
    assert plan_of(second, seq).token_ids == () and plan_of(second, seq).num_forced == 0
    events += batcher.apply_results(second.step_id, {seq.seq_id: F[0]})
    assert tokens_of(events, seq) == [30, F[0]] and batcher.stats.num_jump_forward_tokens == 0

    batcher = make_batcher(jump_forward=True, jump_forward_min_tokens=4)   # as long as the run: taken
    seq, first = prefilled(batcher)
    batcher.apply_results(first.step_id, {seq.seq_id: 30}, forced={seq.seq_id: F})
    assert plan_of(batcher.schedule(), seq).num_forced == 4

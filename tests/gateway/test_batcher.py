"""The batcher: admission, placement, idle plans, finish reasons, block freeing.

Chunked prefill, the prefix cache, preemption, overlap and deadlines are in
test_scheduling.py.
"""

import pytest

from gateway.batcher import Batcher
from gateway.kv_accounting import RankKV
from gateway.requests import ErrorCode, FinishReason, GenerationError, RequestOutput, Sequence
from services.text import IncrementalDetokenizer
from tests.gateway.fakes import EOS, FakeTokenizer, make_request

def make_batcher(num_ranks=1, *, num_blocks=64, block_size=4, max_running_requests=8,
                 max_batch_tokens=64, max_context=1000, is_prefix_cached=True, **kwargs) -> Batcher:
    return Batcher([RankKV(num_blocks, block_size, enable_prefix_cache=is_prefix_cached)
                    for _ in range(num_ranks)],
                   max_running_requests=max_running_requests, max_batch_tokens=max_batch_tokens,
                   max_context=max_context, eos_token_ids=[EOS], **kwargs)


def add(batcher: Batcher, request, deadline=None) -> Sequence:
    seq = Sequence(batcher.new_seq_id(), request, IncrementalDetokenizer(FakeTokenizer()), deadline=deadline)
    batcher.add(seq)
    return seq


def step(batcher: Batcher, sample=lambda seq_id: 30):
    """One step with every sampled sequence drawing sample(seq_id): (batch, events)."""
    batch = batcher.schedule()
    tokens = {s.seq_id: sample(s.seq_id) for p in batch.plans for s in p.scheduled if s.is_sampled}
    events = batch.events
    if not batch.is_empty:
        events = events + batcher.apply_results(batch.step_id, tokens)
    return batch, events


def assert_all_blocks_back(batcher: Batcher) -> None:
    """The pools' own accounting: no table left, every block free or cached unreferenced."""
    for kv in batcher.ranks:
        kv.check_invariants()
        assert kv.num_available == kv.num_blocks
        assert not any(kv.has_sequence(i) for i in range(1, batcher.new_seq_id()))


def scheduled_ids(batch, rank=0) -> list[int]:
    return [s.seq_id for s in batch.plans[rank].scheduled]


def outputs_of(events, seq) -> list[RequestOutput]:
    return [item for s, item in events if s is seq]


def test_admission_respects_the_token_budget_fcfs():
    batcher = make_batcher(max_batch_tokens=10)
    a, b, c, d = (add(batcher, make_request(4, request_id=x, prompt_ids=[30 + i] * 4))
                  for i, x in enumerate("abcd"))
    batch, _ = step(batcher)
    # 4 + 4, then the 2 tokens left of the budget start c's prompt (chunked); d waits.
    assert scheduled_ids(batch) == [a.seq_id, b.seq_id, c.seq_id]
    assert [n.seq_id for n in batch.plans[0].new_sequences] == [a.seq_id, b.seq_id, c.seq_id]
    assert [(len(s.token_ids), s.is_sampled) for s in batch.plans[0].scheduled] == [
        (4, True), (4, True), (2, False)]
    assert batch.plans[0].num_tokens == 10 and list(batcher.waiting) == [d]
    batch, _ = step(batcher)
    # Decodes first (1 token each), then the rest of c's prompt, then d's first 6 tokens... of 4.
    assert scheduled_ids(batch) == [a.seq_id, b.seq_id, c.seq_id, d.seq_id]
    assert [(len(s.token_ids), s.is_sampled) for s in batch.plans[0].scheduled] == [
        (0, True), (0, True), (2, True), (4, True)]


def test_head_of_line_waits_rather_than_being_overtaken():
    batcher = make_batcher(num_blocks=6, block_size=4, max_batch_tokens=64)
    add(batcher, make_request(12, request_id="a", max_new_tokens=50))      # 3 blocks
    big = add(batcher, make_request(request_id="big", prompt_ids=[31] * 12))  # 3 more + the watermark
    small = add(batcher, make_request(1, request_id="small"))               # would fit
    batch, _ = step(batcher)
    assert len(batch.plans[0].scheduled) == 1
    assert list(batcher.waiting) == [big, small]


def test_running_cap_holds_requests_back_until_one_finishes():
    batcher = make_batcher(max_running_requests=2)
    a = add(batcher, make_request(2, max_new_tokens=1, request_id="a"))
    b = add(batcher, make_request(2, max_new_tokens=3, request_id="b"))
    c = add(batcher, make_request(2, request_id="c"))
    batch, events = step(batcher)
    assert scheduled_ids(batch) == [a.seq_id, b.seq_id]
    assert outputs_of(events, a)[-1].finish_reason is FinishReason.LENGTH
    batch, _ = step(batcher)
    assert batch.plans[0].finished_seq_ids == [a.seq_id]
    assert scheduled_ids(batch) == [b.seq_id, c.seq_id]


def test_placement_spreads_over_ranks_by_running_tokens():
    batcher = make_batcher(num_ranks=3, block_size=8)
    seqs = [add(batcher, make_request(n, request_id=str(n))) for n in (8, 4, 5, 1, 3)]
    batch, _ = step(batcher)
    # 8 -> rank 0, 4 -> rank 1 (0 tokens), 5 -> rank 2 (0 tokens), 1 -> rank 1 (4 < 5 < 8 tokens);
    # 3: ranks 1 and 2 both run 5 tokens, rank 2 in one block, rank 1 in two: rank 2.
    assert [s.rank for s in seqs] == [0, 1, 2, 1, 2]
    for rank in range(3):
        assert sorted(scheduled_ids(batch, rank)) == sorted(s.seq_id for s in seqs if s.rank == rank)


def test_placement_skips_a_rank_without_free_blocks():
    batcher = make_batcher(num_ranks=2, num_blocks=4, block_size=4)
    first = add(batcher, make_request(11, max_new_tokens=50, request_id="big"))   # 3 blocks of rank 0
    step(batcher)
    small = add(batcher, make_request(1, request_id="small"))
    second = add(batcher, make_request(6, request_id="mid"))   # needs 2 blocks: only rank 1 has them
    step(batcher)
    assert first.rank == 0 and small.rank == 1 and second.rank == 1


def test_every_rank_gets_a_plan_and_idle_ranks_get_empty_ones():
    batcher = make_batcher(num_ranks=3)
    add(batcher, make_request(4))
    batch, _ = step(batcher)
    assert [p.rank for p in batch.plans] == [0, 1, 2]
    assert [len(p.scheduled) for p in batch.plans] == [1, 0, 0]
    assert not batch.plans[1].new_sequences and not batch.plans[1].finished_seq_ids


def test_step_ids_are_consecutive_and_work_stops_when_done():
    batcher = make_batcher()
    assert not batcher.has_work
    add(batcher, make_request(2, max_new_tokens=2))
    step_ids = []
    while batcher.has_work:
        batch, _ = step(batcher)
        step_ids.append(batch.step_id)
    # prefill, decode (LENGTH), then the step that tells the rank to forget it.
    assert step_ids == [1, 2, 3]


def test_eos_stops_counts_the_token_but_emits_no_text():
    batcher = make_batcher()
    seq = add(batcher, make_request(2, max_new_tokens=10))
    _, events = step(batcher, lambda _: 26)       # "a"
    _, events2 = step(batcher, lambda _: EOS)
    first, last = outputs_of(events, seq)[0], outputs_of(events2, seq)[0]
    assert first.text == "a" and first.finish_reason is None
    assert last.token_ids == (EOS,) and last.text == "" and last.finish_reason is FinishReason.STOP
    assert last.completion_tokens == 2 and last.prompt_tokens == 2 and last.matched_stop == ""


def test_ignore_eos_keeps_generating_until_max_new_tokens():
    batcher = make_batcher()
    seq = add(batcher, make_request(2, max_new_tokens=3, ignore_eos=True))
    events = []
    while batcher.has_work:
        events += step(batcher, lambda _: EOS)[1]
    outputs = outputs_of(events, seq)
    assert [o.token_ids for o in outputs] == [(EOS,)] * 3
    assert outputs[-1].finish_reason is FinishReason.LENGTH and outputs[-1].completion_tokens == 3
    assert "".join(o.text for o in outputs) == "<eos>" * 3


def test_max_context_ends_generation_with_length():
    batcher = make_batcher(max_context=6)
    seq = add(batcher, make_request(4, max_new_tokens=10))
    events = []
    while batcher.has_work:
        events += step(batcher)[1]
    assert outputs_of(events, seq)[-1].finish_reason is FinishReason.LENGTH
    assert len(seq.output_ids) == 2


def test_stop_string_cuts_the_text_and_is_reported():
    batcher = make_batcher()
    seq = add(batcher, make_request(2, max_new_tokens=20, stops=["cd"]))
    letters = iter([26 + 1, 26 + 2, 26 + 3, 26 + 4])   # b c d e
    events = []
    while batcher.has_work:
        events += step(batcher, lambda _: next(letters))[1]
    outputs = outputs_of(events, seq)
    assert "".join(o.text for o in outputs) == "b"
    assert outputs[-1].finish_reason is FinishReason.STOP and outputs[-1].matched_stop == "cd"
    assert outputs[-1].completion_tokens == 3 and sum(len(o.token_ids) for o in outputs) == 3


def test_held_back_text_is_released_at_length():
    batcher = make_batcher()
    seq = add(batcher, make_request(2, max_new_tokens=2, stops=["bz"]))
    events = []
    while batcher.has_work:
        events += step(batcher, lambda _: 27)[1]     # "b", "b": each could start "bz"
    outputs = outputs_of(events, seq)
    # Each "b" could start "bz": the first is held back, the last one released at the end.
    assert [o.text for o in outputs] == ["", "bb"]
    assert outputs[-1].finish_reason is FinishReason.LENGTH and outputs[-1].matched_stop == ""


def test_finished_sequences_are_forgotten_and_their_blocks_freed():
    batcher = make_batcher(num_blocks=16, block_size=4, is_prefix_cached=False)
    allocator = batcher.ranks[0]
    a = add(batcher, make_request(6, max_new_tokens=1, request_id="a"))
    b = add(batcher, make_request(3, max_new_tokens=4, request_id="b"))
    batch, _ = step(batcher)
    blocks_a = batch.plans[0].new_sequences[0].block_ids
    assert len(blocks_a) == 2 and allocator.num_free == 16 - 3
    batch, _ = step(batcher)
    assert batch.plans[0].finished_seq_ids == [a.seq_id] and scheduled_ids(batch) == [b.seq_id]
    assert allocator.num_free == 16 - 1         # a's two blocks are back in the pool
    batch, _ = step(batcher)
    assert len(batch.plans[0].scheduled[0].new_block_ids) == 1     # b's 5th token opens block 2
    assert allocator.num_free == 16 - 2
    while batcher.has_work:
        step(batcher)
    assert allocator.num_free == 16
    assert_all_blocks_back(batcher)


def test_decode_appends_a_block_exactly_at_the_boundary():
    batcher = make_batcher(block_size=4)
    add(batcher, make_request(3, max_new_tokens=6))
    new_blocks = []
    while batcher.has_work:
        batch, _ = step(batcher)
        new_blocks += [len(s.new_block_ids) for s in batch.plans[0].scheduled]
    # Prefill 3 tokens (1 block, in new_sequences); the decode inputs are tokens 4..8:
    # token 5 (position 4) opens block 2, token 9 would open block 3 but is never an input.
    assert new_blocks == [0, 0, 1, 0, 0, 0]


def test_a_prompt_that_never_fits_is_refused():
    batcher = make_batcher(num_blocks=4, block_size=4, max_batch_tokens=64)
    with pytest.raises(GenerationError) as err:
        add(batcher, make_request(16))     # 16 + 1 tokens need 5 blocks of 4
    assert err.value.code is ErrorCode.INVALID_ARGUMENT and "KV cache" in err.value.message
    make_batcher(max_batch_tokens=8).check_fits(9)     # longer than a step: chunked, accepted
    fits = add(batcher, make_request(15))        # exactly fits: 15 + 1 tokens in 4 blocks
    batch, _ = step(batcher)
    assert scheduled_ids(batch) == [fits.seq_id] and batcher.ranks[0].num_available == 0


def test_abort_of_a_waiting_request_never_reaches_a_rank():
    batcher = make_batcher(max_running_requests=1)
    add(batcher, make_request(2, request_id="a"))
    waiting = add(batcher, make_request(2, request_id="b"))
    step(batcher)
    batcher.abort(waiting)
    batch, events = step(batcher)
    assert outputs_of(events, waiting)[0].finish_reason is FinishReason.ABORT
    assert waiting.seq_id not in batch.plans[0].finished_seq_ids and not batcher.waiting


def test_abort_of_a_running_request_frees_its_blocks_at_the_next_step():
    batcher = make_batcher()
    seq = add(batcher, make_request(8))
    batch = batcher.schedule()
    batcher.abort(seq)                   # while the step is in flight
    events = batcher.apply_results(batch.step_id, {seq.seq_id: 30})
    assert events == [] and seq.output_ids == []
    batch, events = step(batcher)
    assert batch.plans[0].finished_seq_ids == [seq.seq_id] and not batch.plans[0].scheduled
    assert outputs_of(events, seq)[0].finish_reason is FinishReason.ABORT
    assert_all_blocks_back(batcher)
    assert not batcher.has_work


def test_results_that_do_not_match_the_plan_are_rejected():
    batcher = make_batcher()
    seq = add(batcher, make_request(2))
    batch = batcher.schedule()
    with pytest.raises(ValueError, match=rf"missing \[{seq.seq_id}\], unexpected \[99\]"):
        batcher.apply_results(batch.step_id, {99: 30})
    with pytest.raises(ValueError, match="oldest step in flight is None"):
        batcher.apply_results(batch.step_id + 1, {})


def test_bad_limits_are_rejected():
    with pytest.raises(ValueError, match="100"):
        make_batcher(max_running_requests=100, max_batch_tokens=10)
    with pytest.raises(ValueError, match="prefill_chunk_size"):
        make_batcher(prefill_chunk_size=-1)
    with pytest.raises(ValueError, match="policy must be one of fcfs, lpm, got 'random'"):
        make_batcher(policy="random")

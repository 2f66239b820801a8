"""The batcher: admission, placement, idle plans, finish reasons, block freeing."""

import pytest

from gateway.batcher import Batcher
from gateway.kv_accounting import BlockAllocator
from gateway.requests import ErrorCode, FinishReason, GenerationError, RequestOutput, Sequence
from gateway.validation import ValidatedRequest
from services.text import IncrementalDetokenizer

EOS = 1


class FakeTokenizer:
    """Ids 26..51 are the letters a..z (any id decodes to a letter by id % 26); EOS is 1."""

    eos_token_ids = (EOS,)
    vocab_size = 100

    def decode(self, ids, skip_special_tokens=False) -> str:
        return "".join("<eos>" if i == EOS else chr(ord("a") + i % 26) for i in ids)

    def encode(self, text: str) -> list[int]:
        return [26 + (ord(c) - ord("a")) % 26 for c in text]

    def encode_chat(self, messages) -> list[int]:
        return self.encode("".join(role + content for role, content in messages))


def make_request(num_prompt=4, *, max_new_tokens=8, stops=(), ignore_eos=False, request_id="r",
                 prompt_ids=None) -> ValidatedRequest:
    return ValidatedRequest(
        request_id=request_id, prompt_ids=prompt_ids or [30] * num_prompt, max_new_tokens=max_new_tokens,
        temperature=0.0, top_p=1.0, top_k=0, seed=5, stops=tuple(stops), ignore_eos=ignore_eos)


def make_batcher(num_ranks=1, *, num_blocks=64, block_size=4, max_running_requests=8,
                 max_batch_tokens=64, max_context=1000) -> Batcher:
    return Batcher([BlockAllocator(num_blocks, block_size) for _ in range(num_ranks)],
                   max_running_requests=max_running_requests, max_batch_tokens=max_batch_tokens,
                   max_context=max_context, eos_token_ids=[EOS])


def add(batcher: Batcher, request: ValidatedRequest) -> Sequence:
    seq = Sequence(batcher.new_seq_id(), request, IncrementalDetokenizer(FakeTokenizer()))
    batcher.add(seq)
    return seq


def step(batcher: Batcher, sample=lambda seq_id: 30):
    """One step with every sampled sequence drawing sample(seq_id): (batch, events)."""
    batch = batcher.schedule()
    tokens = {s.seq_id: sample(s.seq_id) for p in batch.plans for s in p.scheduled if s.is_sampled}
    return batch, batch.events + batcher.apply_results(tokens)


def scheduled_ids(batch, rank=0) -> list[int]:
    return [s.seq_id for s in batch.plans[rank].scheduled]


def outputs_of(events, seq) -> list[RequestOutput]:
    return [item for s, item in events if s is seq]


def test_admission_respects_the_token_budget_fcfs():
    batcher = make_batcher(max_batch_tokens=10)
    a, b, c = (add(batcher, make_request(4, request_id=x)) for x in "abc")
    batch, _ = step(batcher)
    assert scheduled_ids(batch) == [a.seq_id, b.seq_id]  # 8 tokens; c's 4 would make 12
    assert [n.seq_id for n in batch.plans[0].new_sequences] == [a.seq_id, b.seq_id]
    assert batch.plans[0].num_tokens == 8 and list(batcher.waiting) == [c]
    batch, _ = step(batcher)
    # Decodes first (1 token each), then c's prompt: 2 + 4 <= 10.
    assert scheduled_ids(batch) == [a.seq_id, b.seq_id, c.seq_id]
    assert [len(s.token_ids) for s in batch.plans[0].scheduled] == [0, 0, 4]
    assert all(s.is_sampled for s in batch.plans[0].scheduled)


def test_head_of_line_waits_rather_than_being_overtaken():
    batcher = make_batcher(max_batch_tokens=10)
    add(batcher, make_request(4, request_id="a"))
    big = add(batcher, make_request(9, request_id="big"))
    small = add(batcher, make_request(1, request_id="small"))
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
    batcher = make_batcher(num_blocks=16, block_size=4)
    allocator = batcher.allocators[0]
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
    with pytest.raises(GenerationError) as err:
        make_batcher(max_batch_tokens=8).check_fits(9)
    assert err.value.code is ErrorCode.INVALID_ARGUMENT and "max_batch_tokens 8" in err.value.message
    fits = add(batcher, make_request(15))        # exactly fits: 15 + 1 tokens in 4 blocks
    batch, _ = step(batcher)
    assert scheduled_ids(batch) == [fits.seq_id] and batcher.allocators[0].num_free == 0


def test_full_kv_cache_stalls_then_fails_the_newest_and_the_rest_continue():
    batcher = make_batcher(num_blocks=4, block_size=4)
    old = add(batcher, make_request(4, max_new_tokens=100, request_id="old"))
    new = add(batcher, make_request(4, max_new_tokens=100, request_id="new"))
    events = []
    failed = []
    for _ in range(12):
        _, step_events = step(batcher)
        events += step_events
        failed += [s for s, item in step_events if isinstance(item, GenerationError)]
        if failed:
            break
    assert failed == [new]
    error = next(item for s, item in events if s is new and isinstance(item, GenerationError))
    assert error.code is ErrorCode.RESOURCE_EXHAUSTED and "rank 0" in error.message
    batch, _ = step(batcher)
    assert scheduled_ids(batch) == [old.seq_id]     # old got new's freed blocks
    assert new.seq_id not in [s.seq_id for s in batch.plans[0].scheduled]


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
    allocator = batcher.allocators[0]
    seq = add(batcher, make_request(8))
    batch = batcher.schedule()
    batcher.abort(seq)                   # while the step is in flight
    events = batcher.apply_results({seq.seq_id: 30})
    assert events == [] and seq.output_ids == []
    batch, events = step(batcher)
    assert batch.plans[0].finished_seq_ids == [seq.seq_id] and not batch.plans[0].scheduled
    assert outputs_of(events, seq)[0].finish_reason is FinishReason.ABORT
    assert allocator.num_free == allocator.num_blocks and not batcher.has_work


def test_results_that_do_not_match_the_plan_are_rejected():
    batcher = make_batcher()
    seq = add(batcher, make_request(2))
    batcher.schedule()
    with pytest.raises(ValueError, match=rf"missing \[{seq.seq_id}\], unexpected \[99\]"):
        batcher.apply_results({99: 30})


def test_bad_limits_are_rejected():
    with pytest.raises(ValueError, match="100"):
        make_batcher(max_running_requests=100, max_batch_tokens=10)

"""The batcher on simulated ranks (fakes.SimRank): chunked prefill, the prefix
cache, preemption, overlap, deadlines, admission control and policies.

SimRank's tokens depend on every KV slot a sequence reads, so "the tokens
equal reference_tokens" checks block tables, cached blocks and re-prefills.
"""

import collections

import pytest

from gateway.policy import LongestPrefixMatch, make_policy
from gateway.requests import ErrorCode, FinishReason, GenerationError, SeqStatus
from tests.gateway.fakes import SimRank, make_request, reference_tokens, run_batch
from tests.gateway.test_batcher import add, assert_all_blocks_back, make_batcher


class Sim:
    """A batcher driving simulated ranks; depth 2 plans a step before applying the previous one."""

    def __init__(self, num_ranks=1, *, depth=1, **kwargs):
        self.batcher = make_batcher(num_ranks, **kwargs)
        self.ranks = [SimRank(kv.num_blocks, kv.block_size) for kv in self.batcher.ranks]
        self.depth = depth
        self.tokens: dict[int, list[int]] = collections.defaultdict(list)
        self.final: dict[int, object] = {}
        self.batches = []
        self._pending = collections.deque()

    def add(self, prompt_ids, max_new_tokens, deadline=None):
        request = make_request(prompt_ids=prompt_ids, max_new_tokens=max_new_tokens, ignore_eos=True)
        return add(self.batcher, request, deadline=deadline)

    def step(self):
        batch = self.batcher.schedule()
        self.batches.append(batch)
        self._record(batch.events)
        if not batch.is_empty:
            self._pending.append(self._run(batch))
        while len(self._pending) >= self.depth or (self._pending and batch.is_empty):
            self._record(self._apply(*self._pending.popleft()))
        return batch

    def _run(self, batch):
        """Runs the step on the ranks: what _apply takes once its results are due."""
        return batch.step_id, run_batch(self.ranks, batch)

    def _apply(self, step_id, tokens):
        return self.batcher.apply_results(step_id, tokens)

    def run(self, max_steps=2000):
        for _ in range(max_steps):
            if not self.batcher.has_work and not self._pending:
                return
            self.step()
        raise AssertionError("did not finish")

    def _record(self, events):
        for seq, item in events:
            assert seq.seq_id not in self.final, "an event after the final one"
            if isinstance(item, GenerationError):
                self.final[seq.seq_id] = item
            else:
                self.tokens[seq.seq_id] += item.token_ids
                if item.is_final:
                    self.final[seq.seq_id] = item

    def assert_reference(self, seq, num_new):
        assert self.tokens[seq.seq_id] == reference_tokens(seq.prompt_ids, num_new), seq.request_id
        assert self.final[seq.seq_id].finish_reason is FinishReason.LENGTH

    def scheduled(self, seq):
        """(number of input tokens, is_sampled) of every step that scheduled seq."""
        return [(len(s.token_ids), s.is_sampled) for b in self.batches for p in b.plans
                for s in p.scheduled if s.seq_id == seq.seq_id]


def prompt(n, start=30):
    return [26 + (start + 7 * i) % 26 for i in range(n)]


def test_a_long_prompt_is_prefilled_in_chunks_between_the_decodes_of_others():
    sim = Sim(max_batch_tokens=16, prefill_chunk_size=8)
    short = sim.add(prompt(3), 12)
    sim.step()
    long = sim.add(prompt(21, start=31), 4)
    sim.run()
    assert sim.scheduled(long)[:3] == [(8, False), (8, False), (5, True)]
    # The short one decoded in every step while the long one was prefilled.
    assert sim.scheduled(short)[:5] == [(3, True), (0, True), (0, True), (0, True), (0, True)]
    sim.assert_reference(short, 12)
    sim.assert_reference(long, 4)


def test_a_prompt_longer_than_the_token_budget_is_accepted_and_chunked():
    sim = Sim(max_batch_tokens=8, max_running_requests=4, prefill_chunk_size=512, num_blocks=32)
    seq = sim.add(prompt(30), 3)
    sim.run()
    assert sim.scheduled(seq) == [(8, False), (8, False), (8, False), (6, True), (0, True), (0, True)]
    sim.assert_reference(seq, 3)


@pytest.mark.parametrize("chunk", [1, 3, 4, 7, 512])
def test_chunked_and_batched_prefill_give_the_tokens_of_one_request_at_a_time(chunk):
    prompts = [prompt(n, start=n) for n in (1, 5, 9, 14, 23)]
    sim = Sim(prefill_chunk_size=chunk, max_batch_tokens=16, is_prefix_cached=False)
    seqs = [sim.add(p, 6 + i) for i, p in enumerate(prompts)]
    sim.run()
    for i, seq in enumerate(seqs):
        sim.assert_reference(seq, 6 + i)
    assert_all_blocks_back(sim.batcher)


def test_a_shared_prefix_is_reused_and_only_the_rest_is_prefilled():
    sim = Sim(block_size=4)
    system = prompt(10)
    first = sim.add(system + [40, 41], 3)
    sim.run()
    computed = sim.ranks[0].num_tokens_computed
    second = sim.add(system + [42, 43, 44], 3)
    sim.run()
    new = [n for b in sim.batches for p in b.plans for n in p.new_sequences if n.seq_id == second.seq_id]
    first_blocks = [n for b in sim.batches for p in b.plans for n in p.new_sequences
                    if n.seq_id == first.seq_id][0].block_ids
    # Full blocks are shared: 8 of the 10 system tokens; the other 2 are copied from the first's block 2.
    assert new[0].num_cached_tokens == 10 and new[0].block_ids[:2] == first_blocks[:2]
    (copy,) = [c for b in sim.batches for p in b.plans for c in p.block_copies]
    assert copy == (first_blocks[2], new[0].block_ids[2])
    assert sim.ranks[0].num_tokens_computed - computed == 13 - 10 + 2
    sim.assert_reference(first, 3)
    sim.assert_reference(second, 3)
    stats = sim.batcher.stats
    assert (stats.num_prompt_tokens, stats.num_cached_prompt_tokens) == (12 + 13, 10)
    assert stats.prefix_hit_rate == pytest.approx(10 / 25)
    # Each request's usage reports its own share: every output, the final one included.
    assert sim.final[first.seq_id].cached_tokens == 0 and sim.final[second.seq_id].cached_tokens == 10
    assert_all_blocks_back(sim.batcher)


def test_cached_tokens_are_those_of_the_first_start_even_after_a_preemption():
    sim = Sim(block_size=4, num_blocks=8)
    system = prompt(8)
    sim.add(system + [40], 1)
    sim.run()
    seq = sim.add(system + [41], 12)           # 2 blocks cached, 2 more to compute, then decodes
    rival = sim.add(prompt(9, start=33), 14)   # a newer request whose blocks run the pool dry
    sim.run()
    assert seq.num_preemptions + rival.num_preemptions >= 1
    assert sim.final[seq.seq_id].cached_tokens == 8
    sim.assert_reference(seq, 12)
    sim.assert_reference(rival, 14)
    assert_all_blocks_back(sim.batcher)


def test_requests_that_go_on_from_an_ended_ones_prompt_copy_its_last_block_and_compute_only_their_own_tokens():
    """A program's fork: one request prefills the shared prompt (10 tokens, blocks of 4) and ends;
    then four requests continue it at once, each sharing its two full blocks and copying its
    partly filled third, so each computes only its own 2 tokens, whatever the pool reuses."""
    sim = Sim(block_size=4, num_blocks=12)
    shared = prompt(10)
    fork = sim.add(shared, 1)
    sim.run()
    computed = sim.ranks[0].num_tokens_computed
    forks = [sim.add(shared + [40 + i, 45], 3) for i in range(4)]
    sim.run()
    assert sim.ranks[0].num_tokens_computed - computed == 4 * (2 + 2)   # own tokens and 2 decodes each
    new = {n.seq_id: n for b in sim.batches for p in b.plans for n in p.new_sequences}
    copies = [c for b in sim.batches for p in b.plans for c in p.block_copies]
    assert [new[f.seq_id].num_cached_tokens for f in forks] == [10] * 4
    assert len({source for source, _ in copies}) == 1 and len(copies) == 4
    assert sorted(d for _, d in copies) == sorted(new[f.seq_id].block_ids[2] for f in forks)
    assert sim.ranks[0].num_block_copies == sim.batcher.stats.num_block_copies == 4
    sim.assert_reference(fork, 1)
    for f in forks:
        sim.assert_reference(f, 3)
        assert sim.final[f.seq_id].cached_tokens == 10
    assert_all_blocks_back(sim.batcher)


def test_a_burst_that_shares_a_partly_filled_block_computes_it_once():
    """A select's choices: one prompt (a fork's cached 10 tokens, then 5 more, blocks of 8), a
    different last token each, sent at once. The first computes the 5 tokens; the others wait a
    step for its partly filled block and copy them, computing only their own token."""
    sim = Sim(block_size=8, num_blocks=16)
    shared = prompt(10)
    sim.add(shared, 1)
    sim.run()
    header = prompt(5, start=40)
    computed = sim.ranks[0].num_tokens_computed
    choices = [sim.add(shared + header + [60 + i], 2) for i in range(4)]
    sim.run()
    assert sim.ranks[0].num_tokens_computed - computed == (5 + 1) + 3 * 1 + 4 * 1   # and a decode each
    assert [sim.final[c.seq_id].cached_tokens for c in choices] == [10, 15, 15, 15]
    assert sim.scheduled(choices[0])[0] == (6, True) and sim.scheduled(choices[1])[0] == (1, True)
    for c in choices:
        sim.assert_reference(c, 2)
    assert_all_blocks_back(sim.batcher)


def test_a_request_does_not_wait_for_fewer_shared_tokens_than_min_tail_gain():
    sim = Sim(block_size=8, num_blocks=16)
    first = sim.add(prompt(3) + [60], 2)
    second = sim.add(prompt(3) + [61], 2)            # 3 tokens in common: not worth a step
    sim.step()
    assert sim.scheduled(first) == [(4, True)] and sim.scheduled(second) == [(4, True)]
    sim.run()
    sim.assert_reference(first, 2)
    sim.assert_reference(second, 2)


def test_an_identical_prompt_recomputes_at_least_its_last_token():
    sim = Sim(block_size=4)
    a = sim.add(prompt(8), 2)
    sim.run()
    b = sim.add(prompt(8), 2)
    sim.run()
    # Block 0 shared, 3 tokens of block 1 copied, the last one recomputed for its logits.
    assert sim.scheduled(b)[0] == (1, True)
    assert sim.final[b.seq_id].cached_tokens == 7
    sim.assert_reference(a, 2)
    sim.assert_reference(b, 2)


def test_a_burst_sharing_a_system_prompt_prefills_it_once():
    sim = Sim(block_size=4, prefill_chunk_size=8, max_batch_tokens=64)
    system = prompt(24)
    seqs = [sim.add(system + [30 + i], 4) for i in range(5)]
    sim.run()
    for seq in seqs:
        sim.assert_reference(seq, 4)
    # The system prompt once, each suffix block (the last system token is in it) once per request.
    assert sim.ranks[0].num_tokens_computed == 24 + 5 * 1 + 5 * 3
    assert sim.batcher.stats.num_cached_prompt_tokens == 4 * 24


def test_eviction_under_a_small_pool_keeps_outputs_correct():
    sim = Sim(block_size=4, num_blocks=12, max_running_requests=2)
    seqs = []
    for round_ in range(3):
        for i in range(4):
            seqs.append(sim.add(prompt(9 + i, start=i) + [26 + round_], 5))
        sim.run()
        cache = sim.batcher.ranks[0].cache
        assert cache.num_blocks <= 12
    for seq in seqs:
        sim.assert_reference(seq, 5)
    assert sim.batcher.stats.num_cached_prompt_tokens > 0
    assert_all_blocks_back(sim.batcher)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("is_prefix_cached", [True, False])
def test_preemption_on_a_tiny_pool_completes_every_request_with_the_reference(depth, is_prefix_cached):
    sim = Sim(depth=depth, block_size=4, num_blocks=10, max_running_requests=4, prefill_chunk_size=6,
              is_prefix_cached=is_prefix_cached)
    seqs = [sim.add(prompt(5 + 3 * i, start=i), 14 - i) for i in range(4)]
    sim.run()
    for i, seq in enumerate(seqs):
        sim.assert_reference(seq, 14 - i)   # every token once, none re-emitted
    assert sim.batcher.stats.num_preemptions > 0
    assert sim.batcher.stats.num_recomputed_tokens > 0
    assert_all_blocks_back(sim.batcher)


def test_the_newest_request_is_preempted_and_re_prefilled_from_its_checkpoint():
    sim = Sim(block_size=4, num_blocks=6, is_prefix_cached=False)
    old = sim.add(prompt(7), 10)
    new = sim.add(prompt(6, start=40), 10)
    while new.num_preemptions == 0:
        sim.step()
    assert old.num_preemptions == 0 and new.status is SeqStatus.WAITING
    num_generated = len(new.output_ids)
    sim.run()
    # Re-admitted with its prompt and the tokens generated before as input.
    readmit = [s for b in sim.batches for p in b.plans for s in p.scheduled
               if s.seq_id == new.seq_id and len(s.token_ids) > 1][1]
    assert len(readmit.token_ids) == 6 + num_generated
    sim.assert_reference(old, 10)
    sim.assert_reference(new, 10)


def test_a_request_alone_too_large_for_the_pool_fails_with_resource_exhausted():
    sim = Sim(block_size=4, num_blocks=3)
    seq = sim.add(prompt(5), 20)
    sim.run()
    error = sim.final[seq.seq_id]
    assert isinstance(error, GenerationError) and error.code is ErrorCode.RESOURCE_EXHAUSTED
    assert "rank 0" in error.message and "3 blocks of 4" in error.message
    # 12 slots: the 8th token is sampled from the 12th, the 9th finds no block.
    assert sim.tokens[seq.seq_id] == reference_tokens(seq.prompt_ids, 8)
    assert_all_blocks_back(sim.batcher)


def test_overlap_drops_the_token_of_a_slot_planned_after_the_sequence_stopped():
    sim = Sim(depth=2)
    expected = reference_tokens([30, 31], 3)
    stop = "".join(chr(ord("a") + t % 26) for t in expected[2:3])
    seq = add(sim.batcher, make_request(prompt_ids=[30, 31], max_new_tokens=10, stops=[stop]))
    other = sim.add(prompt(4), 8)
    sim.run()
    assert sim.tokens[seq.seq_id] == expected
    assert sim.final[seq.seq_id].finish_reason is FinishReason.STOP
    # The 4th decode slot was planned before the stop was known, its token dropped.
    assert sim.scheduled(seq) == [(2, True), (0, True), (0, True), (0, True)]
    sim.assert_reference(other, 8)
    assert_all_blocks_back(sim.batcher)


def test_deadlines_end_waiting_and_running_requests_and_free_their_blocks():
    now = [0.0]
    sim = Sim(max_running_requests=1, clock=lambda: now[0])
    running = sim.add(prompt(6), 100, deadline=5.0)
    waiting = sim.add(prompt(6, start=3), 100, deadline=3.0)
    keeps = sim.add(prompt(3), 2)
    sim.step()
    sim.step()
    assert running.status is SeqStatus.RUNNING and waiting.status is SeqStatus.WAITING
    now[0] = 10.0
    sim.run()
    for seq in (running, waiting):
        error = sim.final[seq.seq_id]
        assert isinstance(error, GenerationError) and error.code is ErrorCode.DEADLINE_EXCEEDED
    assert "after 2 generated tokens" in sim.final[running.seq_id].message
    sim.assert_reference(keeps, 2)
    assert sim.batcher.stats.num_deadline_exceeded == 2
    assert_all_blocks_back(sim.batcher)


def test_a_full_waiting_queue_refuses_with_the_limit_in_the_message():
    batcher = make_batcher(max_waiting_requests=2)
    add(batcher, make_request(2))
    add(batcher, make_request(2))
    with pytest.raises(GenerationError) as err:
        add(batcher, make_request(2))
    assert err.value.code is ErrorCode.RESOURCE_EXHAUSTED and "max_waiting_requests 2" in err.value.message
    assert batcher.stats.num_rejected_queue_full == 1


def test_lpm_admits_the_request_with_the_longest_cached_prefix_first():
    sim = Sim(block_size=4, max_running_requests=1, policy="lpm")
    system = prompt(12)
    sim.add(system + [40], 1)
    sim.run()
    cold = sim.add(prompt(13, start=5), 2)
    warm = sim.add(system + [41], 2)
    sim.step()
    assert warm.status is SeqStatus.RUNNING and cold.status is SeqStatus.WAITING
    sim.run()
    sim.assert_reference(cold, 2)
    sim.assert_reference(warm, 2)


def test_policies_are_registered_by_name():
    assert isinstance(make_policy("lpm"), LongestPrefixMatch)
    assert make_policy("fcfs").order_in_class([1, 2], lambda s: 0) == [1, 2]
    with pytest.raises(ValueError, match="fcfs, lpm"):
        make_policy("nope")


def test_a_request_goes_to_the_rank_that_caches_its_prefix_when_load_allows():
    sim = Sim(num_ranks=2, block_size=4, max_running_requests=8)
    system = prompt(16)
    first = sim.add(system + [40], 1)
    sim.run()
    busy = [sim.add(prompt(3, start=i), 50) for i in range(2)]
    sim.step()
    cached_rank = first.rank if first.rank is not None else [
        p.rank for b in sim.batches for p in b.plans for n in p.new_sequences if n.seq_id == first.seq_id][0]
    assert {s.rank for s in busy} == {0, 1}
    follower = sim.add(system + [41], 1)
    sim.step()
    assert follower.rank == cached_rank
    sim.run()
    sim.assert_reference(follower, 1)

"""Random workloads through the batcher on simulated ranks: prompts that share prefixes (whole
blocks and parts of blocks), requests of several samples (the later ones led by the first),
arrivals spread over the steps, a pool small enough to evict and preempt, aborts (of a first
sample too), batch-priority requests, requests scoring their prompt from a position, one and two
ranks, one and two steps in flight, the SLO step budget with shedding (its decisions on a
clock that moves 3 ms a step), and jump-forward: the ranks report, after some sequences' sampled
tokens, the next 1-5 tokens as forced, as a constraint would (they are the tokens decoding gives,
so jump-forward changes how many steps a request takes, never its tokens).

SimRank computes each token from the KV slots a sequence reads (copied blocks included) and
refuses a write into a block another sequence holds, so every request that was neither aborted
nor refused must end with reference_tokens, and a scoring one must report each prompt position
from its start once, whatever was cached or prefilled again; afterwards every block is back (free
or cached, unreferenced) and the pools' invariants hold after every step."""

import collections
import random

import pytest

from gateway.requests import ErrorCode, FinishReason, GenerationError, Sequence
from services.step import LogprobSpec, TokenLogprob
from tests.gateway.fakes import fake_logprob, next_token, reference_tokens
from tests.gateway.test_batcher import assert_all_blocks_back
from tests.gateway.test_samples import SampleSim as _SampleSim


class SampleSim(_SampleSim):
    """Samples of one request led by the first (test_samples.SampleSim's), with prompt
    log-probabilities routed to their sequences as Engine._route_logprobs routes them."""

    def __init__(self, *args, jump_rng: random.Random | None = None, **kwargs):
        super().__init__(*args, jump_forward=jump_rng is not None, **kwargs)
        self.seqs: dict[int, Sequence] = {}
        self.prompt_logprobs: dict[int, list] = collections.defaultdict(list)
        # The sequences whose "constraint" forces tokens now and then, and the draws of how many.
        self.jump_rng = jump_rng
        self.constrained: set[int] = set()

    def add_samples(self, prompt_ids, max_new_tokens, n, **request_fields):
        seqs = super().add_samples(prompt_ids, max_new_tokens, n, **request_fields)
        self.seqs.update((seq.seq_id, seq) for seq in seqs)
        return seqs

    def _run(self, batch):
        step_id, tokens = super()._run(batch)
        forced = {}
        for seq_id, token_id in tokens.items():
            num_forced = self.jump_rng.choice((0, 0, 1, 2, 3, 5)) if seq_id in self.constrained else 0
            if num_forced:
                forced[seq_id] = self._continuation(seq_id, token_id, num_forced)
        return step_id, tokens, [scored for rank in self.ranks for scored in rank.scored], forced

    def _continuation(self, seq_id: int, token_id: int, num_tokens: int) -> tuple[int, ...]:
        """The tokens decoding gives after token_id, from the KV of the rank holding seq_id."""
        (rank,) = [rank for rank in self.ranks if seq_id in rank.seqs]
        sim_seq = rank.seqs[seq_id]
        context = [rank.slots[rank._slot(sim_seq, p)] for p in range(sim_seq.num_computed)] + [token_id]
        for _ in range(num_tokens):
            context.append(next_token(context))
        return tuple(context[-num_tokens:])

    def _apply(self, step_id, tokens, scored, forced):
        for seq_id, position, token_id in scored:
            seq = self.seqs[seq_id]
            if not seq.is_finished and not (seq_id in tokens and position >= seq.num_tokens):
                seq.add_prompt_logprob(position, TokenLogprob(token_id, fake_logprob(position, token_id)))
        return self.batcher.apply_results(step_id, tokens, forced=forced)

    def _record(self, events):
        super()._record(events)
        for seq, item in events:
            if not isinstance(item, GenerationError) and item.prompt_logprobs:
                self.prompt_logprobs[seq.seq_id] += item.prompt_logprobs


# (ranks, steps in flight, KV blocks a rank, block size, max_batch_tokens, prefill_chunk_size, the step budget's
# (TPOT target, TTFT target) in ms or None). The targets are tight for the cost model's priors (a step at least
# 2.5 ms), so that the budget holds prompts back, alternates decode-only steps and sheds.
CONFIGS = [(1, 1, 14, 4, 24, 8, None), (1, 2, 12, 4, 32, 0, None), (2, 2, 12, 4, 16, 5, None),
           (1, 2, 10, 16, 64, 512, None), (1, 2, 40, 4, 32, 0, None), (1, 2, 14, 4, 32, 0, (3.0, 3.0)),
           (2, 1, 12, 4, 24, 0, (3.0, 20.0))]
# The simulated clock's step.
STEP_S = 0.003


def _workload(rng: random.Random, block_size: int):
    """(arrival step, prompt, max_new_tokens, abort step or None, samples, is_batch, prompt_logprobs_start
    or None) of each request."""
    prefixes = [[26 + rng.randrange(26) for _ in range(rng.randrange(1, 3 * block_size))] for _ in range(3)]
    requests, step = [], 0
    for _ in range(rng.randrange(8, 20)):
        step += rng.choice((0, 0, 1, 2, 5))
        base = rng.choice(prefixes)
        # A prefix, cut anywhere (so requests share parts of blocks), then a suffix of its own.
        prompt = base[:rng.randrange(len(base) + 1)] + [26 + rng.randrange(26) for _ in range(rng.randrange(4))]
        if not prompt:
            prompt = [26 + rng.randrange(26)]
        abort = step + rng.randrange(1, 8) if rng.random() < 0.15 else None
        scored = rng.randrange(len(prompt)) if len(prompt) > 1 and rng.random() < 0.2 else None
        samples = 1 if scored is not None else rng.choice((1, 1, 1, 2, 3))
        requests.append((step, prompt, rng.randrange(1, 17), abort, samples, rng.random() < 0.3, scored))
    return requests


@pytest.mark.parametrize("config", CONFIGS,
                         ids=[f"r{c[0]}-d{c[1]}-b{c[2]}x{c[3]}{'-slo' if c[6] else ''}" for c in CONFIGS])
@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("jump", [False, True], ids=["", "jump"])
def test_random_shared_prefixes_give_the_reference_tokens_and_every_block_back(config, seed, jump):
    num_ranks, depth, num_blocks, block_size, max_batch_tokens, chunk, budget = config
    rng = random.Random(f"{seed} {config}")  # str seeds are hashed by sha512: the same workload every run
    # Its own draws, so that the workloads stay those of the runs without jump-forward.
    jump_rng = random.Random(f"jump {seed} {config}") if jump else None
    now = [0.0]
    sim = SampleSim(num_ranks, depth=depth, jump_rng=jump_rng, num_blocks=num_blocks, block_size=block_size,
                    max_batch_tokens=max_batch_tokens, prefill_chunk_size=chunk, max_running_requests=6,
                    clock=lambda: now[0], min_prefill_tokens=4,
                    **({"tpot_target_ms": budget[0], "ttft_target_ms": budget[1]} if budget else {}))
    workload = _workload(rng, block_size)
    seqs = {}   # request index -> its samples' sequences (none if it was refused)
    for step in range(3000):
        now[0] = step * STEP_S
        for i, (arrival, prompt, num_new, _, n, is_batch, scored) in enumerate(workload):
            if arrival == step:
                try:
                    scoring = {} if scored is None else {"logprobs": LogprobSpec(prompt_logprobs=True),
                                                         "prompt_logprobs_start": scored}
                    seqs[i] = sim.add_samples(prompt, num_new, n, is_batch=is_batch, **scoring)
                    if jump_rng is not None and jump_rng.random() < 0.6:
                        sim.constrained.update(seq.seq_id for seq in seqs[i])
                except GenerationError as refused:   # shed by the budget's admission
                    assert budget and refused.code is ErrorCode.RESOURCE_EXHAUSTED, refused
                    seqs[i] = []
        for i, (*_, abort, _, _, _) in enumerate(workload):
            if abort == step and seqs.get(i) and seqs[i][0].seq_id not in sim.final:
                sim.batcher.abort(seqs[i][0])
        if len(seqs) == len(workload) and not sim.batcher.has_work and not sim._pending:
            break
        sim.step()
        for kv in sim.batcher.ranks:
            kv.check_invariants()
    else:
        raise AssertionError("did not finish")
    for i, (_, prompt, num_new, abort, _, _, scored) in enumerate(workload):
        for k, seq in enumerate(seqs[i]):
            final = sim.final.get(seq.seq_id)
            tokens = sim.tokens[seq.seq_id]
            assert tokens == reference_tokens(prompt, num_new)[:len(tokens)], (i, k, prompt)
            if abort is None or k > 0:
                assert not isinstance(final, GenerationError), (i, k, final)
                assert len(tokens) == num_new and final.finish_reason is FinishReason.LENGTH, (i, k, final)
                if scored is not None:  # each prompt position from the start on, once, as the rank scored it
                    first = max(1, scored)
                    assert [(lp.token_id, lp.logprob) for lp in sim.prompt_logprobs[seq.seq_id]] == [
                        (prompt[p], fake_logprob(p, prompt[p])) for p in range(first, len(prompt))], (i, prompt)
    assert_all_blocks_back(sim.batcher)

"""Random workloads through the batcher on simulated ranks: prompts that share prefixes (whole
blocks and parts of blocks), requests of several samples (the later ones led by the first),
arrivals spread over the steps, a pool small enough to evict and preempt, aborts (of a first
sample too), one and two ranks, one and two steps in flight.

SimRank computes each token from the KV slots a sequence reads (copied blocks included) and
refuses a write into a block another sequence holds, so every request that was not aborted must
end with reference_tokens; afterwards every block is back (free or cached, unreferenced) and the
pools' invariants hold after every step."""

import random

import pytest

from gateway.requests import FinishReason, GenerationError
from tests.gateway.fakes import reference_tokens
from tests.gateway.test_batcher import assert_all_blocks_back
from tests.gateway.test_samples import SampleSim

# (ranks, steps in flight, KV blocks a rank, block size, max_batch_tokens, prefill_chunk_size)
CONFIGS = [(1, 1, 14, 4, 24, 8), (1, 2, 12, 4, 32, 0), (2, 2, 12, 4, 16, 5), (1, 2, 10, 16, 64, 512),
           (1, 2, 40, 4, 32, 0)]


def _workload(rng: random.Random, block_size: int):
    """(arrival step, prompt, max_new_tokens, abort step or None, samples) of each request."""
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
        requests.append((step, prompt, rng.randrange(1, 17), abort, rng.choice((1, 1, 1, 2, 3))))
    return requests


@pytest.mark.parametrize("config", CONFIGS, ids=[f"r{c[0]}-d{c[1]}-b{c[2]}x{c[3]}" for c in CONFIGS])
@pytest.mark.parametrize("seed", range(12))
def test_random_shared_prefixes_give_the_reference_tokens_and_every_block_back(config, seed):
    num_ranks, depth, num_blocks, block_size, max_batch_tokens, chunk = config
    rng = random.Random(seed * 1000 + hash(config) % 1000)
    sim = SampleSim(num_ranks, depth=depth, num_blocks=num_blocks, block_size=block_size,
                    max_batch_tokens=max_batch_tokens, prefill_chunk_size=chunk, max_running_requests=6)
    workload = _workload(rng, block_size)
    seqs = {}   # request index -> its samples' sequences
    for step in range(3000):
        for i, (arrival, prompt, num_new, _, n) in enumerate(workload):
            if arrival == step:
                seqs[i] = sim.add_samples(prompt, num_new, n)
        for i, (*_, abort, _) in enumerate(workload):
            if abort == step and i in seqs and seqs[i][0].seq_id not in sim.final:
                sim.batcher.abort(seqs[i][0])
        if len(seqs) == len(workload) and not sim.batcher.has_work and not sim._pending:
            break
        sim.step()
        for kv in sim.batcher.ranks:
            kv.check_invariants()
    else:
        raise AssertionError("did not finish")
    for i, (_, prompt, num_new, abort, _) in enumerate(workload):
        for k, seq in enumerate(seqs[i]):
            final = sim.final.get(seq.seq_id)
            tokens = sim.tokens[seq.seq_id]
            assert tokens == reference_tokens(prompt, num_new)[:len(tokens)], (i, k, prompt)
            if abort is None or k > 0:
                assert not isinstance(final, GenerationError), (i, k, final)
                assert len(tokens) == num_new and final.finish_reason is FinishReason.LENGTH, (i, k, final)
    assert_all_blocks_back(sim.batcher)

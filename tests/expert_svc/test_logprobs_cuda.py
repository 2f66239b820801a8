"""Log-probabilities on a GPU rank (issue 27; skipped without CUDA): steps launched two at a
time as the executor runs them, the decode steps through real CUDA graph replays, report
for the sequences that asked the fp32 log-softmax of the model's logits (transformers' on
the CPU, fed the same tokens), at the tokens sampled, with the top alternatives in
descending order; the sequences that did not ask sample the tokens of a run where none did.

    python -m pytest -q tests/expert_svc/test_logprobs_cuda.py
"""

import dataclasses

import pytest
import torch

from expert_svc.graph_runner import DecodeGraphRunner
from expert_svc.runner import StepRunner
from services.kv_pool import KVPool
from services.model.checkpoint import load_weights
from services.model.qwen3_moe import Qwen3MoeModel
from services.step import NO_LOGPROBS, LogprobSpec, NewSequence, SamplingSpec, ScheduledSequence, StepPlan
from tests.conftest import hf_logprobs
from tests.expert_svc.conftest import SMALL

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BLOCK_SIZE, BLOCKS_PER_SEQ = 16, 4
NUM_STEPS = 12
GPU_SLEEP_CYCLES = 20_000_000  # about 10 ms of GPU time queued behind a launched step
# fp32 on both sides, in other kernels and summation orders (Triton with IEEE fp32 dots and
# cuBLAS against transformers' eager CPU code). The CPU's torch path is within 1.2e-6 of
# transformers on these positions; a wrong row is off by more than this at nearly every one
# (the closest other row's log-probability of the same token is a median 0.03 away).
TOL = 1e-3

# Sequence 0: greedy, its prompt's log-probabilities too, the prompt in two chunks (the first
# not sampled: its last row scores the second chunk's first token); 1: greedy, asks nothing;
# 2: drawn, its sampled tokens' log-probabilities, joins in step 2; 3: drawn, asks nothing,
# sits out step 5 (a decode graph of 3 rows, one of padding).
SAMPLINGS = (SamplingSpec(temperature=0.0), SamplingSpec(temperature=0.0),
             SamplingSpec(temperature=0.8, top_p=0.9, seed=3), SamplingSpec(temperature=0.9, top_k=20, seed=5))
SPECS = (LogprobSpec(True, 5, True), NO_LOGPROBS, LogprobSpec(True, 3), NO_LOGPROBS)
PROMPT_LENGTHS = (10, 5, 6, 4)
FIRST_CHUNK = 6  # sequence 0's first chunk
SITS_OUT = (5, 3)  # (step, sequence)
# Steps of up to 16 tokens (moe_small.MOE_MAX_TOKENS) take fused_moe's kernels; bigger ones
# moe_gemm's grouped GEMM, whose tiles (sized for bf16) need more shared memory in fp32 than
# a GPU block has (278 KB at up to 128 tokens, compiled for sm_90).
MAX_STEP_TOKENS = 16


@pytest.fixture(scope="module")
def model(small_model_dir):
    """The transformers twin's weights (tests/expert_svc/conftest.py), served in fp32 on the GPU
    by the kernels the serving path uses (Triton attention, the fused layer loop)."""
    weights = load_weights(small_model_dir, SMALL, range(SMALL.num_experts), dtype=torch.float32, device="cuda")
    return Qwen3MoeModel(SMALL, weights, expert_ids=range(SMALL.num_experts), dtype=torch.float32,
                         device="cuda", attention="triton")


def _runner(model) -> StepRunner:
    """A fresh runner: its own KV pool and decode graphs."""
    num_seqs = len(SPECS)
    kv = KVPool.for_model(SMALL, num_seqs * BLOCKS_PER_SEQ, BLOCK_SIZE, torch.float32, "cuda")
    graphs = DecodeGraphRunner(model, kv, BLOCK_SIZE, buckets=(1, 2, 4), max_blocks=BLOCKS_PER_SEQ)
    return StepRunner(model, kv, BLOCK_SIZE, vocab_size=SMALL.vocab_size, device="cuda", graphs=graphs)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(27)
    return [torch.randint(0, SMALL.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _plans(specs) -> list[StepPlan]:
    """Step 1: sequence 0's first chunk, 1's and 3's prompts; step 2: sequence 0's second chunk,
    2's prompt, 1's and 3's first decode (eager, mixed); then decode steps (graphed)."""
    prompts, num_seqs = _prompts(), len(SPECS)
    new = [NewSequence(i, SAMPLINGS[i], tuple(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ)),
                       logprobs=specs[i]) for i in range(num_seqs)]
    first = (ScheduledSequence(0, tuple(prompts[0][:FIRST_CHUNK]), is_sampled=False),
             ScheduledSequence(1, tuple(prompts[1])), ScheduledSequence(3, tuple(prompts[3])))
    second = (ScheduledSequence(0, tuple(prompts[0][FIRST_CHUNK:])), ScheduledSequence(1),
              ScheduledSequence(2, tuple(prompts[2])), ScheduledSequence(3))
    plans = [StepPlan(1, "", 0, new_sequences=(new[0], new[1], new[3]), scheduled=first),
             StepPlan(2, "", 0, new_sequences=(new[2],), scheduled=second)]
    plans = [dataclasses.replace(plan, max_tokens_per_rank=plan.num_tokens) for plan in plans]  # one rank
    for step_id in range(3, NUM_STEPS + 1):
        ids = [i for i in range(num_seqs) if (step_id, i) != SITS_OUT]
        plans.append(StepPlan(step_id, "", 0, scheduled=tuple(map(ScheduledSequence, ids)),
                              max_tokens_per_rank=num_seqs))
    assert max(plan.num_tokens for plan in plans) <= MAX_STEP_TOKENS
    return plans


def _drive(runner: StepRunner, specs):
    """Runs the plans with step k + 1 launched before step k is read, as the executor does:
    each sequence's tokens, its scored positions -> TokenLogprob, and the graph-replayed steps
    with the sequences each reported for."""
    tokens = [[] for _ in SPECS]
    scored = [{} for _ in SPECS]
    replayed: dict[int, set[int]] = {}
    launched = None
    for plan in [*_plans(specs), None]:
        step = None
        if plan is not None:
            num_replays = runner.graphs.num_replays
            step = runner.launch(plan)
            if runner.graphs.num_replays > num_replays:
                replayed[plan.step_id] = set()
            torch.cuda._sleep(GPU_SLEEP_CYCLES)
        if launched is not None:
            if launched.scores is not None:  # read back with the tokens, at the step's event
                assert launched.ready is not None and all(t.is_pinned() for t in launched.scores_host)
            result = runner.finish(launched)
            if step is not None:
                assert not torch.cuda.current_stream().query(), "the read waited for the steps queued after it"
            for seq_id, token_id in result.tokens:
                tokens[seq_id].append(token_id)
            for seq_id, position, logprob in result.logprobs:
                assert position not in scored[seq_id]
                scored[seq_id][position] = logprob
                replayed.get(result.step_id, set()).add(seq_id)
        launched = step
    return tokens, scored, replayed


def _check_against(reference_LV: torch.Tensor, token_ids: list[int], scored: dict, positions, num_top: int,
                   is_greedy: bool, num_prompt: int) -> None:
    """Each position's TokenLogprob is the reference's row position - 1 at that position's token;
    its top alternatives are the reference's most likely tokens (up to ties within TOL), descending."""
    assert sorted(scored) == list(positions)
    for position in positions:
        lp, ref_V = scored[position], reference_LV[position - 1]
        assert lp.token_id == token_ids[position]
        assert lp.logprob == pytest.approx(ref_V[lp.token_id].item(), abs=TOL)
        if is_greedy and position >= num_prompt:  # the sampled token is the row's most likely
            assert lp.logprob == pytest.approx(ref_V.max().item(), abs=TOL)
        ids, values = [t for t, _ in lp.top], [v for _, v in lp.top]
        assert len(set(ids)) == len(ids) == num_top
        assert values == sorted(values, reverse=True)
        assert values == pytest.approx(ref_V[ids].tolist(), abs=TOL)
        assert values == pytest.approx(ref_V.topk(num_top).values.tolist(), abs=TOL)


def test_logprobs_through_decode_graphs_with_two_steps_in_flight_are_transformers(model, hf_small):
    runner = _runner(model)
    tokens, scored, replayed = _drive(runner, SPECS)
    # The decode steps went through the graph runner, replays among them, and reported there.
    graphs = runner.graphs
    assert graphs.num_captures == 1 and graphs.num_eager == 2 and len(replayed) == graphs.num_replays == 8
    assert all(seq_ids == {0, 2} for seq_ids in replayed.values())
    prompts = _prompts()
    assert [len(t) for t in tokens] == [NUM_STEPS - 1, NUM_STEPS, NUM_STEPS - 1, NUM_STEPS - 1]
    for seq_id, spec in enumerate(SPECS):
        if not spec:
            assert not scored[seq_id]
            continue
        full = prompts[seq_id] + tokens[seq_id]
        first = 1 if spec.prompt_logprobs else len(prompts[seq_id])
        _check_against(hf_logprobs(hf_small, full), full, scored[seq_id], range(first, len(full)),
                       spec.top_logprobs, SAMPLINGS[seq_id].temperature == 0.0, len(prompts[seq_id]))
    # Scoring moves no token: a run where nobody asked samples the same ones.
    unscored_tokens, unscored, _ = _drive(_runner(model), (NO_LOGPROBS,) * len(SPECS))
    assert unscored_tokens == tokens and not any(unscored)

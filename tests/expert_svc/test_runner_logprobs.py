"""StepRunner's log-probabilities against transformers: the raw-logit fp32 log-softmax of
sampled and prompt tokens, and the top alternatives, across chunked prefill and beside
sequences that ask for none."""

import pytest
import torch

from tests.conftest import hf_greedy, hf_logprobs
from tests.expert_svc.test_runner import BLOCK_SIZE, EPOCH, GREEDY, GROUP, model, process_group, runner  # noqa: F401
from expert_svc.runner import StepRunner
from services.step import LogprobSpec, NewSequence, SamplingSpec, ScheduledSequence, StepPlan

NUM_NEW = 5
TOL = 1e-4


def drive(runner: StepRunner, prompts: list[list[int]], specs: list[LogprobSpec], samplings: list[SamplingSpec],
          chunk: int) -> tuple[list[list[int]], list[dict[int, object]]]:
    """Runs every prompt (chunked) to NUM_NEW tokens: the tokens, and each sequence's scored
    positions -> TokenLogprob, checking that no position is reported twice."""
    generated = [[] for _ in prompts]
    scored = [{} for _ in prompts]
    num_sent = [0] * len(prompts)
    blocks = [[] for _ in prompts]
    next_block, step_id = 0, 0
    while any(len(g) < NUM_NEW for g in generated):
        step_id += 1
        new, scheduled = [], []
        for i, prompt in enumerate(prompts):
            if len(generated[i]) >= NUM_NEW:
                continue
            tokens = prompt[num_sent[i]:num_sent[i] + chunk]
            num_after = num_sent[i] + len(tokens) if tokens else len(prompt) + len(generated[i])
            grown = list(range(next_block, next_block + -(-num_after // BLOCK_SIZE) - len(blocks[i])))
            next_block += len(grown)
            if step_id == 1:
                new.append(NewSequence(i, samplings[i], (), logprobs=specs[i]))
            blocks[i] += grown
            num_sent[i] += len(tokens)
            scheduled.append(ScheduledSequence(i, tuple(tokens), tuple(grown), num_sent[i] == len(prompt)))
        result = runner.run_step(StepPlan(step_id, GROUP, EPOCH, tuple(new), tuple(scheduled)))
        for seq_id, token_id in result.tokens:
            generated[seq_id].append(token_id)
        order = [(seq_id, position) for seq_id, position, _ in result.logprobs]
        assert order == sorted(order, key=lambda e: ([s.seq_id for s in scheduled].index(e[0]), e[1]))
        for seq_id, position, logprob in result.logprobs:
            assert position not in scored[seq_id]
            scored[seq_id][position] = logprob
    return generated, scored


def check_against(reference_LV: torch.Tensor, token_ids: list[int], scored: dict, positions, num_top: int) -> None:
    """Each position's TokenLogprob equals the reference's (row position - 1) within TOL."""
    assert sorted(scored) == list(positions)
    for position in positions:
        lp, ref_V = scored[position], reference_LV[position - 1]
        assert lp.token_id == token_ids[position]
        assert lp.logprob == pytest.approx(ref_V[token_ids[position]].item(), abs=TOL)
        top_values, top_ids = ref_V.topk(num_top)
        assert [t for t, _ in lp.top] == top_ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top_values.tolist(), abs=TOL)


@pytest.mark.parametrize("chunk", [4, 100])
def test_prompt_and_sampled_logprobs_equal_transformers(runner, hf_small, chunk):
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (11, 7, 9)]
    specs = [LogprobSpec(True, 5, True), LogprobSpec(), LogprobSpec(True, 3, False)]
    samplings = [GREEDY, GREEDY, SamplingSpec(temperature=0.9, top_k=20, seed=7)]
    generated, scored = drive(runner, prompts, specs, samplings, chunk)
    # Greedy: the tokens are transformers'; the logprobs of the prompt (after its first
    # token) and of every generated token are its log-softmax.
    full = prompts[0] + generated[0]
    assert generated[0] == hf_greedy(hf_small, prompts[0], NUM_NEW)
    check_against(hf_logprobs(hf_small, full), full, scored[0], range(1, len(full)), 5)
    assert generated[1] == hf_greedy(hf_small, prompts[1], NUM_NEW) and not scored[1]
    # Drawn at temperature 0.9 from the top 20: still the raw logits' log-softmax of the token drawn.
    full = prompts[2] + generated[2]
    check_against(hf_logprobs(hf_small, full), full, scored[2], range(len(prompts[2]), len(full)), 3)


def test_prompt_logprobs_alone_report_no_sampled_token(runner, hf_small):
    prompt = list(range(3, 12))
    generated, scored = drive(runner, [prompt], [LogprobSpec(prompt_logprobs=True)], [GREEDY], 4)
    check_against(hf_logprobs(hf_small, prompt), prompt, scored[0], range(1, len(prompt)), 0)
    assert generated[0] == hf_greedy(hf_small, prompt, NUM_NEW)

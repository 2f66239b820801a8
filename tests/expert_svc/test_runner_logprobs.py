"""StepRunner's log-probabilities against transformers: the raw-logit fp32 log-softmax of
sampled and prompt tokens, and the top alternatives, across chunked prefill, beside
sequences that ask for none, and before a constraint's mask; StepScores on a CUDA-graph
step's rows; services/model/logprobs.py's gather and top-k."""

import pytest
import torch

from tests.conftest import hf_greedy, hf_logprobs
from tests.expert_svc.test_runner import BLOCK_SIZE, EPOCH, GREEDY, GROUP, model, process_group, runner  # noqa: F401
from expert_svc.constrained import ConstraintMasks
from expert_svc.logprobs import SeqScoring, StepScores
from expert_svc.runner import StepRunner
from services.kv_pool import KVPool
from services.model.logprobs import token_logprobs
from services.step import Constraint, LogprobSpec, NewSequence, SamplingSpec, ScheduledSequence, StepPlan
from tests.expert_svc.conftest import SMALL

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


class _OnlyToken7(ConstraintMasks):
    """A constraint that allows token 7 alone: masks every other logit of its rows to -inf."""

    def matcher(self, new):
        return object()

    def mask(self, logits_SV, greedy_S, rows, matchers, unaccepted, forced_inputs=(), is_jump_forward=()):
        with torch.inference_mode():
            keep_V = logits_SV[rows, 7].clone()
            logits_SV[rows] = float("-inf")
            logits_SV[rows, 7] = keep_V
        return greedy_S, []


def test_a_constrained_token_reports_the_logprob_before_the_mask(model, hf_small):  # noqa: F811
    kv = KVPool.for_model(SMALL, 32, BLOCK_SIZE, torch.float32, "cpu")
    runner = StepRunner(model, kv, BLOCK_SIZE, vocab_size=SMALL.vocab_size, group_id=GROUP,  # noqa: F811
                        placement_epoch=EPOCH, constraints=_OnlyToken7())
    prompt = [5, 9, 13, 2, 40]
    new = NewSequence(1, GREEDY, (0, 1), constraint=Constraint("regex", "x"), logprobs=LogprobSpec(True, 2))
    result = runner.run_step(StepPlan(1, GROUP, EPOCH, (new,), (ScheduledSequence(1, tuple(prompt)),)))
    assert result.tokens == ((1, 7),)
    ((seq_id, position, lp),) = result.logprobs
    reference_V = hf_logprobs(hf_small, prompt)[-1]
    assert (seq_id, position, lp.token_id) == (1, 5, 7)
    assert lp.logprob == pytest.approx(reference_V[7].item(), abs=TOL) and lp.logprob < -1e-3
    assert [t for t, _ in lp.top] == reference_V.topk(2).indices.tolist()


class _Seq:
    def __init__(self, scoring, num_computed):
        self.scoring, self.num_computed = scoring, num_computed


def test_a_graph_step_scores_the_rows_of_the_sequences_that_asked():
    """A CUDA-graph decode step's logits hold one row per scheduled sequence: only the rows
    that asked are scored, the sampled ones at the token drawn, and sampling keeps all rows."""
    logits_SV = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    scheduled = [ScheduledSequence(1), ScheduledSequence(2), ScheduledSequence(3, (17,), is_sampled=False)]
    seqs = [_Seq(SeqScoring(LogprobSpec(True, 3)), 8), _Seq(None, 4),
            _Seq(SeqScoring(LogprobSpec(prompt_logprobs=True)), 2)]
    scores = StepScores.prepare(logits_SV, scheduled, seqs, is_graph=True)
    assert scores.sample_rows is None
    token_ids_S = torch.tensor([11, 12, 13])
    host = [t.tolist() for t in scores.launch(token_ids_S)]
    ((seq_id, position, lp),) = scores.results(host, token_ids_S.tolist())
    reference_V = torch.log_softmax(logits_SV[0], dim=-1)
    assert (seq_id, position, lp.token_id) == (1, 9, 11)
    assert lp.logprob == pytest.approx(reference_V[11].item(), abs=1e-6)
    assert [t for t, _ in lp.top] == reference_V.topk(3).indices.tolist()
    # Sequence 3's one-token chunk predicts the next chunk's first token: kept for it.
    position, kept_V = seqs[2].scoring.pending
    assert position == 3 and torch.allclose(kept_V, torch.log_softmax(logits_SV[2], dim=-1))


def test_a_step_where_no_sequence_asked_scores_nothing():
    seqs = [_Seq(None, 0)]
    assert StepScores.prepare(torch.zeros(1, 4), [ScheduledSequence(1)], seqs, is_graph=False) is None


def test_token_logprobs_gathers_the_token_and_orders_the_top():
    logprobs_NV = torch.log_softmax(torch.randn(4, 30, generator=torch.Generator().manual_seed(2)), dim=-1)
    token_ids_N = torch.tensor([0, 5, 29, 7])
    logprob_N, top_NK, ids_NK = token_logprobs(logprobs_NV, token_ids_N, 4)
    assert torch.equal(logprob_N, logprobs_NV[torch.arange(4), token_ids_N])
    assert torch.equal(top_NK, logprobs_NV.sort(dim=-1, descending=True).values[:, :4])
    assert torch.equal(logprobs_NV.gather(1, ids_NK), top_NK)
    _, top_N0, ids_N0 = token_logprobs(logprobs_NV, token_ids_N, 0)
    assert top_N0.shape == ids_N0.shape == (4, 0)
    with pytest.raises(ValueError, match="token ids"):
        token_logprobs(logprobs_NV, token_ids_N[:2], 1)

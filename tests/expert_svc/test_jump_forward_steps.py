"""Jump-forward end to end in one process: the gateway's Batcher plans, a StepRunner on the bundled demo
model runs the steps (two in flight, as the engine overlaps them, or one), and the forced tokens the
rank reports come back as chunks. With jump-forward the answers are the very tokens of decoding the
forced tokens one step each (greedy and seeded draws; the reference: the same rank, whose reports the
gateway drops), in fewer steps, and they validate. A gateway with jump-forward off asks the rank for
no reports at all."""

import collections

import pytest

from gateway.batcher import Batcher
from gateway.kv_accounting import RankKV
from gateway.requests import FinishReason, Sequence
from gateway.validation import ValidatedRequest
from services.constraints import Compiler
from services.step import NewSequence, SamplingSpec, ScheduledSequence, StepPlan
from services.text import IncrementalDetokenizer
from tests.expert_svc.test_constrained import BLOCK_SIZE, EPOCH, GROUP, NUM_BLOCKS, PROMPT, demo, make_runner, tokenizer
from tests.services.constraint_cases import CONSTRAINTS, check_output

__all__ = ["demo"]   # the demo model fixture, shared with test_constrained.py
SAMPLINGS = {"greedy": SamplingSpec(temperature=0.0), "drawn": SamplingSpec(temperature=1.0, seed=11)}
NAMES = ("ticket", "nested", "choice")


def serve(demo, *, jump_forward: bool, overlap: bool = True, max_new_tokens: int = 160,
          takes_jumps: bool = True) -> tuple[dict, int, Batcher]:
    """Every (constraint, sampling) of NAMES x SAMPLINGS at once: {(name, sampling): (token ids, text,
    finish reason)}, the steps run, and the batcher. takes_jumps False: the rank's forced tokens
    never reach the batcher (one decode step per token, with jump-forward's masks)."""
    runner = make_runner(demo)
    tok = tokenizer()
    batcher = Batcher([RankKV(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_cache=False)], max_running_requests=8,
                      max_batch_tokens=256, max_context=4096, eos_token_ids=tok.eos_token_ids,
                      jump_forward=jump_forward)
    seqs = {}
    for name in NAMES:
        for key, sampling in SAMPLINGS.items():
            request = ValidatedRequest(f"{name}-{key}", tok.encode(PROMPT), max_new_tokens, sampling, (), False,
                                       CONSTRAINTS[name])
            seqs[(name, key)] = seq = Sequence(batcher.new_seq_id(), request, IncrementalDetokenizer(tok))
            batcher.add(seq)
    outputs = collections.defaultdict(list)
    in_flight, num_steps = collections.deque(), 0
    while batcher.has_work or in_flight:
        if len(in_flight) < (2 if overlap else 1) and batcher.has_work:
            batch = batcher.schedule()
            if not batch.is_empty:
                in_flight.append((batch, runner.launch(batch.plans[0].to_step_plan(batch.step_id, GROUP, EPOCH))))
                num_steps += 1
                continue
        batch, launched = in_flight.popleft()
        result = runner.finish(launched)
        if not jump_forward:
            assert not result.forced   # the gateway asked for no reports
        forced = dict(result.forced) if takes_jumps else {}
        for seq, output in batcher.apply_results(batch.step_id, dict(result.tokens), forced=forced):
            outputs[seq.seq_id].append(output)
    answers = {}
    for key, seq in seqs.items():
        out = outputs[seq.seq_id]
        answers[key] = ([t for o in out for t in o.token_ids], "".join(o.text for o in out), out[-1].finish_reason)
    return answers, num_steps, batcher


@pytest.fixture(scope="module")
def one_by_one(demo):
    return serve(demo, jump_forward=True, takes_jumps=False)


def test_jump_forward_gives_the_same_tokens_in_fewer_steps(demo, one_by_one):
    answers, num_steps, batcher = serve(demo, jump_forward=True)
    reference, reference_steps, _ = one_by_one
    assert answers == reference
    for (name, _), (_, text, reason) in answers.items():
        assert reason is FinishReason.STOP
        check_output(name, text)
    assert batcher.stats.num_jump_forward_tokens > 0
    assert num_steps < reference_steps
    print(f"steps: {num_steps} with jump-forward, {reference_steps} without")


def test_without_jump_forward_the_answers_validate_and_nothing_is_reported(demo):
    answers, _, batcher = serve(demo, jump_forward=False)
    for (name, _), (_, text, reason) in answers.items():
        assert reason is FinishReason.STOP
        check_output(name, text)
    assert batcher.stats.num_jump_forward_tokens == 0


def test_without_overlap_and_at_max_new_tokens_the_tokens_are_the_same(demo, one_by_one):
    reference, _, _ = one_by_one
    answers, _, _ = serve(demo, jump_forward=True, overlap=False)
    assert answers == reference
    cut, _, batcher = serve(demo, jump_forward=True, max_new_tokens=9)
    for key, (token_ids, _, reason) in cut.items():
        # A chunk never takes the output past max_new_tokens: the same first 9 tokens, LENGTH.
        assert token_ids == reference[key][0][:9], key
        assert reason is (FinishReason.LENGTH if len(reference[key][0]) > 9 else FinishReason.STOP), key


def test_the_rank_emits_the_tokenizers_encoding_of_forced_text(demo, one_by_one):
    """Where the constraint allows one text only, the tokens are llguidance's forced ones: what the
    tokenizer makes of that text (the start of every ticket answer, `{"is_dispute": `)."""
    config, _ = demo
    forced = Compiler.for_tokenizer(tokenizer(), config.vocab_size).matcher(CONSTRAINTS["ticket"]).forced_token_ids()
    assert len(forced) >= 3 and tokenizer().decode(forced) == '{"is_dispute":'[:len(tokenizer().decode(forced))]
    reference, _, _ = one_by_one
    for key in SAMPLINGS:
        assert reference[("ticket", key)][0][:len(forced)] == forced


def test_a_chunk_with_no_token_before_its_forced_ones_is_a_refused_plan(demo):
    runner = make_runner(demo)
    new = NewSequence(0, SamplingSpec(temperature=0.0), (0, 1), constraint=CONSTRAINTS["choice"])
    with pytest.raises(ValueError, match="2 forced tokens in a chunk of 2"):
        runner.run_step(StepPlan(1, GROUP, EPOCH, (new,), (ScheduledSequence(0, (5, 6), num_forced=2),)))
    assert runner.seq_ids == []

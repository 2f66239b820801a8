"""The step contract (services/step.py) and its codec (services/step_codec.py)."""

import pytest

from gateway.plan import RankPlan
from moe.expert.v1 import expert_pb2
from services import step_codec
from services.step import (LogprobSpec, NewSequence, SamplingSpec, ScheduledSequence, SpecError, StepPlan, StepResult,
                           TokenLogprob)

PLAN = StepPlan(
    step_id=5, group_id="g", placement_epoch=2,
    new_sequences=(NewSequence(7, SamplingSpec(temperature=0.5, top_p=0.25, top_k=4, seed=2**64 - 1), (3, 4),
                               num_cached_tokens=16, traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01"),),
    scheduled=(ScheduledSequence(7, (30, 31), (3, 4), True), ScheduledSequence(8),
               ScheduledSequence(9, (5,), (), False), ScheduledSequence(10, (40, 41, 42), (5,), True, num_forced=2)),
    finished_seq_ids=(2, 6), max_tokens_per_rank=4, expert_placement_epoch=3, block_copies=((11, 3), (12, 4)))


def test_a_plan_is_written_field_by_field():
    S = expert_pb2.ScheduledSequence
    assert step_codec.plan_to_request(PLAN) == expert_pb2.ExecuteStepsRequest(plan=expert_pb2.StepPlan(
        step_id=5, group_id="g", placement_epoch=2, max_tokens_per_rank=4, expert_placement_epoch=3,
        new_sequences=[expert_pb2.NewSequence(
            seq_id=7, sampling=expert_pb2.SequenceSampling(temperature=0.5, top_p=0.25, top_k=4, seed=2**64 - 1),
            block_ids=[3, 4], num_cached_tokens=16, traceparent=PLAN.new_sequences[0].traceparent)],
        scheduled=[S(seq_id=7, token_ids=[30, 31], new_block_ids=[3, 4], is_sampled=True),
                   S(seq_id=8, is_sampled=True), S(seq_id=9, token_ids=[5], is_sampled=False),
                   S(seq_id=10, token_ids=[40, 41, 42], new_block_ids=[5], is_sampled=True, num_forced=2)],
        finished_seq_ids=[2, 6],
        block_copies=[expert_pb2.BlockCopy(source=11, destination=3), expert_pb2.BlockCopy(source=12, destination=4)]))


def test_a_plan_reads_back_equal():
    wire = step_codec.plan_to_request(PLAN).SerializeToString()
    assert step_codec.plan_from_pb(expert_pb2.ExecuteStepsRequest.FromString(wire).plan) == PLAN


def test_a_result_reads_back_equal():
    result = StepResult(step_id=9, tokens=((7, 151_643), (3, 0)), execute_seconds=0.25,
                        forced=((3, (11, 12)), (7, (13,))))
    wire = step_codec.result_to_response(result).SerializeToString()
    assert step_codec.result_from_pb(expert_pb2.ExecuteStepsResponse.FromString(wire).result) == result


def test_the_gateway_plan_freezes_into_the_contract():
    plan = RankPlan(0, list(PLAN.new_sequences), list(PLAN.scheduled), list(PLAN.finished_seq_ids),
                    list(PLAN.block_copies))
    assert plan.to_step_plan(5, "g", 2, max_tokens_per_rank=4, expert_placement_epoch=3) == PLAN
    assert PLAN.num_tokens == 2 + 1 + 1 + 3


def test_a_wire_plan_with_bad_sampling_is_refused_naming_the_field():
    request = step_codec.plan_to_request(PLAN)
    request.plan.new_sequences[0].sampling.top_p = 0.0
    with pytest.raises(SpecError, match=r"sampling.top_p must be in \(0, 1\], got 0.0") as info:
        step_codec.plan_from_pb(request.plan)
    assert info.value.field == "sampling.top_p"


@pytest.mark.parametrize("field, kwargs", [
    ("sampling.temperature", {"temperature": 2.5}),
    ("sampling.temperature", {"temperature": float("nan")}),
    ("sampling.top_k", {"top_k": -1}),
    ("sampling.seed", {"seed": 2**64}),
])
def test_sampling_spec_names_the_bad_field(field, kwargs):
    with pytest.raises(SpecError) as info:
        SamplingSpec(**kwargs)
    assert info.value.field == field and str(info.value).startswith(field)


def test_the_contract_does_not_import_torch():
    import subprocess
    import sys
    code = "import sys, services.step, services.step_codec; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_constrained_new_sequence_reads_back_equal():
    from services.step import Constraint
    for constraint, is_jump_forward in ((Constraint("json_schema", '{"type": "object"}'), True),
                                        (Constraint("json_object"), False), (Constraint("regex", "[a-z]+"), True),
                                        (Constraint("choice", ("yes", "no")), False)):
        plan = StepPlan(1, "g", 1, (NewSequence(3, SamplingSpec(), (0,), constraint=constraint,
                                                constraint_output_ids=(5, 6), is_jump_forward=is_jump_forward),))
        wire = step_codec.plan_to_request(plan).SerializeToString()
        assert step_codec.plan_from_pb(expert_pb2.ExecuteStepsRequest.FromString(wire).plan) == plan


def test_a_new_sequence_with_logprobs_reads_back_equal():
    new = NewSequence(4, SamplingSpec(), (1,), logprobs=LogprobSpec(logprobs=True, top_logprobs=20,
                                                                    prompt_logprobs=True))
    plan = StepPlan(1, "g", 1, new_sequences=(new, NewSequence(5, SamplingSpec(), (2,))))
    wire = step_codec.plan_to_request(plan).SerializeToString()
    assert step_codec.plan_from_pb(expert_pb2.ExecuteStepsRequest.FromString(wire).plan) == plan
    assert not expert_pb2.ExecuteStepsRequest.FromString(wire).plan.new_sequences[1].logprobs


def test_a_result_with_logprobs_reads_back_equal():
    # Values a float32 holds exactly: the wire's logprobs are float32, as the public API's.
    logprobs = ((7, 12, TokenLogprob(151_643, -0.5, ((3, -0.25), (151_643, -0.5)))), (3, 1, TokenLogprob(9, -8.0)))
    result = StepResult(step_id=9, tokens=((7, 151_643),), execute_seconds=0.25, logprobs=logprobs)
    wire = step_codec.result_to_response(result).SerializeToString()
    assert step_codec.result_from_pb(expert_pb2.ExecuteStepsResponse.FromString(wire).result) == result


def test_a_wire_plan_with_too_many_top_logprobs_is_refused_naming_the_field():
    request = step_codec.plan_to_request(StepPlan(1, "g", 1, new_sequences=(NewSequence(4, SamplingSpec(), (1,)),)))
    new = request.plan.new_sequences[0]
    new.logprobs, new.top_logprobs = True, 21
    with pytest.raises(SpecError) as error:
        step_codec.plan_from_pb(request.plan)
    assert error.value.field == "sampling.top_logprobs"
    new.logprobs = False  # alternatives without the token's own log-probability: not the contract
    new.top_logprobs = 3
    with pytest.raises(ValueError, match="without logprobs"):
        step_codec.plan_from_pb(request.plan)

"""The step contract (services/step.py) on the wire: moe.expert.v1 messages to and from it.

The only place that knows both shapes. Plans are encoded in place (repeated
fields' add/extend): a step plan holds hundreds of sequences, and message
objects built first and then copied in cost several times more.
"""

from moe.expert.v1 import expert_pb2
from services.step import (Constraint, LogprobSpec, NewSequence, SamplingSpec, ScheduledSequence, StepPlan,
                           StepResult, TokenLogprob)

_KIND_TO_PB = {
    "json_schema": expert_pb2.CONSTRAINT_KIND_JSON_SCHEMA, "json_object": expert_pb2.CONSTRAINT_KIND_JSON_OBJECT,
    "regex": expert_pb2.CONSTRAINT_KIND_REGEX, "grammar": expert_pb2.CONSTRAINT_KIND_GRAMMAR,
    "choice": expert_pb2.CONSTRAINT_KIND_CHOICE,
}
_KIND_FROM_PB = {pb: kind for kind, pb in _KIND_TO_PB.items()}


def plan_to_request(plan: StepPlan) -> expert_pb2.ExecuteStepsRequest:
    """The ExecuteStepsRequest that carries `plan`."""
    request = expert_pb2.ExecuteStepsRequest()
    pb = request.plan
    pb.step_id, pb.group_id, pb.placement_epoch = plan.step_id, plan.group_id, plan.placement_epoch
    pb.max_tokens_per_rank, pb.expert_placement_epoch = plan.max_tokens_per_rank, plan.expert_placement_epoch
    for s in plan.new_sequences:
        new = pb.new_sequences.add(seq_id=s.seq_id, num_cached_tokens=s.num_cached_tokens,
                                   traceparent=s.traceparent)
        sampling, spec = new.sampling, s.sampling
        sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed = (
            spec.temperature, spec.top_p, spec.top_k, spec.seed)
        new.block_ids.extend(s.block_ids)
        if s.constraint is not None:
            _constraint_to_pb(s.constraint, new.constraint)
            new.constraint_output_ids.extend(s.constraint_output_ids)
            new.jump_forward = s.is_jump_forward
        if s.logprobs:
            new.logprobs, new.top_logprobs, new.prompt_logprobs = (
                s.logprobs.logprobs, s.logprobs.top_logprobs, s.logprobs.prompt_logprobs)
    add = pb.scheduled.add
    for s in plan.scheduled:
        scheduled = add(seq_id=s.seq_id, is_sampled=s.is_sampled, num_forced=s.num_forced)
        if s.token_ids:
            scheduled.token_ids.extend(s.token_ids)
        if s.new_block_ids:
            scheduled.new_block_ids.extend(s.new_block_ids)
    pb.finished_seq_ids.extend(plan.finished_seq_ids)
    for source, destination in plan.block_copies:
        pb.block_copies.add(source=source, destination=destination)
    return request


def plan_from_pb(pb: expert_pb2.StepPlan) -> StepPlan:
    """The StepPlan of a wire plan; SpecError (a ValueError) for a value the contract refuses."""
    return StepPlan(
        step_id=pb.step_id,
        group_id=pb.group_id,
        placement_epoch=pb.placement_epoch,
        new_sequences=tuple(
            NewSequence(seq_id=s.seq_id, sampling=_sampling_from_pb(s.sampling), block_ids=tuple(s.block_ids),
                        num_cached_tokens=s.num_cached_tokens, traceparent=s.traceparent,
                        constraint=_constraint_from_pb(s.constraint) if s.HasField("constraint") else None,
                        constraint_output_ids=tuple(s.constraint_output_ids), is_jump_forward=s.jump_forward,
                        logprobs=LogprobSpec(s.logprobs, s.top_logprobs, s.prompt_logprobs))
            for s in pb.new_sequences),
        scheduled=tuple(
            ScheduledSequence(seq_id=s.seq_id, token_ids=tuple(s.token_ids),
                              new_block_ids=tuple(s.new_block_ids), is_sampled=s.is_sampled,
                              num_forced=s.num_forced)
            for s in pb.scheduled),
        finished_seq_ids=tuple(pb.finished_seq_ids),
        max_tokens_per_rank=pb.max_tokens_per_rank,
        expert_placement_epoch=pb.expert_placement_epoch,
        block_copies=tuple((c.source, c.destination) for c in pb.block_copies),
    )


def _sampling_from_pb(pb: expert_pb2.SequenceSampling) -> SamplingSpec:
    return SamplingSpec(temperature=pb.temperature, top_p=pb.top_p, top_k=pb.top_k, seed=pb.seed)


def _constraint_to_pb(constraint: Constraint, pb: expert_pb2.SequenceConstraint) -> None:
    pb.kind = _KIND_TO_PB[constraint.kind]
    if constraint.kind == "choice":
        pb.options.extend(constraint.text)
    else:
        pb.text = constraint.text


def _constraint_from_pb(pb: expert_pb2.SequenceConstraint) -> Constraint:
    kind = _KIND_FROM_PB.get(pb.kind)
    if kind is None:
        raise ValueError(f"constraint kind {pb.kind} is unknown")
    return Constraint(kind, tuple(pb.options) if kind == "choice" else pb.text)


def result_to_response(result: StepResult) -> expert_pb2.ExecuteStepsResponse:
    """The ExecuteStepsResponse that carries `result`."""
    response = expert_pb2.ExecuteStepsResponse()
    pb = response.result
    pb.step_id, pb.execute_seconds = result.step_id, result.execute_seconds
    add = pb.tokens.add
    for seq_id, token_id in result.tokens:
        add(seq_id=seq_id, token_id=token_id)
    add = pb.logprobs.add
    for seq_id, position, lp in result.logprobs:
        entry = add(seq_id=seq_id, position=position, token_id=lp.token_id, logprob=lp.logprob)
        if lp.top:
            entry.top_token_ids.extend(t for t, _ in lp.top)
            entry.top_logprobs.extend(v for _, v in lp.top)
    for seq_id, token_ids in result.forced:
        pb.forced.add(seq_id=seq_id, token_ids=token_ids)
    return response


def result_from_pb(pb: expert_pb2.StepResult) -> StepResult:
    """The StepResult of a wire result."""
    return StepResult(step_id=pb.step_id, tokens=tuple((t.seq_id, t.token_id) for t in pb.tokens),
                      execute_seconds=pb.execute_seconds,
                      logprobs=tuple((e.seq_id, e.position, TokenLogprob(
                          e.token_id, e.logprob, tuple(zip(e.top_token_ids, e.top_logprobs))))
                                     for e in pb.logprobs),
                      forced=tuple((f.seq_id, tuple(f.token_ids)) for f in pb.forced))

"""Jump-forward on the gateway: tokens a constraint forces, fed to the rank as one chunk.

A rank reports, with a constrained sequence's sampled token, the tokens its constraint forces
next (StepResult.forced), and emits the first of them at the sequence's next step, which the
gateway planned as a decode before it knew (overlap). `note` keeps what is still ahead for
the next schedule (Sequence.jump); `chunk_length` bounds the chunk; `schedule` plans it: the
token fed back, then the forced ones (ScheduledSequence.num_forced), sampling after the last.
The batcher appends the forced tokens to the output when the chunk's step is applied, before
its sampled token. Fewer steps, the same tokens (docs/internals.md, "Jump-forward").
"""

from gateway.kv_accounting import RankKV
from gateway.plan import RankPlan
from gateway.requests import Sequence, SeqStatus
from services.step import ScheduledSequence


def note(seq: Sequence, token_id: int, forced: tuple[int, ...], next_step: tuple[dict, dict] | None) -> None:
    """Keeps the tokens forced after token_id for the next schedule, where they are still ahead:
    nothing in flight for seq (token_id is fed back next), or one decode feeding token_id
    (`next_step`: the (sampled, jumps) of the step in flight), at which the rank emits forced[0]."""
    if seq.status is not SeqStatus.RUNNING or not seq.is_prefilled:
        return
    if seq.request.logprobs.logprobs:  # every output token reports its log-probability: each is sampled
        return
    if not seq.num_in_flight:
        seq.jump = (token_id, forced)
    elif (seq.num_in_flight == 1 and len(forced) > 1 and next_step is not None
          and seq.seq_id in next_step[0] and seq.seq_id not in next_step[1]):
        seq.jump = (forced[0], forced[1:])


def chunk_length(seq: Sequence, forced: tuple[int, ...], *, max_context: int, token_budget: int) -> int:
    """How many forced tokens the chunk takes: the output stays within max_new_tokens and the
    context with the sampled token after them, and the chunk (with its fed-back token) within
    token_budget."""
    return max(0, min(len(forced), seq.request.max_new_tokens - len(seq.output_ids) - seq.num_in_flight - 1,
                      max_context - seq.num_tokens - seq.num_in_flight - 1, token_budget - 1))


def schedule(plan: RankPlan, step, kv: RankKV, seq: Sequence, token_id: int, forced: tuple[int, ...]) -> None:
    """Adds seq's chunk to the plan (step: the schedule's admission.StepState): token_id, then
    the forced tokens, sampling after the last. The caller made room for its blocks."""
    num_after = seq.num_computed + 1 + len(forced)
    new_block_ids = kv.grow(seq.seq_id, num_after)
    plan.scheduled.append(ScheduledSequence(seq.seq_id, (token_id, *forced), tuple(new_block_ids), True,
                                            len(forced)))
    plan.num_tokens += 1 + len(forced)
    seq.num_computed = num_after
    seq.num_in_flight += 1 + len(forced)   # every token of the output it adds
    step.scheduled.append(seq)
    step.scheduled_ids.add(seq.seq_id)
    step.sampled[seq.seq_id] = seq
    step.jumps[seq.seq_id] = (token_id, forced)

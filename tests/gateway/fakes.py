"""Test doubles of the gateway's neighbours: a tokenizer, requests, and a simulated rank.

`SimRank` runs the step protocol on a simulated paged KV pool: each slot holds
the token id written there, and a sampled token is a function of every token
the sequence's block table reaches (`next_token(context)`). So a wrong block
table, a cached block with other tokens, or a block overwritten while another
sequence still reads it, changes the tokens: `reference_tokens` is what a
correct server returns. It also enforces the runner's checks and that no step
writes into a block that another live sequence's table holds.
"""

import asyncio
import dataclasses

from gateway.model_info import FEATURE_PREFIX_CACHE, ModelInfo
from gateway.validation import ValidatedRequest
from moe.expert.v1 import expert_pb2
from services import step_codec
from services.step import SamplingSpec

EOS = 1
# What a servicer over the fakes reports in GetModelInfo.
MODEL_INFO = ModelInfo(model_name="fake", architecture="Qwen3MoeForCausalLM", context_length=1000, vocab_size=100,
                       dtype="float32", num_experts=8, num_experts_per_tok=2, features=(FEATURE_PREFIX_CACHE,))


class FakeTokenizer:
    """Ids 26..51 are the letters a..z (any id decodes to a letter by id % 26); EOS is 1."""

    eos_token_ids = (EOS,)
    vocab_size = 100

    def decode(self, ids, skip_special_tokens=False) -> str:
        return "".join("<eos>" if i == EOS else chr(ord("a") + i % 26) for i in ids)

    def encode(self, text: str) -> list[int]:
        return [26 + (ord(c) - ord("a")) % 26 for c in text]

    def encode_chat(self, messages) -> list[int]:
        return self.encode("".join(role + content for role, content in messages))


def make_request(num_prompt=4, *, max_new_tokens=8, stops=(), ignore_eos=False, request_id="r",
                 prompt_ids=None) -> ValidatedRequest:
    return ValidatedRequest(
        request_id=request_id, prompt_ids=list(prompt_ids or [30] * num_prompt),
        max_new_tokens=max_new_tokens, sampling=SamplingSpec(temperature=0.0, seed=5), stops=tuple(stops),
        ignore_eos=ignore_eos)


def next_token(context: list[int]) -> int:
    """The simulated model: a letter id that depends on every token and its position."""
    acc = 17
    for token in context:
        acc = (acc * 31 + token) % 1_000_003
    return 26 + acc % 26


def fake_logprob(position: int, token_id: int) -> float:
    """SimRank's log-probability of token_id at position: tells a client's entries apart."""
    return -(position + token_id / 1000)


def fake_top(position: int, num_top: int) -> tuple[tuple[int, float], ...]:
    """SimRank's top_logprobs at position, most likely first."""
    return tuple((26 + k, -(position + k / 10)) for k in range(num_top))


def reference_tokens(prompt_ids: list[int], num_new: int) -> list[int]:
    """What a correct server generates from prompt_ids."""
    context = list(prompt_ids)
    for _ in range(num_new):
        context.append(next_token(context))
    return context[len(prompt_ids):]


@dataclasses.dataclass
class SimSeq:
    block_ids: list[int]
    num_computed: int
    pending: int | None = None
    # NewSequence's logprobs, top_logprobs and prompt_logprobs.
    logprobs: tuple[bool, int, bool] = (False, 0, False)
    # As the runner: the first token after a (re)start has no logits row before it to score it.
    is_started: bool = False


class SimRank:
    """One rank on the step protocol over a simulated KV pool (see the module doc)."""

    def __init__(self, num_blocks: int, block_size: int, *, fail_at_step: int = 0,
                 skew_step_ids: bool = False):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.slots: list[int | None] = [None] * (num_blocks * block_size)
        self.seqs: dict[int, SimSeq] = {}
        self.plans: list[expert_pb2.StepPlan] = []
        self.num_tokens_computed = 0
        self.num_block_copies = 0
        self.fail_at_step = fail_at_step
        self.skew_step_ids = skew_step_ids
        self._results: asyncio.Queue | None = None
        # (seq_id, position, token_id) of each token the last step scored (fake_logprob).
        self.scored: list[tuple[int, int, int]] = []

    def run(self, plan: expert_pb2.StepPlan) -> dict[int, int]:
        """Executes one plan; returns seq_id -> sampled token."""
        assert plan.step_id == len(self.plans) + 1, (plan.step_id, len(self.plans))
        self.plans.append(plan)
        for seq_id in plan.finished_seq_ids:
            del self.seqs[seq_id]
        for new in plan.new_sequences:
            assert new.seq_id not in self.seqs, f"new sequence {new.seq_id} is already known"
            assert new.num_cached_tokens <= len(new.block_ids) * self.block_size
            self.seqs[new.seq_id] = SimSeq(list(new.block_ids), new.num_cached_tokens,
                                           logprobs=(new.logprobs, new.top_logprobs, new.prompt_logprobs))
        bs = self.block_size
        copied = [self.slots[c.source * bs:(c.source + 1) * bs] for c in plan.block_copies]  # all read first
        for copy, values in zip(plan.block_copies, copied):
            assert any(copy.destination in self.seqs[new.seq_id].block_ids for new in plan.new_sequences), \
                f"block copy into {copy.destination}, no new sequence's block"
            self.slots[copy.destination * bs:(copy.destination + 1) * bs] = values
        self.num_block_copies += len(plan.block_copies)
        tokens, self.scored = {}, []
        for item in plan.scheduled:
            seq = self.seqs[item.seq_id]
            seq.block_ids += item.new_block_ids
            assert all(0 <= b < self.num_blocks for b in seq.block_ids)
            inputs = list(item.token_ids) or [seq.pending]
            assert inputs[-1] is not None, "decode step before any token was sampled"
            seq.pending = None
            if item.token_ids and seq.logprobs[2]:  # as the runner: each row scores the next token
                self.scored += [(item.seq_id, seq.num_computed + j, t) for j, t in enumerate(inputs)
                                if j > 0 or seq.is_started]
            seq.is_started = True
            self._write(item.seq_id, seq, inputs)
            if item.is_sampled:
                context = [self.slots[self._slot(seq, p)] for p in range(seq.num_computed)]
                assert None not in context, "attention over a slot never written"
                seq.pending = tokens[item.seq_id] = next_token(context)
                if seq.logprobs[0]:
                    self.scored.append((item.seq_id, seq.num_computed, seq.pending))
        return tokens

    def logprobs_pb(self) -> list[expert_pb2.PositionLogprob]:
        """The last step's scored tokens on the wire."""
        return [expert_pb2.PositionLogprob(
            seq_id=s, position=p, token_id=t, logprob=fake_logprob(p, t),
            top_token_ids=[i for i, _ in fake_top(p, self.seqs[s].logprobs[1])],
            top_logprobs=[v for _, v in fake_top(p, self.seqs[s].logprobs[1])]) for s, p, t in self.scored]

    def _slot(self, seq: SimSeq, position: int) -> int:
        block = seq.block_ids[position // self.block_size]
        return block * self.block_size + position % self.block_size

    def _write(self, seq_id: int, seq: SimSeq, inputs: list[int]) -> None:
        assert len(seq.block_ids) * self.block_size >= seq.num_computed + len(inputs), "blocks too few"
        for token in inputs:
            block = seq.block_ids[seq.num_computed // self.block_size]
            holders = [i for i, s in self.seqs.items() if i != seq_id and block in s.block_ids]
            assert not holders, f"seq {seq_id} writes block {block}, which seqs {holders} hold"
            self.slots[self._slot(seq, seq.num_computed)] = token
            seq.num_computed += 1
            self.num_tokens_computed += 1

    # The async stream face, as the engine drives a rank.

    async def write(self, request: expert_pb2.ExecuteStepsRequest) -> None:
        if self._results is None:
            self._results = asyncio.Queue()
        plan = request.plan
        if plan.step_id == self.fail_at_step:
            self.plans.append(plan)
            self._results.put_nowait(ConnectionResetError("rank crashed"))
            return
        tokens = self.run(plan)
        step_id = plan.step_id + (1 if self.skew_step_ids else 0)
        self._results.put_nowait(expert_pb2.ExecuteStepsResponse(result=expert_pb2.StepResult(
            step_id=step_id, tokens=[expert_pb2.SampledToken(seq_id=s, token_id=t) for s, t in tokens.items()],
            logprobs=self.logprobs_pb())))

    async def read(self):
        result = await self._results.get()
        if isinstance(result, Exception):
            raise result
        return result


def run_batch(ranks: list[SimRank], batch) -> dict[int, int]:
    """Runs a StepBatch's plans on the simulated ranks: the step's sampled tokens."""
    tokens = {}
    for rank, plan in zip(ranks, batch.plans):
        tokens.update(rank.run(step_codec.plan_to_request(plan.to_step_plan(batch.step_id, "g", 1)).plan))
    return tokens

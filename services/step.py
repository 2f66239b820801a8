"""The step contract: what a gateway asks of a rank in one step, and what the rank answers.

One set of torch-free, frozen types shared by the gateway, which plans in
them, and the expert service, which executes them; services/step_codec.py
is the one translation to and from moe.expert.v1. A new per-sequence option
is one field here, one field in the proto and one line in the codec.

A plan carries diffs against the rank's state (architecture.md, "One decode
step"): new sequences in full, known ones as appended blocks, finished ids.
Values are checked once, when a type is built: SamplingSpec raises
SpecError naming the field; the rank's own checks of a plan against its
state (known ids, block counts) are in expert_svc/runner.py.
"""

import dataclasses

# Temperatures below it sample greedily (as vLLM does): dividing the logits by
# a subnormal temperature overflows them to inf and the softmax to NaN, and at
# such a temperature every token but the argmax has a probability of ~0 anyway.
MIN_TEMPERATURE = 1e-5
# The highest temperature a request may ask for.
MAX_TEMPERATURE = 2.0
# Seeds are uint64 on the wire.
MAX_SEED = 2**64 - 1
# The most alternatives a position's log-probability may list (OpenAI's and vLLM's default cap).
MAX_TOP_LOGPROBS = 20


class SpecError(ValueError):
    """A value breaks the step contract; `field` names it as the public API spells it."""

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(f"{field} {detail}")
        self.field = field


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingSpec:
    """How one sequence chooses its tokens."""

    # 0 (or below MIN_TEMPERATURE) means greedy (argmax); otherwise the logits are divided by it.
    temperature: float = 1.0
    # Keep the smallest set of most likely tokens whose probability reaches top_p; 1 keeps all.
    top_p: float = 1.0
    # Keep the top_k most likely tokens; 0 keeps all.
    top_k: int = 0
    # Keys the sequence's draws together with each token's position (services/model/sampling.py).
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.temperature <= MAX_TEMPERATURE:  # also false for NaN
            raise SpecError("sampling.temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise SpecError("sampling.top_p", f"must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise SpecError("sampling.top_k", f"must not be negative (0 keeps all), got {self.top_k}")
        if not 0 <= self.seed <= MAX_SEED:
            raise SpecError("sampling.seed", f"must be in [0, 2**64), got {self.seed}")

    @property
    def is_greedy(self) -> bool:
        """True if sampling is argmax."""
        return self.temperature < MIN_TEMPERATURE

    @property
    def is_filtered(self) -> bool:
        """True if top-k or top-p removes tokens before the draw."""
        return bool(self.top_k) or self.top_p < 1


GREEDY = SamplingSpec(temperature=0.0)


@dataclasses.dataclass(frozen=True, slots=True)
class LogprobSpec:
    """Which log-probabilities a sequence reports: the log-softmax of the raw fp32 logits,
    before temperature, top-p, top-k and any constraint's mask (docs/internals.md)."""

    # The sampled token's.
    logprobs: bool = False
    # The most likely tokens listed at each reported position; above 0 only with logprobs.
    top_logprobs: int = 0
    # Every prompt token's after the first, given the tokens before it.
    prompt_logprobs: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise SpecError("sampling.top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError(f"top_logprobs {self.top_logprobs} without logprobs")

    def __bool__(self) -> bool:
        return self.logprobs or self.prompt_logprobs


NO_LOGPROBS = LogprobSpec()


@dataclasses.dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The log-probability of one token at its position, and the most likely tokens there."""

    token_id: int
    logprob: float
    # (token_id, logprob) of the LogprobSpec.top_logprobs most likely tokens, most likely first.
    top: tuple[tuple[int, float], ...] = ()

# Constraint kinds (services/constraints.py compiles them).
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
# The public API's field of each kind (moe.gateway.v1.SamplingParams' oneof constraint).
CONSTRAINT_FIELDS = {kind: f"sampling.{kind}" for kind in CONSTRAINT_KINDS}


class ConstraintError(SpecError):
    """A constraint that cannot be compiled; `field` names it as the public API spells it."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(field, reason)
        self.reason = reason


@dataclasses.dataclass(frozen=True, slots=True)
class Constraint:
    """What a sequence's output must satisfy: the step contract's shape of a request's constraint.

    `text` is the JSON Schema document, the regex or the grammar; "" for json_object; for
    choice, the tuple of options. Equal constraints share one compiled form.
    """

    kind: str
    text: str | tuple[str, ...] = ""

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise ValueError(f"constraint kind must be one of {', '.join(CONSTRAINT_KINDS)}, got {self.kind!r}")
        if self.kind == "choice":
            if not isinstance(self.text, tuple) or not all(isinstance(o, str) for o in self.text):
                raise ValueError(f"a choice's options are a tuple of strings, got {self.text!r}")
            if not self.text:
                raise ConstraintError(self.field, "must list at least one option")
            if not all(self.text):
                raise ConstraintError(self.field, f"option {self.text.index('') + 1} is empty")
        elif not isinstance(self.text, str):
            raise ValueError(f"a {self.kind} constraint's text is a string, got {self.text!r}")
        elif self.kind == "json_object" and self.text:
            raise ValueError(f"a json_object constraint has no text, got {self.text!r}")

    @property
    def field(self) -> str:
        """The public API field that carries it."""
        return CONSTRAINT_FIELDS[self.kind]


@dataclasses.dataclass(frozen=True, slots=True)
class NewSequence:
    """A sequence a rank sees for the first time, in full."""

    seq_id: int
    sampling: SamplingSpec
    # The sequence's KV blocks, in order.
    block_ids: tuple[int, ...]
    # Tokens whose KV is already in the first blocks (a cached prefix).
    num_cached_tokens: int = 0
    # W3C traceparent of the request's root span at the gateway; empty when untraced.
    traceparent: str = ""
    # What the output must satisfy (None: free); the rank masks the sequence's logits by it.
    constraint: Constraint | None = None
    # The output generated so far, for a resumed constrained sequence: its matcher replays them.
    constraint_output_ids: tuple[int, ...] = ()
    # Jump-forward: the rank reports the tokens the constraint forces after each sampled one
    # (StepResult.forced) and lets the row take only the first of them; False spares that host
    # work for a gateway that takes no jumps.
    is_jump_forward: bool = False
    # The log-probabilities it reports (prompt_logprobs only while the gateway still needs them).
    logprobs: LogprobSpec = NO_LOGPROBS


@dataclasses.dataclass(frozen=True, slots=True)
class ScheduledSequence:
    """One sequence's work in a step."""

    seq_id: int
    # A prompt chunk; empty for a decode step (the rank feeds back the token it sampled last).
    token_ids: tuple[int, ...] = ()
    # Blocks appended to the block table before the step.
    new_block_ids: tuple[int, ...] = ()
    # Sample a token after this chunk (false for all but a prompt's last chunk).
    is_sampled: bool = True
    # Jump-forward: the chunk's last num_forced tokens are output the sequence's constraint
    # forces (services/constraints.py); its matcher accepts them before the sampled token.
    num_forced: int = 0

    @property
    def num_inputs(self) -> int:
        """Input tokens this step: the chunk's, or the one token fed back."""
        return len(self.token_ids) or 1


@dataclasses.dataclass(frozen=True, slots=True)
class StepPlan:
    """One step of one rank: diffs against its state, applied as finished, then new, then scheduled."""

    # Consecutive within a step stream, from 1.
    step_id: int
    # The worker group and its placement epoch; a rank refuses a plan for another.
    group_id: str
    placement_epoch: int
    new_sequences: tuple[NewSequence, ...] = ()
    # The step's work; empty is an idle step, which the rank still runs so the collectives line up.
    scheduled: tuple[ScheduledSequence, ...] = ()
    finished_seq_ids: tuple[int, ...] = ()
    # The largest input token count of any rank in this step (the same in every rank's plan);
    # it picks the MoE dispatch capacity without a collective. 0 = unknown (found with an all_reduce).
    max_tokens_per_rank: int = 0
    # The expert placement (replicas in spare slots) to run the step with.
    expert_placement_epoch: int = 0
    # (source, destination) KV blocks copied, every layer's keys and values, after the diffs
    # and before the step's work (all sources read first): a new sequence whose cached prefix
    # ends inside a block starts on its own copy of it.
    block_copies: tuple[tuple[int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        """Input tokens of the step on this rank (a decode counts one)."""
        return sum(s.num_inputs for s in self.scheduled)


@dataclasses.dataclass(frozen=True, slots=True)
class StepResult:
    """The outcome of one step on one rank."""

    step_id: int
    # (seq_id, token_id) of every scheduled sequence that sampled, in plan order.
    tokens: tuple[tuple[int, int], ...]
    # Time the rank spent executing the step.
    execute_seconds: float
    # (seq_id, position, log-probability) of each token scored for a sequence that asked
    # (NewSequence.logprobs): position is the token's index in its sequence; the sampled
    # token's and its prompt chunk's, by sequence in plan order, then by position.
    logprobs: tuple[tuple[int, int, TokenLogprob], ...] = ()
    # (seq_id, token ids) of each constrained sequence whose constraint forces tokens after its
    # sampled one (jump-forward: the gateway may append them as one chunk).
    forced: tuple[tuple[int, tuple[int, ...]], ...] = ()

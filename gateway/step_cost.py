"""What a step costs on a rank: a fixed-shape linear model, with a few bounded numbers fit online.

    work_ms = scale * (fixed + per_decode * decodes + per_token * prefill_tokens + per_pair * pairs)
    step_ms = max(floor, work_ms) for a step with prefill, decode_scale / scale * work_ms without

`pairs` is, summed over the step's prefill chunks, chunk tokens times the mean
context they attend to (start + tokens / 2): the quadratic part of a long
prompt. The coefficients are shaped like one H200 running the Qwen3-30B-A3B
shape in bf16 (a few ms a step, ~0.09 ms a decode row, ~10 us a prompt token
plus its attention), so the budget is sound from the first step, before any
measurement.

A step that carries prefill runs eagerly, and an eager step has a cost of its
own whatever it holds (the host launching every layer's kernels, every expert's
weights read once a step touches them all): `floor`, the least such a step
takes, tracked as a low quantile of the measured times of steps with prefill
(it moves down fast and up slowly; prior 0: the model does not guess it).
Decode-only steps replay CUDA graphs, priced by their own `decode_scale`.
`scale` is the ratio of measured to modelled time of steps with at least
FIT_MIN_PREFILL_TOKENS of prefill measured clearly above the floor, or priced
by the model above their measured time: at the floor a step's time says
nothing of its work but an upper bound. (Fitting the scale to floor-bound steps
has a stable wrong answer: a doubled scale explains them, keeps the budget's
steps small, and so keeps them floor-bound.)
The measure is the rank's own
StepResult.execute_seconds: with pipelined steps a rank counts a step from its
launch or, if it was launched ahead, from the end of the step before it, so
it is the step's own device time and not the wall time the gateway sees
between a plan and its result (which holds the step before it too). The
scales move as exponential averages of log ratios, the floor as one of times;
none leaves its bounds ([MIN_SCALE, MAX_SCALE], [0, MAX_FLOOR_MS]): a device slower or faster than the prior, or a
misleading measure, can shift the budget by at most that factor, so prefill
is never priced out of the steps (a fit of several free coefficients to
collinear features could do that, and extrapolate wildly).

Pure arithmetic, no I/O.
"""

import dataclasses
import math

# Priors (ms): a step's fixed cost, a decode row, a prompt token, a (token, context token) pair.
FIXED_MS = 2.5
DECODE_MS = 0.09
TOKEN_MS = 0.0095
PAIR_MS = 1.2e-6
# The fit's bounds and pace.
MIN_SCALE = 0.5
MAX_SCALE = 2.0
FIT_WEIGHT = 0.05
FIT_MIN_PREFILL_TOKENS = 256
MAX_DECODE_SCALE = 4.0
MAX_FLOOR_MS = 200.0
FLOOR_WEIGHT = 0.2
FLOOR_UP_SLOWER = 10.0
# A step measured this far above the floor is work-bound.
ABOVE_FLOOR = 1.25


@dataclasses.dataclass(slots=True)
class StepShape:
    """The work of one rank's step, as the cost model sees it."""

    num_decodes: int = 0
    num_prefill_tokens: int = 0
    # Sum over prefill chunks of tokens * (start + tokens / 2).
    pairs: float = 0.0

    def add_chunk(self, start: int, num_tokens: int) -> None:
        """Counts a prefill chunk of num_tokens tokens at positions start..start+num_tokens-1."""
        self.num_prefill_tokens += num_tokens
        self.pairs += num_tokens * (start + num_tokens / 2)


@dataclasses.dataclass(slots=True)
class StepCost:
    """The model; `scale` is the fitted factor (1: the priors as they are)."""

    fixed_ms: float = FIXED_MS
    decode_ms: float = DECODE_MS
    token_ms: float = TOKEN_MS
    pair_ms: float = PAIR_MS
    scale: float = 1.0
    floor_ms: float = 0.0
    decode_scale: float = 1.0

    def __post_init__(self) -> None:
        for name in ("fixed_ms", "decode_ms", "token_ms", "pair_ms"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be finite and >= 0, got {getattr(self, name)}")
        if self.token_ms <= 0:
            raise ValueError(f"token_ms must be positive, got {self.token_ms}")
        self.scale = min(MAX_SCALE, max(MIN_SCALE, self.scale))
        self.floor_ms = min(MAX_FLOOR_MS, max(0.0, self.floor_ms))
        self.decode_scale = min(MAX_DECODE_SCALE, max(MIN_SCALE, self.decode_scale))

    def base_ms(self, num_decodes: int, num_other_tokens: int = 0) -> float:
        """A step with num_decodes decode rows and num_other_tokens tokens priced like
        prompt tokens at no depth (jump-forward chunks), before any prefill chunk."""
        return self.scale * (self.fixed_ms + self.decode_ms * num_decodes + self.token_ms * num_other_tokens)

    def chunk_ms(self, start: int, num_tokens: int) -> float:
        """The cost a prefill chunk of num_tokens tokens from position start adds to a step."""
        return self.scale * num_tokens * (self.token_ms + self.pair_ms * (start + num_tokens / 2))

    def predict_ms(self, shape: StepShape) -> float:
        """The step's work (no floor)."""
        return self.scale * (self.fixed_ms + self.decode_ms * shape.num_decodes
                             + self.token_ms * shape.num_prefill_tokens + self.pair_ms * shape.pairs)

    def step_ms(self, shape: StepShape) -> float:
        """What the step takes: its work, at least the floor with prefill; decode-only at its own scale."""
        if shape.num_prefill_tokens:
            return max(self.floor_ms, self.predict_ms(shape))
        return self.decode_step_ms(shape.num_decodes)

    def decode_step_ms(self, num_decodes: int) -> float:
        """A decode-only step of num_decodes rows."""
        return self.decode_scale * (self.fixed_ms + self.decode_ms * num_decodes)

    def tokens_within(self, ms: float, start: int) -> int:
        """The most tokens of a chunk from position start whose chunk_ms is within ms (0 if none)."""
        if ms <= 0:
            return 0
        # scale * (pair/2 * n^2 + (token + pair * start) * n) = ms
        a = self.scale * self.pair_ms / 2
        b = self.scale * (self.token_ms + self.pair_ms * start)
        n = ms / b if a == 0 else (-b + math.sqrt(b * b + 4 * a * ms)) / (2 * a)
        return max(0, int(n))

    def observe(self, shape: StepShape, measured_ms: float) -> bool:
        """Fits the floor and the scales to a step's measured time (module docstring); True if
        one of them moved (non-positive or infinite times are ignored)."""
        if not 0 < measured_ms < math.inf or not (shape.num_prefill_tokens or shape.num_decodes):
            return False
        if not shape.num_prefill_tokens:
            ratio = measured_ms / (self.fixed_ms + self.decode_ms * shape.num_decodes)
            self.decode_scale = _towards(self.decode_scale, ratio, MIN_SCALE, MAX_DECODE_SCALE)
            return True
        # The floor follows a low quantile of these steps' times (down fast, up slowly): the least a
        # step with prefill takes, whatever its size.
        weight = FLOOR_WEIGHT if measured_ms < self.floor_ms else FLOOR_WEIGHT / FLOOR_UP_SLOWER
        self.floor_ms = min(MAX_FLOOR_MS, max(0.0, self.floor_ms + weight * (measured_ms - self.floor_ms)))
        # The scale learns from steps measured clearly above the floor (their time is their work),
        # and from steps the model prices above their time (at the floor, a step's time is only
        # an upper bound of its work, which still corrects a scale too high); other floor-bound
        # steps say nothing of it.
        work_ms = self.predict_ms(shape)
        if shape.num_prefill_tokens >= FIT_MIN_PREFILL_TOKENS and (
                measured_ms > ABOVE_FLOOR * self.floor_ms or work_ms > ABOVE_FLOOR * measured_ms):
            self.scale = _towards(self.scale, measured_ms / (work_ms / self.scale), MIN_SCALE, MAX_SCALE)
        return True


def _towards(value: float, ratio: float, low: float, high: float) -> float:
    """value moved FIT_WEIGHT of the way to ratio in log space, within [low, high]."""
    ratio = min(high, max(low, ratio))
    return min(high, max(low, math.exp((1 - FIT_WEIGHT) * math.log(value) + FIT_WEIGHT * math.log(ratio))))

"""What a step costs on the ranks: a linear model of step time, fit online.

    step_ms ~ a + b * decode_rows + c * prefill_tokens + d * attention_pairs

`attention_pairs` is, summed over the step's prefill chunks, chunk tokens times
the mean context they attend to (start + tokens / 2): the quadratic part of a
long prompt. The model starts from priors shaped like one H200 running the
Qwen3-30B-A3B shape (a few ms of fixed cost, ~0.1 ms a decode row, ~11 ms per
1,000 prefill tokens) and follows the ranks from the first step on: every step
the gateway applies brings the ranks' own execute times (StepResult), and a
recursive least-squares update with forgetting moves the coefficients to them
(a window of a few hundred steps, so a change of load or placement is followed).

Features are scaled to similar magnitudes (hundreds of rows, thousands of
tokens, millions of pairs) so the least-squares state stays well conditioned.
The covariance is bounded (its trace never exceeds the prior's): in a
direction no step excites (only decodes for a while) forgetting would
otherwise inflate it without bound and the next prefill would swing the fit.
A residual is clipped to the size of the prediction (at least CLIP_MS), so
one slow step (a cold cache, a compile) does not undo the fit.

Pure arithmetic, no I/O: StepBudget (gateway/step_budget.py) asks it what a
step will cost; the batcher feeds it what steps did cost.
"""

import dataclasses
import math
from collections.abc import Sequence as Seq

# Feature scales: rows per 100, tokens per 1,000, attention pairs per 1e6.
_SCALES = (1.0, 1e-2, 1e-3, 1e-6)
# Priors in ms per scaled unit (see the module docstring), and their spread.
PRIOR_MS = (3.0, 9.0, 11.0, 0.6)
_PRIOR_VAR = (100.0, 100.0, 100.0, 10.0)
# The least a prefill token may cost in the budget (ms per 1,000): a fit that has
# seen no prefill yet never promises an unbounded chunk.
_MIN_PREFILL_MS = 0.1
FORGETTING = 0.995
CLIP_MS = 5.0


@dataclasses.dataclass(slots=True)
class StepShape:
    """The work of one rank's step, as the cost model sees it."""

    num_decodes: int = 0
    num_prefill_tokens: int = 0
    # Sum over prefill chunks of tokens * (start + tokens / 2).
    attention_pairs: float = 0.0

    def add_chunk(self, start: int, num_tokens: int) -> None:
        """Counts a prefill chunk of num_tokens tokens at positions start..start+num_tokens-1."""
        self.num_prefill_tokens += num_tokens
        self.attention_pairs += num_tokens * (start + num_tokens / 2)

    def features(self) -> tuple[float, float, float, float]:
        raw = (1.0, self.num_decodes, self.num_prefill_tokens, self.attention_pairs)
        return tuple(x * s for x, s in zip(raw, _SCALES))


class StepCostModel:
    """step_ms = theta . features(shape), fit by recursive least squares with forgetting."""

    def __init__(self, prior_ms: tuple[float, ...] = PRIOR_MS) -> None:
        if len(prior_ms) != 4 or any(not math.isfinite(v) or v < 0 for v in prior_ms):
            raise ValueError(f"prior_ms must be 4 finite non-negative coefficients, got {prior_ms}")
        self.theta = list(prior_ms)
        self._p = [[_PRIOR_VAR[i] if i == j else 0.0 for j in range(4)] for i in range(4)]
        self._max_trace = sum(_PRIOR_VAR)
        self.num_observed = 0

    # The coefficients the budget uses: none negative, a prefill token never free.

    @property
    def fixed_ms(self) -> float:
        return max(0.0, self.theta[0])

    @property
    def ms_per_decode(self) -> float:
        return max(0.0, self.theta[1]) * _SCALES[1]

    @property
    def ms_per_prefill_token(self) -> float:
        return max(_MIN_PREFILL_MS, self.theta[2]) * _SCALES[2]

    @property
    def ms_per_attention_pair(self) -> float:
        return max(0.0, self.theta[3]) * _SCALES[3]

    def coefficients(self) -> dict[str, float]:
        """The coefficients the budget uses, for the stats file: ms per step, decode, 1,000
        prefill tokens, and 1e6 attention pairs."""
        return {"fixed": round(self.fixed_ms, 4), "per_decode": round(self.ms_per_decode, 5),
                "per_1k_prefill_tokens": round(1e3 * self.ms_per_prefill_token, 4),
                "per_1m_attention_pairs": round(1e6 * self.ms_per_attention_pair, 4)}

    def predict_ms(self, shape: StepShape) -> float:
        """The predicted duration of a step of this shape."""
        return (self.fixed_ms + self.ms_per_decode * shape.num_decodes
                + self.ms_per_prefill_token * shape.num_prefill_tokens
                + self.ms_per_attention_pair * shape.attention_pairs)

    def chunk_ms(self, start: int, num_tokens: int) -> float:
        """What a prefill chunk of num_tokens tokens from position start adds to a step."""
        return num_tokens * (self.ms_per_prefill_token + self.ms_per_attention_pair * (start + num_tokens / 2))

    def tokens_within(self, ms: float, start: int) -> int:
        """The most prefill tokens from position start whose chunk_ms fits in ms."""
        if ms <= 0:
            return 0
        # Solve d/2 n^2 + (c + d start) n - ms = 0 for n.
        half_d = self.ms_per_attention_pair / 2
        linear = self.ms_per_prefill_token + self.ms_per_attention_pair * start
        if half_d <= 0:
            return int(ms / linear)
        return int((-linear + math.sqrt(linear * linear + 4 * half_d * ms)) / (2 * half_d))

    def observe_step(self, shapes: Seq[StepShape], step_seconds: Seq[float]) -> bool:
        """Fits the model to one step of a group (shapes and execute seconds by rank); True if
        it was used. The ranks step together (their collectives), so the step took the slowest
        rank's time, and its work is the costliest rank's; a step that only forgets sequences
        runs no model and is not used."""
        if not shapes or not step_seconds:
            return False
        shape = max(shapes, key=self.predict_ms)
        if not (shape.num_decodes or shape.num_prefill_tokens):
            return False
        self.observe(shape, 1e3 * max(step_seconds))
        return True

    def observe(self, shape: StepShape, step_ms: float) -> None:
        """Moves the fit towards one measured step (ignored unless positive and finite)."""
        if not 0 < step_ms < math.inf:
            return
        x = shape.features()
        predicted = sum(t * v for t, v in zip(self.theta, x))
        bound = max(CLIP_MS, abs(predicted))
        error = min(bound, max(-bound, step_ms - predicted))
        px = [sum(self._p[i][j] * x[j] for j in range(4)) for i in range(4)]
        denom = FORGETTING + sum(x[i] * px[i] for i in range(4))
        gain = [v / denom for v in px]
        for i in range(4):
            self.theta[i] += gain[i] * error
        for i in range(4):
            for j in range(4):
                self._p[i][j] = (self._p[i][j] - gain[i] * px[j]) / FORGETTING
        trace = sum(self._p[i][i] for i in range(4))
        if trace > self._max_trace:
            scale = self._max_trace / trace
            self._p = [[v * scale for v in row] for row in self._p]
        self.num_observed += 1

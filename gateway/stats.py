"""The gateway's counters and timings: prefix-cache hits, preemptions, per-step host time.

One `GatewayStats` per gateway process, shared by the batcher and engine of
every group it serves. `snapshot()` is a JSON-ready dict; `write_json` writes
it atomically (the `--stats-file` of the gateway, which bench/serve.py reads).
Pure bookkeeping: no I/O but write_json, no locks (one event loop).
"""

import collections
import dataclasses
import json
import math
import os
import pathlib

# Step timings kept for the percentiles: the most recent ones.
_NUM_TIMINGS = 20_000
# Steps with prefill kept with their shapes (GatewayStats.recent_steps): about 12 s of a loaded
# rank's prefill steps; the stats file carries them all (five numbers a step).
RECENT_STEPS = 512


def percentile(values, q: float) -> float:
    """The q-th percentile (0..100) by nearest rank; 0.0 for no values."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


@dataclasses.dataclass(slots=True)
class GatewayStats:
    """Cumulative since the gateway started."""

    # Requests queued, refused because the waiting queue was full, and refused because their
    # predicted time to first token was past what their class may wait (gateway/step_budget.py).
    num_requests: int = 0
    num_rejected_queue_full: int = 0
    num_rejected_overload: int = 0
    num_deadline_exceeded: int = 0
    num_aborted: int = 0
    # Prompt tokens of requests admitted for the first time, and how many of
    # them came from the prefix cache (the hit rate is the ratio).
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    # KV blocks copied for cached prefixes that end inside a block.
    num_block_copies: int = 0
    num_preemptions: int = 0
    # Tokens prefilled again after a preemption (cache hits excluded).
    num_recomputed_tokens: int = 0
    num_steps: int = 0
    num_step_tokens: int = 0
    # Output tokens a constraint forced that jump-forward appended without a step of their own.
    num_jump_forward_tokens: int = 0
    # The step-cost model's fitted scale (gateway/step_cost.py; 1: its priors as they are).
    step_cost_scale: float = 1.0
    # Its floor: the least a step with prefill takes, in ms; and the decode-only steps' scale.
    step_floor_ms: float = 0.0
    step_decode_scale: float = 1.0
    # Steps whose ranks' times came back, with and without prefill: how many, their summed
    # time (the slowest rank's, ms), their prefill tokens; and the prefill tokens of the
    # latest steps (0 for a decode-only one), for percentiles over a window.
    num_prefill_steps: int = 0
    num_decode_steps: int = 0
    prefill_step_ms: float = 0.0
    decode_step_ms: float = 0.0
    num_step_prefill_tokens: int = 0
    recent_prefill_tokens: collections.deque = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=_NUM_TIMINGS))
    # The latest steps with prefill as [prefill tokens, decodes, the prefill tokens' mean context,
    # the cost model's ms, the ranks' ms]: what a step of that shape costs, to check the model (and
    # to fit a device to: bench/serving/goodput.py).
    recent_steps: collections.deque = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=RECENT_STEPS))
    # Host seconds per step: planning (schedule + protobuf) and applying results.
    plan_s: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=_NUM_TIMINGS))
    apply_s: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=_NUM_TIMINGS))

    @property
    def prefix_hit_rate(self) -> float:
        """Share of first-admission prompt tokens served from the prefix cache."""
        return self.num_cached_prompt_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    def record_step_time(self, num_prefill_tokens: int, ms: float, sample: list | None = None) -> None:
        """A step's prefill tokens and its ranks' (slowest) time, once its results are back; sample:
        its entry of recent_steps."""
        if sample is not None:
            self.recent_steps.append(sample)
        if num_prefill_tokens:
            self.num_prefill_steps += 1
            self.prefill_step_ms += ms
            self.num_step_prefill_tokens += num_prefill_tokens
        else:
            self.num_decode_steps += 1
            self.decode_step_ms += ms
        self.recent_prefill_tokens.append(num_prefill_tokens)

    def record_step(self, num_tokens: int, plan_s: float) -> None:
        self.num_steps += 1
        self.num_step_tokens += num_tokens
        self.plan_s.append(plan_s)

    def snapshot(self) -> dict:
        """The counters and timing summaries, JSON-ready."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("plan_s", "apply_s", "recent_prefill_tokens", "recent_steps")}
        out["recent_prefill_tokens"] = list(self.recent_prefill_tokens)
        out["recent_steps"] = list(self.recent_steps)
        out["prefix_hit_rate"] = round(self.prefix_hit_rate, 6)
        for name in ("plan_s", "apply_s"):
            values = list(getattr(self, name))
            key = name.removesuffix("_s")
            out[f"{key}_ms_mean"] = round(1e3 * sum(values) / len(values), 4) if values else 0.0
            out[f"{key}_ms_p50"] = round(1e3 * percentile(values, 50), 4)
            out[f"{key}_ms_p99"] = round(1e3 * percentile(values, 99), 4)
        return out

    def write_json(self, path: str | os.PathLike) -> None:
        """Writes snapshot() to path atomically (a reader never sees half a file)."""
        target = pathlib.Path(path)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.snapshot(), indent=2) + "\n")
        os.replace(tmp, target)

"""Python's cyclic garbage collector on the serving path: its pauses measured, the startup heap frozen.

A collection of the oldest generation walks every container object the process
tracks, and nothing else runs meanwhile: in a gateway (tokenizer, gRPC,
OpenTelemetry, hundreds of streams) such pauses are long enough to stall the
step loop, and so the GPU, in the middle of serving (docs/performance.md,
host time). Most of what they walk is
alive for the life of the process: what startup built (modules, the model,
the tokenizer, the servers).

- `observe()`: every collection's pause goes to the histogram
  moemesh_gc_pause_seconds{generation} (every role, from
  process.configure_telemetry).
- `recording()`: the pauses while inside, as a list (benchmarks).
- `freeze(what)`: once a process is ready, a full collection, then
  gc.freeze(): the objects alive now move to a permanent generation that
  later collections skip (reference counting still frees them). A later
  freeze (a rank that loads a new group's weights) first unfreezes, so
  garbage that startup left in reference cycles is still collected then;
  unless `keep_frozen`: an expert service freezes its startup heap while it
  waits for a group (a standby), and once assigned collects and freezes only
  what the load added, so that taking over a failed rank's place does not pay
  for a walk of the whole heap (about half a second) on the recovery path.
  `--gc-freeze false` turns it off (MemberConfig.gc_freeze).
  `--gc-young-threshold N` sets the young generation's threshold at the same
  point (gc.set_threshold's first value, Python's default 700).

Hand-written: the standard library's gc module has the hooks but no such
policy, and prometheus-client exports collection counts, not pauses.
"""

import contextlib
import gc
import logging
import time

from services import metrics

log = logging.getLogger("moemesh.gc")

# The services' young-generation threshold (MemberConfig.gc_young_threshold): Python's
# 700 collects so often under hundreds of streams that the pauses add up to a visible
# share of the step loop; this one cuts both their total and their longest
# (bench/serving/step_overhead.py measures it; docs/performance.md has the figures).
DEFAULT_YOUNG_THRESHOLD = 20_000

_started_at = 0.0
_installed = False
_recorders: list[list[tuple[int, float]]] = []


def _on_collection(phase: str, info: dict) -> None:
    global _started_at
    if phase == "start":
        _started_at = time.perf_counter()
    elif _started_at:
        pause_s, generation = time.perf_counter() - _started_at, info["generation"]
        _started_at = 0.0
        metrics.common_metrics().gc_pause.labels(str(generation)).observe(pause_s)
        for pauses in _recorders:
            pauses.append((generation, pause_s))


def observe() -> None:
    """Measures every later collection's pause (idempotent)."""
    global _installed
    if not _installed:
        metrics.common_metrics()  # built now, not inside the first collection
        gc.callbacks.append(_on_collection)
        _installed = True


@contextlib.contextmanager
def recording():
    """Yields a list that collects (generation, seconds) of every collection while inside."""
    observe()
    pauses: list[tuple[int, float]] = []
    _recorders.append(pauses)
    try:
        yield pauses
    finally:
        _recorders.remove(pauses)


def freeze(what: str, *, enabled: bool = True, young_threshold: int = 0, keep_frozen: bool = False) -> int:
    """Collects everything (with keep_frozen: everything not frozen yet), then freezes the
    survivors; returns how many are frozen (0 if disabled). young_threshold > 0 becomes the
    young generation's collection threshold (either way)."""
    if young_threshold:
        gc.set_threshold(young_threshold, *gc.get_threshold()[1:])
    if not enabled:
        return 0
    start = time.perf_counter()
    if not keep_frozen:
        gc.unfreeze()
    gc.collect()
    gc.freeze()
    count = gc.get_freeze_count()
    log.info("froze %d objects alive after %s (%.0f ms): later collections skip them",
             count, what, 1e3 * (time.perf_counter() - start))
    return count

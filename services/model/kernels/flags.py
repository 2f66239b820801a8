"""Flags between the ranks' kernels over symmetric memory: a barrier without a kernel (issue 8).

The symmetric exchange's push (exchange/symmetric.py) moves two messages a layer, each written
straight into the peers' buffers by one kernel (the producer: route_pack's
rows, the partials) and read by a later one (the consumer: align's count
kernel, the reduce). Between them torch's symmetric-memory barrier is a kernel
of its own, and a kernel boundary in a CUDA graph; with flags (the expert
service's --ep-exchange-signals) the producer and the consumer synchronise
themselves:

- Each rank's signal pad (torch's, beside its symmetric buffer, zeroed at
  allocation) holds a flag per (channel, source rank): word
  channel * N + source. Channel 0 is torch's barrier's.
- The producer (signal_peers, at the end of every program): program 0 first
  clears this rank's own flags of the other channel (whose consumer ran
  earlier on this stream); each program then counts itself done (a local
  counter, acquire-release after a CTA barrier, so its stores, its peers'
  included, come before; COUNTER_SCOPE); the last program resets the counter
  and sets this rank's flag in each peer's pad (release, system scope):
  everything every program wrote is visible to a peer that sees it.
- The consumer (wait_flags, at the start of every program) spins until each
  peer's flag in this rank's pad is set (acquire, system scope), and reads.
  It leaves the flags set (so every program may wait on them); they are
  cleared by the next producer of the other channel on this rank, which runs
  after every consumer of them and before this rank can be sent the next ones.

Why that order suffices (two channels, rows R and partials P, one layer
after another): rank s sets R in rank r's pad for layer L + 1 only after
s's sum of layer L, which waited for r's P flag of layer L; r set that after
its partials kernel's program 0 had cleared r's R flags. Symmetrically r's P
flags are cleared by r's route_pack of layer L + 1 before it sets r's R
flags, and s sets P in r's pad for layer L + 1 only after its count kernel saw
them. So a flag is never set before it is cleared, and a consumer never sees
the previous layer's flag.

Each rank is its own process (its own CUDA context) and launches the same
kernels in the same order, each message's producer before its consumer, so a
rank only ever waits for a producer that its peers reach without waiting for
it: no cycle. Within one process a spinning kernel can hold up the first
launch of another (CUDA loads kernels lazily, and that load waited for the
spinning kernel on an H200), so a single-GPU test
of these flags loads its producers before it waits.

A wait longer than timeout_ns (0: none) traps, failing the rank's CUDA
context as torch's barrier kernel does at its timeout: the rank's step then
raises instead of hanging (tests/services/model/kernels/test_flags_cuda.py).

What the flags cost is mostly in the producers' tails (docs/performance.md).

Legend: N ranks.
"""

import dataclasses

import torch
import triton
import triton.language as tl
from torch import Tensor

# The flag channels of the exchange (torch's barrier uses channel 0).
ROWS_CHANNEL = 1
PARTIALS_CHANNEL = 2
# The scope of the producers' done-counter (its programs are on one GPU): "gpu", as the
# last-block pattern of CUDA's threadFenceReduction sample fences each block at device scope;
# the last program's flag is then released at system scope, which orders every write it has
# observed through the counter (release is cumulative in PTX's memory model). "sys" releases
# each program's writes to the system itself (more to wait for at every program's end).
COUNTER_SCOPE = "gpu"


@triton.jit
def _global_timer_ns():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _trap():
    tl.inline_asm_elementwise("trap; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _own_pad(pads_ptr, rank):
    return tl.load(pads_ptr + rank).to(tl.pointer_type(tl.int32))


@triton.jit
def wait_flags(pads_ptr, rank, channel, timeout_ns, NUM_RANKS: tl.constexpr):
    """Spins until every peer has set its flag of `channel` in this rank's pad (acquire,
    system scope: what it wrote before is visible after); traps after timeout_ns (0: never)."""
    flags = _own_pad(pads_ptr, rank) + channel * NUM_RANKS
    for source in tl.static_range(NUM_RANKS):
        if source != rank:
            start = tl.full([], -1, tl.int64)
            while tl.atomic_add(flags + source, 0, sem="acquire", scope="sys") == 0:
                now = _global_timer_ns()
                start = tl.where(start < 0, now, start)
                if (timeout_ns > 0) & (now - start > timeout_ns):
                    _trap()


@triton.jit
def signal_peers(pads_ptr, rank, channel, clear_channel, counter_ptr, NUM_RANKS: tl.constexpr,
                 CLEAR: tl.constexpr, SCOPE: tl.constexpr):
    """The end of a producer program (every program of the grid calls it once, after its
    stores): with CLEAR program 0 first clears this rank's flags of clear_channel; the last
    program to finish sets this rank's flag of `channel` in every peer's pad (see the module
    docstring). SCOPE: the done-counter's (COUNTER_SCOPE)."""
    pid = tl.program_id(0) + tl.program_id(1) * tl.num_programs(0)
    if CLEAR:
        if pid == 0:
            flags = _own_pad(pads_ptr, rank) + clear_channel * NUM_RANKS
            for source in tl.static_range(NUM_RANKS):
                tl.atomic_xchg(flags + source, 0, sem="relaxed", scope="sys")
    tl.debug_barrier()  # every thread's stores before this program counts itself done
    done = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope=SCOPE)
    if done == tl.num_programs(0) * tl.num_programs(1) - 1:  # the last: every program's stores came before
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
        for dest in tl.static_range(NUM_RANKS):
            if dest != rank:
                flags = _own_pad(pads_ptr, dest) + channel * NUM_RANKS
                tl.atomic_xchg(flags + rank, 1, sem="release", scope="sys")


@dataclasses.dataclass(frozen=True, slots=True)
class Flags:
    """One channel of the ranks' flags, as a kernel takes them: pads_N holds each rank's
    signal pad address (int64, on the device). A producer's also carry its done-counter (one
    int32, zero between launches) and the channel it clears (-1: none)."""

    pads_N: Tensor
    rank: int
    channel: int
    timeout_ns: int = 0
    counter_1: Tensor | None = None
    clear_channel: int = -1


def wait_args(wait: Flags | None, like: Tensor) -> dict:
    """A consumer kernel's flag_* keywords: wait_flags' arguments, or with no flags (WAIT off)
    stand-in arguments that the kernel never reads (`like` as the pointer)."""
    if wait is None:
        return dict(flag_pads_ptr=like, flag_rank=0, flag_channel=0, flag_timeout_ns=0, FLAG_RANKS=1, WAIT=False)
    return dict(flag_pads_ptr=wait.pads_N, flag_rank=wait.rank, flag_channel=wait.channel,
                flag_timeout_ns=wait.timeout_ns, FLAG_RANKS=wait.pads_N.numel(), WAIT=True)


def signal_args(signal: Flags | None, like: Tensor) -> dict:
    """A producer kernel's flag_* keywords: signal_peers' arguments, or with no flags (SIGNAL
    off) stand-in arguments that the kernel never reads (`like` as the pointer)."""
    if signal is None:
        return dict(flag_pads_ptr=like, flag_rank=0, flag_channel=0, flag_clear_channel=0, flag_counter_ptr=like,
                    FLAG_RANKS=1, FLAG_CLEAR=False, FLAG_SCOPE=COUNTER_SCOPE, SIGNAL=False)
    assert signal.counter_1 is not None, "a producer's flags need its counter"
    return dict(flag_pads_ptr=signal.pads_N, flag_rank=signal.rank, flag_channel=signal.channel,
                flag_clear_channel=max(signal.clear_channel, 0), flag_counter_ptr=signal.counter_1,
                FLAG_RANKS=signal.pads_N.numel(), FLAG_CLEAR=signal.clear_channel >= 0, FLAG_SCOPE=COUNTER_SCOPE,
                SIGNAL=True)


def counter(device: torch.device | str) -> Tensor:
    """A producer's done-counter: one int32, zero."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def exchange_flags(pads_N: Tensor, rank: int, device: torch.device | str, timeout_ns: int = 0) -> dict[str, Flags]:
    """The exchange's four: each message's producer's ("rows", "partials": its own counter,
    clearing the other message's channel) and its consumers' ("rows_wait", "partials_wait")."""
    return {"rows": Flags(pads_N, rank, ROWS_CHANNEL, timeout_ns, counter(device), PARTIALS_CHANNEL),
            "rows_wait": Flags(pads_N, rank, ROWS_CHANNEL, timeout_ns),
            "partials": Flags(pads_N, rank, PARTIALS_CHANNEL, timeout_ns, counter(device), ROWS_CHANNEL),
            "partials_wait": Flags(pads_N, rank, PARTIALS_CHANNEL, timeout_ns)}

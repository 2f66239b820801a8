"""Does a spinning kernel see a flag that a kernel on another stream of the same process sets?

    python -m bench.flag_wait_probe

A consumer kernel (4 programs) spins on an int32 flag; on a second stream a 100M-cycle sleep
then a fill sets it. Each case runs in its own process (a hang is killed after 20 s): the
spin as triton_flags.wait_flags does it (an acquire atomic), as a volatile load, and as
wait_flags itself, each with the producer's kernels (the sleep, the fill) launched once before
("loaded") or not. Written for services/model/triton_flags.py's single-GPU test: on an H200 every
unloaded case hung (CUDA loads a kernel lazily at its first launch, and that waited for the
spinning kernel); every loaded case returned after the sleep.
"""

import subprocess
import sys
import time

import torch
import triton
import triton.language as tl

from services.model import triton_flags


@triton.jit
def _wait_atomic(flag_ptr, out_ptr):
    while tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys") == 0:
        pass
    tl.store(out_ptr + tl.program_id(0), 7)


@triton.jit
def _wait_volatile(flag_ptr, out_ptr):
    while tl.load(flag_ptr, volatile=True) == 0:
        pass
    tl.store(out_ptr + tl.program_id(0), 7)


@triton.jit
def _wait_flags(pads_ptr, out_ptr):
    triton_flags.wait_flags(pads_ptr, 0, 0, 0, 2)
    tl.store(out_ptr + tl.program_id(0), 7)


def case(variant: str, loaded: bool) -> None:
    """One case, in this process: prints RETURNED and the seconds it took, or hangs."""
    kernel = {"atomic": _wait_atomic, "volatile": _wait_volatile, "wait_flags": _wait_flags}[variant]
    pad = torch.zeros(4, dtype=torch.int32, device="cuda")
    flag, ones = pad[1:2], torch.ones(4, dtype=torch.int32, device="cuda")  # word 1: channel 0, rank 1's flag

    def arg(t):  # wait_flags takes the pads' table (rank 0's pad, twice: rank 1's is never read)
        return torch.tensor([t.data_ptr()] * 2, dtype=torch.int64, device="cuda") if variant == "wait_flags" else t

    out = torch.zeros(4, dtype=torch.int32, device="cuda")
    kernel[(4,)](arg(ones) if variant == "wait_flags" else ones[1:2], out)  # compiled with its flag set
    if loaded:
        torch.cuda._sleep(1000)
        flag.fill_(0)
    torch.cuda.synchronize()
    consumer, producer = torch.cuda.Stream(), torch.cuda.Stream()
    start = time.perf_counter()
    with torch.cuda.stream(consumer):
        kernel[(4,)](arg(pad) if variant == "wait_flags" else flag, out)
    with torch.cuda.stream(producer):
        torch.cuda._sleep(100_000_000)
        flag.fill_(1)
    torch.cuda.synchronize()
    print(f"RETURNED {time.perf_counter() - start:.3f} s {out.tolist()}", flush=True)


def main() -> int:
    if len(sys.argv) == 3:
        case(sys.argv[1], sys.argv[2] == "loaded")
        return 0
    print("| spin | producer's kernels | result |\n|---|---|---|")
    for variant in ("atomic", "volatile", "wait_flags"):
        for loaded in ("loaded", "not loaded"):
            try:
                done = subprocess.run([sys.executable, "-m", "bench.flag_wait_probe", variant, loaded],
                                      capture_output=True, text=True, timeout=20)
                result = done.stdout.strip().splitlines()[-1] if done.returncode == 0 else f"exit {done.returncode}"
            except subprocess.TimeoutExpired:
                result = "hung (killed after 20 s)"
            print(f"| {variant} | {loaded} | {result} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""An opt-in profile of a rank's steps with prompt tokens: where a serving step's time goes.

`--profile-prefill-steps N --profile-file PATH` (expert_svc/config.py): after the
rank's first `--profile-skip-steps` steps, each step is run under torch.profiler
until N steps that carry prompt tokens have been recorded; each of those appends
one JSON line to PATH. The profiled steps are not pipelined: the device is
drained before a step starts and the step is read before the next one, so a
line's times are that step's alone:

- launch_ms: the host from the plan's application to the last queued kernel;
- wall_ms: the host from the same start to the step's tokens on the host;
- kernel_ms: the device time of its kernels, summed (the device idles for
  wall_ms - kernel_ms, waiting for launches or for the host between them);
- kernels and host_ops: the largest device kernels, and the host operations
  by their own time (launch calls, synchronizations, Python-side tensor ops).

A diagnostic for operators and benchmarks, off by default (it slows the steps
it profiles); the runner never profiles unless asked.
"""

import json
import pathlib
import time

import torch

TOP = 15


class StepProfiler:
    """Profiles steps once armed; `begin` before a step's launch, `end` after it."""

    def __init__(self, path: str | pathlib.Path, count: int, skip_steps: int, device: torch.device):
        self.path = pathlib.Path(path)
        self.remaining = count
        self.skip_steps = skip_steps
        self.device = device
        self._seen = 0

    @property
    def done(self) -> bool:
        return self.remaining <= 0

    def begin(self) -> "torch.profiler.profile | None":
        """A started profile for the coming step, or None while skipping or once done."""
        self._seen += 1
        if self.done or self._seen <= self.skip_steps:
            return None
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(activities=activities)
        prof.__enter__()
        return prof

    def end(self, prof: "torch.profiler.profile", start: float, launched: float, ready, *, step_id: int,
            has_prompt: bool, num_tokens: int, num_seqs: int) -> None:
        """Waits for the step, stops the profile and, for a step with prompt tokens, writes its line."""
        if ready is not None:
            ready.synchronize()
        wall = time.perf_counter() - start
        prof.__exit__(None, None, None)
        if not has_prompt:
            return
        self.remaining -= 1
        events = prof.key_averages()
        kernels = sorted(((e.key, e.count, e.device_time_total) for e in events
                          if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: -e[2])
        host = sorted(((e.key, e.count, e.self_cpu_time_total) for e in events
                       if e.device_type == torch.autograd.DeviceType.CPU), key=lambda e: -e[2])
        line = {"step_id": step_id, "num_tokens": num_tokens, "num_seqs": num_seqs,
                "launch_ms": round((launched - start) * 1e3, 2), "wall_ms": round(wall * 1e3, 2),
                "kernel_ms": round(sum(us for _, _, us in kernels) / 1e3, 2),
                "num_kernels": sum(n for _, n, _ in kernels),
                "kernels": [[name[:120], n, round(us, 1)] for name, n, us in kernels[:TOP]],
                "host_ops": [[name[:120], n, round(us, 1)] for name, n, us in host[:TOP]]}
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")

"""The kernels one call launches, by device time: torch.profiler around one call (bench helper)."""

from collections.abc import Callable

import torch


def top_kernels(fn: Callable[[], object], device: torch.device, limit: int = 20) -> list[dict]:
    """The `limit` kernels of one call of fn by CUDA time (name, calls, total and per-call us),
    the device synchronised before the profile ends; on the CPU the ops by self CPU time.
    Warm fn up first: a first call's compilations and allocations are not its steady state."""
    on_cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        if on_cuda:
            torch.cuda.synchronize(device)
    if on_cuda:
        events = [(e.key, e.count, e.device_time_total) for e in prof.key_averages()
                  if e.device_type == torch.autograd.DeviceType.CUDA]
    else:
        events = [(e.key, e.count, e.self_cpu_time_total) for e in prof.key_averages()]
    events.sort(key=lambda e: -e[2])
    return [{"name": name, "calls": calls, "total_us": round(us, 1), "us_per_call": round(us / calls, 2)}
            for name, calls, us in events[:limit]]

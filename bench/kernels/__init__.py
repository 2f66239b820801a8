"""Kernel benchmarks: the model's kernels and decode steps on one or two GPUs, under module-knob variants."""

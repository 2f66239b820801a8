"""The model's Triton kernels on CUDA, one module per family; the CPU keeps the torch code.

Each kernel mimics the bf16 roundings of the torch code it replaces, so outputs
match to within fp32 reduction order. Module-level constants are tuning knobs,
read at call time (benchmarks and tests set them as module attributes).

- launch: the master switch (ENABLED), single-token kernels, programmatic dependent launches.
- norm: residual add + RMSNorm. rotary: q/k head norms + rotary. gemv: one-token F.linear.
- routing: gate softmax top-k, alone or fused with the gate matmul.
- moe_small: the MoE of small steps on one rank; moe_align, moe_gemm, moe_grouped: that of
  bigger steps; moe_ep: the expert-parallel MoE (gather, local experts, reduce-scatter).
- moe_triton: the Triton MoE backend (moe_backend.py's registry), which picks among those.
- fused_layer: the kernels of qwen3_moe's fused layer loop.
- attention: paged attention (attention.py's "triton" backend). flags: cross-rank flags.

Importing any of them imports triton: the model code loads them on CUDA only,
through the attention and MoE backend registries.
"""

"""How the ranks of an expert-parallel group exchange MoE rows.

comm: ExpertComm, the process group and its collectives (NCCL, gloo, or copies
for one rank). symmetric: the exchange over symmetric memory on CUDA (imports
triton; the expert service loads it on CUDA only). cost_model and plan: which
design (the gather or the deduplicated all-to-all) a step takes, by a cost
model of the group's links (pure Python).
"""

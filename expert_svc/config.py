"""The expert service's configuration: one frozen dataclass, checked on construction.

Every field is also a flag `--field-name` and an env var `MOEMESH_FIELD_NAME`
(services/settings.py builds both from this dataclass). The registration
fields (member_id, etcd, host, advertise_host, port, port_file, lease_ttl_s,
key_prefix, log_level) come from `MemberConfig`.
"""

import dataclasses

from services.settings import MemberConfig

_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True, slots=True)
class ExpertConfig(MemberConfig):
    """One rank of a worker group: where it listens, what it loads, how it runs."""

    # The checkpoint directory (hub layout: config.json + safetensors).
    model: str = ""
    # The port this rank hosts the torch.distributed store on if it becomes
    # rank 0; 0 picks a free one at start.
    rendezvous_port: int = 0
    # "cpu", "cuda" or "cuda:N": one rank per GPU.
    device: str = "cpu"
    # Compute dtype; empty means float32 on the CPU and bfloat16 on CUDA.
    dtype: str = ""
    # Tokens per KV block.
    kv_block_size: int = 16
    # Blocks of the KV pool; 0 sizes the pool from memory (the two fields below).
    kv_blocks: int = 0
    # KV pool memory on the CPU, in bytes.
    kv_memory_bytes: int = 256 * 1024 * 1024
    # Share of the free GPU memory (after the weights) the KV pool takes on CUDA.
    kv_memory_fraction: float = 0.8
    # torch intra-op threads; 0 keeps torch's default.
    num_threads: int = 1
    # How long a collective (and the rendezvous) may wait for the other ranks.
    # A step that fails (or runs twice this long) is reported in etcd and the
    # rank exits with status 4.
    collective_timeout_s: float = 120.0
    # Steps whose largest rank batch has at most this many tokens dispatch the
    # MoE tokens through fixed-capacity buffers (no host sync: decode), bigger
    # ones with host-side split sizes (prefill); 0 always uses split sizes.
    # Must be the same on every rank of a group.
    max_fixed_capacity_tokens: int = 256
    # Time the MoE all-to-alls on CUDA too (a synchronize around each call:
    # slower; for debugging). On the CPU they are always timed.
    debug_collective_timing: bool = False
    # Report expert hit counts to the router every this many steps; 0 disables.
    stats_every_steps: int = 16
    # Deadline of one hit-count report to the router.
    stats_deadline_s: float = 2.0

    def __post_init__(self) -> None:
        MemberConfig.__post_init__(self)
        if not self.model:
            raise ValueError(f"model must be a checkpoint directory, got {self.model!r}")
        if not 0 <= self.rendezvous_port <= 65535:
            raise ValueError(f"rendezvous_port must be in 0..65535, got {self.rendezvous_port}")
        if not (self.device == "cpu" or self.device == "cuda"
                or (self.device.startswith("cuda:") and self.device[5:].isdigit())):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.dtype not in ("", *_DTYPES):
            raise ValueError(f"dtype must be one of {_DTYPES} (or empty), got {self.dtype!r}")
        for name in ("kv_block_size", "kv_memory_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("kv_blocks", "num_threads", "stats_every_steps", "max_fixed_capacity_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 < self.kv_memory_fraction <= 1.0:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
        for name in ("collective_timeout_s", "stats_deadline_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def is_cuda(self) -> bool:
        """True if the rank runs on a GPU."""
        return self.device.startswith("cuda")

    @property
    def dtype_name(self) -> str:
        """The compute dtype, with the device's default filled in."""
        return self.dtype or ("bfloat16" if self.is_cuda else "float32")

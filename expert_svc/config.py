"""The expert service's configuration: one frozen dataclass, checked on construction.

Every field is also a flag `--field-name` and an env var `MOEMESH_FIELD_NAME`
(services/settings.py builds both from this dataclass). The registration
fields (member_id, etcd, host, advertise_host, port, port_file, lease_ttl_s,
key_prefix, log_level) come from `MemberConfig`.
"""

import dataclasses

from expert_svc.spare_slots import parse_setting
from services import model_identity, netaddr
from services.model.exchange.cost_model import SETTINGS as _EP_DISPATCHES
from services.model.exchange.cost_model import parse_overrides
from services.model.kernels.quant_select import check_gemv_variants
from services.settings import MemberConfig

_DTYPES = ("float32", "bfloat16")
# The fields whose help says "must be the same on every rank of a group" (checked by
# tests/expert_svc/test_group_settings.py): registered, with the model's hash, as the
# group settings that the scheduler compares (scheduler_svc/compat.py).
SAME_ON_EVERY_RANK = ("random_weights", "random_weights_seed", "max_fixed_capacity_tokens", "ep_exchange",
                      "ep_exchange_push", "ep_exchange_signals", "num_spare_expert_slots", "ep_dispatch",
                      "ep_link_costs")
# services.model.attention.ATTENTION_BACKEND_NAMES (not imported: it pulls in torch).
_ATTENTION_BACKENDS = ("auto", "torch", "triton")
_KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
_EP_EXCHANGES = ("auto", "nccl", "symmetric")
# services.model.quant.dispatch.QUANTIZED_KERNELS (not imported: it pulls in torch).
_QUANTIZED_KERNELS = ("auto", "fp8", "weight-only")


@dataclasses.dataclass(frozen=True, slots=True)
class ExpertConfig(MemberConfig):
    """One rank of a worker group: where it listens, what it loads, how it runs."""

    # The checkpoint directory (hub layout: config.json + safetensors).
    model: str = ""
    # Benchmarks only: a model shape preset (services/model/random_weights.py,
    # e.g. "qwen3-30b-a3b") whose weights are drawn at random on the device
    # instead of read from `model` (then optional; its config.json, if given,
    # must match the preset).
    random_weights: str = ""
    # Seed of the random weights; the same on every rank of a group.
    random_weights_seed: int = 0
    # The network interface of the collective (e.g. eth1, ib0): sets
    # GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME before the process group starts,
    # and advertise_host defaults to its IPv4 address (unless host is a specific one). Empty: the interface
    # holding the advertised address (when not loopback), else gloo's and NCCL's own choice.
    ep_interface: str = ""
    # The port this rank hosts the torch.distributed store on if it becomes
    # rank 0; 0 picks a free one at start.
    rendezvous_port: int = 0
    # "cpu", "cuda" or "cuda:N": one rank per GPU.
    device: str = "cpu"
    # Compute dtype; empty means float32 on the CPU and bfloat16 on CUDA.
    dtype: str = ""
    # Paged attention kernels: "triton" (GPU only), "torch" (the reference,
    # host loops) or "auto" (triton on CUDA, torch on the CPU).
    attention_backend: str = "auto"
    # On CUDA, when the model loads: torch's fused attention is run once at each
    # length a whole prompt of up to this many tokens attends at (cuDNN builds a
    # graph per length: services/model/kernels/attention.py), so that no prompt
    # waits for one while serving. The gateway's max_batch_tokens is the longest
    # prompt chunk of a step. 0: prepared on first use.
    warm_prompt_tokens: int = 8192
    # On CUDA, when the model loads: the LM head is run once at each row count
    # up to this many (the rows a step samples), so that cuBLAS's kernel for
    # each count is loaded then: CUDA loads a kernel on its first launch and
    # that load waits for the device, so a step whose sample count is new would
    # block the host for the whole of the step before it. 0: loaded on first use.
    warm_logit_rows: int = 512
    # The kernels of a quantized checkpoint (FP8 or AWQ) on CUDA: "fp8" (FP8
    # tensor cores, FP8 checkpoints on compute capability >= 8.9),
    # "weight-only" (weights dequantized in the kernel: AWQ, or FP8 on older
    # GPUs) or "auto" (by format and compute capability; the log says which
    # path and why). The CPU always runs the dequantizing reference path.
    quantized_kernel: str = "auto"
    # Batch-1 GEMVs of a quantized checkpoint to run instead of the defaults, on CUDA (the CPU's
    # reference path has none): "awq-nibbles" (AWQ's nibble GEMV for the one-token experts and
    # the one-row linears, not the grouped one), "fp8-pipelined" (FP8's one-row GEMVs as cp.async pipelines). Empty
    # (the default): the measured kernels. For A/B measurements (docs/performance.md).
    quant_gemv_variants: tuple[str, ...] = ()
    # Element type of the KV cache: "auto" (the compute dtype) or "fp8_e4m3"
    # (float8 e4m3, no scaling: half the bytes of bf16, so twice the blocks and
    # half the bytes a decode step reads; values past +-448 saturate).
    kv_cache_dtype: str = "auto"
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
    # A step that fails (or runs twice this long) is reported in etcd; on the
    # CPU the rank then rejoins the re-formed group, on CUDA it exits with status 4.
    collective_timeout_s: float = 120.0
    # Steps whose largest rank batch has at most this many tokens dispatch the
    # MoE tokens through fixed-capacity buffers (no host sync: decode), bigger
    # ones with host-side split sizes (prefill); 0 always uses split sizes.
    # Must be the same on every rank of a group.
    max_fixed_capacity_tokens: int = 256
    # Decode steps of up to this many sequences per rank run as CUDA graphs
    # (expert_svc/graph_runner.py), captured on first use per batch bucket;
    # 0 = always eager. Only on CUDA with a capturable attention backend
    # (triton), and never with debug_collective_timing. Steps above
    # max_fixed_capacity_tokens always run eagerly.
    cuda_graph_max_batch: int = 256
    # The batch buckets of the graphs, comma-separated (e.g. "1,2,4,8");
    # empty = the powers of two up to cuda_graph_max_batch. A step runs the
    # smallest bucket that holds it, padded.
    cuda_graph_buckets: str = ""
    # The longest context (tokens) a graphed decode step takes: it fixes the
    # graphs' block-table width; longer sequences decode eagerly. 0 = the
    # model's max_position_embeddings.
    cuda_graph_max_context: int = 0
    # A step whose sequences bring up to this many new tokens each (jump-forward
    # chunks, short prompt chunks) runs as CUDA graph decode rows, a row per token,
    # when its rows fit the largest bucket; 1 = graphs for decode steps only.
    # Each row's attention reads its sequence's context: long chunks run eagerly.
    cuda_graph_max_seq_tokens: int = 16
    # Steps with prompt tokens of up to this many tokens run as piecewise CUDA
    # graphs (expert_svc/prefill_graphs.py): everything but the attention
    # captured per token bucket when the model loads, the attention eager
    # between the pieces. One rank on CUDA only (elsewhere: eager); the
    # gateway's max_batch_tokens is the most tokens of a step. 0 = eager.
    prefill_graph_tokens: int = 8192
    # The prefill graphs' token buckets per power of two (at least 64 tokens
    # apart): more buckets pad less and take longer to capture.
    prefill_graph_lengths_per_octave: int = 16
    # Time the MoE all-to-alls on CUDA too (a synchronize around each call:
    # slower; for debugging). On the CPU they are always timed.
    debug_collective_timing: bool = False
    # How the ranks of an expert-parallel group on CUDA exchange the MoE rows of
    # steps of up to max(max_fixed_capacity_tokens, cuda_graph_max_batch) tokens
    # per rank (decode) that take the gather design (ep_dispatch): "nccl" (an all_gather and a reduce_scatter a layer),
    # "symmetric" (buffers in torch's symmetric memory, read by the peers over
    # NVLink after a barrier kernel: services/model/exchange/symmetric.py; the rank
    # fails to start if that cannot be set up) or "auto" (symmetric if every
    # rank of the group sets it up, else NCCL, with a warning). Bigger steps
    # always take NCCL. Must be the same on every rank of a group.
    ep_exchange: str = "auto"
    # With the symmetric exchange: each rank writes its rows and partials into its
    # peers' buffers (push: no gather kernel, the sum reads local memory); off, each
    # rank reads its peers' buffers (pull: one more kernel a layer, the exchange
    # that was measured on two GPUs; push is checked kernel by kernel on one GPU
    # but not yet on two, so it is opt-in). Must be the same on every rank of a group.
    ep_exchange_push: bool = False
    # With push: the producer kernels (route_pack, partials) set a flag in each
    # peer's signal pad when done, and the consumers (align's count kernel, the
    # sum) spin on them, instead of two barrier kernels a layer
    # (services/model/kernels/flags.py). Implies push. Opt-in: checked in the
    # interpreter, not yet on two GPUs. Must be the same on every rank of a group.
    ep_exchange_signals: bool = False
    # The design that moves a step's MoE rows between the ranks (services/model/exchange/
    # cost_model.py): "gather" (every rank gathers every rank's rows, then a
    # reduce-scatter of fp32 partials: the fewest collectives, no host sync),
    # "alltoall" (the deduplicated all-to-all: a token's row goes once to each
    # rank holding one of its experts: fewer bytes when tokens reach few of the
    # ranks, as across hosts) or "auto" (per step size, the design a cost model
    # of the group's links prefers; logged when the group forms). Must be the
    # same on every rank of a group.
    ep_dispatch: str = "auto"
    # The cost model's constants, "key=value,..." (latencies and overheads in us,
    # bandwidths in GB/s per rank and direction): local_latency_us, local_gbps
    # (ranks of one host: NVLink, or loopback on the CPU), network_latency_us,
    # network_gbps (between hosts), overhead_us (the all-to-all's extra ops a
    # layer), sync_us (its host-split sync); empty keeps the defaults. Must be
    # the same on every rank of a group.
    ep_link_costs: str = ""
    # The machine this rank runs on, for the cost model: ranks with the same
    # value share a host's local links (NVLink). Empty: the advertised host.
    # Behind a pod network every pod has an address of its own: set it to the
    # node's name (Kubernetes: spec.nodeName).
    ep_node: str = ""
    # Spare expert slots per MoE layer that can hold replicas of hot experts
    # (placed by the router's scaling policy): a count (0 disables replicas) or
    # "auto": sized from the KV budget once the weights are in (at most 10% of
    # it, at most what the default policy can fill; 0 on a group of one rank;
    # expert_svc/spare_slots.py), the minimum over the ranks on CUDA, logged.
    # Must be the same on every rank of a group.
    num_spare_expert_slots: str = "auto"
    # Launch the next step on the device before the last one's sampled tokens
    # are read, when its plan has already arrived (expert_svc/executor.py):
    # the GPU runs step k+1 while the host answers step k. Off: each step
    # is launched, read and answered before the next one starts.
    pipeline_steps: bool = True
    # Diagnostics (expert_svc/step_profile.py): profile this many steps that carry
    # prompt tokens with torch.profiler, after the first profile_skip_steps steps,
    # one JSON line each appended to profile_file (where a step's host and device
    # time go). 0, the default, profiles nothing; profiled steps run unpipelined.
    profile_prefill_steps: int = 0
    profile_skip_steps: int = 100
    profile_file: str = ""
    # Report expert hit counts to the router every this many steps; 0 disables.
    stats_every_steps: int = 16
    # Deadline of one hit-count report to the router.
    stats_deadline_s: float = 2.0

    def __post_init__(self) -> None:
        if self.ep_interface and not self.advertise_host and netaddr.is_wildcard(self.host):
            object.__setattr__(self, "advertise_host", netaddr.interface_address(self.ep_interface))
        MemberConfig.__post_init__(self)
        if not self.model and not self.random_weights:
            raise ValueError(f"model must be a checkpoint directory, got {self.model!r}")
        if self.random_weights:
            from services.model.random_weights import preset  # torch: only when asked for

            preset(self.random_weights)
        if not 0 <= self.rendezvous_port <= 65535:
            raise ValueError(f"rendezvous_port must be in 0..65535, got {self.rendezvous_port}")
        if not (self.device == "cpu" or self.device == "cuda"
                or (self.device.startswith("cuda:") and self.device[5:].isdigit())):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.dtype not in ("", *_DTYPES):
            raise ValueError(f"dtype must be one of {_DTYPES} (or empty), got {self.dtype!r}")
        if self.attention_backend not in _ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {_ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.attention_backend == "triton" and not self.is_cuda:
            raise ValueError(f"attention_backend 'triton' needs a CUDA device, got device {self.device!r}")
        if self.quantized_kernel not in _QUANTIZED_KERNELS:
            raise ValueError(f"quantized_kernel must be one of {_QUANTIZED_KERNELS}, got {self.quantized_kernel!r}")
        check_gemv_variants(self.quant_gemv_variants)
        if self.warm_prompt_tokens < 0 or self.warm_logit_rows < 0:
            raise ValueError(f"warm_prompt_tokens and warm_logit_rows must be >= 0, got {self.warm_prompt_tokens} "
                             f"and {self.warm_logit_rows}")
        if self.profile_prefill_steps < 0 or self.profile_skip_steps < 0:
            raise ValueError(f"profile_prefill_steps and profile_skip_steps must be >= 0, got "
                             f"{self.profile_prefill_steps} and {self.profile_skip_steps}")
        if self.profile_prefill_steps and not self.profile_file:
            raise ValueError("profile_prefill_steps needs profile_file (the JSON lines' path)")
        if self.kv_cache_dtype not in _KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {_KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.ep_exchange not in _EP_EXCHANGES:
            raise ValueError(f"ep_exchange must be one of {_EP_EXCHANGES}, got {self.ep_exchange!r}")
        if self.ep_exchange == "symmetric" and not self.is_cuda:
            raise ValueError(f"ep_exchange 'symmetric' needs a CUDA device, got device {self.device!r}")
        if self.ep_dispatch not in _EP_DISPATCHES:
            raise ValueError(f"ep_dispatch must be one of {_EP_DISPATCHES}, got {self.ep_dispatch!r}")
        parse_overrides(self.ep_link_costs)
        for name in ("kv_block_size", "kv_memory_bytes", "cuda_graph_max_seq_tokens",
                     "prefill_graph_lengths_per_octave"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("kv_blocks", "num_threads", "stats_every_steps", "max_fixed_capacity_tokens",
                     "cuda_graph_max_batch", "cuda_graph_max_context", "prefill_graph_tokens",
                     "random_weights_seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        parse_setting(self.num_spare_expert_slots)
        if self.cuda_graph_buckets.strip():
            _parse_buckets(self.cuda_graph_buckets)
        if not 0.0 < self.kv_memory_fraction <= 1.0:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
        for name in ("collective_timeout_s", "stats_deadline_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def group_settings(self, model_config) -> dict:
        """What must be equal on every rank of a group: the model's identity (a hash of
        its config and of its tokenizer, services/model_identity.py; the gateway checks
        it too), the collective's backend, the compute dtype and SAME_ON_EVERY_RANK."""
        return {**model_identity.identity(model_config, self.model),
                "backend": "nccl" if self.is_cuda else "gloo", "dtype": self.dtype_name,
                **{name: getattr(self, name) for name in SAME_ON_EVERY_RANK}}

    @property
    def collective_interface(self) -> str | None:
        """The interface gloo and NCCL should use: ep_interface, else the one that
        holds the advertised address (None for loopback or an address no interface
        holds: the libraries choose)."""
        if self.ep_interface:
            return self.ep_interface
        if netaddr.is_loopback(self.advertise_host):
            return None
        return netaddr.interface_of(self.advertise_host)

    @property
    def is_cuda(self) -> bool:
        """True if the rank runs on a GPU."""
        return self.device.startswith("cuda")

    @property
    def cuda_graph_bucket_sizes(self) -> tuple[int, ...]:
        """The batch buckets of the decode graphs, ascending; () when graphs are off."""
        limit = self.cuda_graph_max_batch
        if self.cuda_graph_buckets.strip():
            return tuple(b for b in _parse_buckets(self.cuda_graph_buckets) if b <= limit)
        return tuple(1 << i for i in range(limit.bit_length()) if 1 << i < limit) + ((limit,) if limit else ())

    @property
    def fixed_spare_slots(self) -> int | None:
        """The explicit --num-spare-expert-slots count; None for auto (sized at build)."""
        return parse_setting(self.num_spare_expert_slots)

    @property
    def dtype_name(self) -> str:
        """The compute dtype, with the device's default filled in."""
        return self.dtype or ("bfloat16" if self.is_cuda else "float32")



def _parse_buckets(text: str) -> list[int]:
    try:
        buckets = sorted({int(part) for part in text.split(",")})
    except ValueError:
        raise ValueError(f"cuda_graph_buckets must be comma-separated integers, got {text!r}") from None
    if buckets[0] <= 0:
        raise ValueError(f"cuda_graph_buckets must be positive, got {text!r}")
    return buckets

"""The gateway's configuration: one frozen dataclass, checked on construction.

Every field is also a flag `--field-name` and an env var `MOEMESH_FIELD_NAME`
(services/settings.py builds both from this dataclass); the fields every
registered process shares (member_id, etcd, host, port, port_file, ...) come
from `MemberConfig`.
"""

import dataclasses

from gateway.policy import POLICIES
from services.grpc_limits import ServerLimits
from services.settings import MemberConfig


@dataclasses.dataclass(frozen=True, slots=True)
class GatewayConfig(MemberConfig):
    """The gateway of one worker group: the public API, batching, the step streams."""

    # The checkpoint directory: config.json and the tokenizer (required).
    model: str = ""
    # Sequences one rank runs at once (its batch); at most max_batch_tokens.
    max_running_requests: int = 64
    # Input tokens one rank processes in one step: one per decoding sequence
    # plus prefill chunks. Longer prompts are prefilled over several steps.
    # Larger steps mean fewer of them under a high concurrency, and a lower
    # inter-token latency tail (docs/performance.md has the figures).
    max_batch_tokens: int = 8192
    # The most prompt tokens of one sequence prefilled in one step; 0: no cap
    # but the step's prefill budget (tpot_target_ms), so a prompt on an idle
    # group is one step of up to max_batch_tokens, and beside decodes prompts
    # take what the TPOT target leaves (docs/internals.md, "Step budget").
    prefill_chunk_size: int = 512
    # Mean time per output token the step budget protects, in ms: while
    # interactive requests decode, a step carries prefill only up to what the
    # decoding requests' mean-TPOT margin allows, as the step-cost model predicts.
    # 0 (the default): off, every step may fill max_batch_tokens. Opt-in (with
    # prefill_chunk_size 0): it serves SLO traffic better but not yet
    # closed-loop throughput (docs/configuration.md).
    tpot_target_ms: float = 0.0
    # Prefill tokens a step always gets while prompts wait, whatever tpot_target_ms.
    min_prefill_tokens: int = 1024
    # Time to first token the gateway aims at, in ms (the TTFT SLO): a new
    # interactive request predicted to get its first token after twice this
    # (batch-priority: after this) is refused with RESOURCE_EXHAUSTED rather
    # than queued into a miss that also delays every request behind it.
    # 0 (the default): no such shedding, as closed-loop benchmarks want.
    ttft_target_ms: float = 0.0
    # The order waiting requests are admitted in: fcfs (first come, first
    # served) or lpm (longest cached prefix first).
    policy: str = "fcfs"
    # Requests that may wait for a rank; beyond it new requests get
    # RESOURCE_EXHAUSTED at once.
    max_waiting_requests: int = 1024
    # Reuse the KV blocks of cached prompt prefixes (a radix tree per rank).
    enable_prefix_cache: bool = True
    # Plan step k+1 while step k runs on the ranks.
    overlap_steps: bool = True
    # Jump-forward: where a request's constraint forces several tokens, feed them to the rank
    # as one chunk instead of one decode step each. Off by default until measured on a GPU with
    # chunk steps as CUDA graphs (docs/performance.md, "Constrained decoding"); the rank also
    # skips the forced-token search then.
    jump_forward: bool = False
    # With jump_forward: take a jump only when it carries at least this many forced tokens, the
    # decode steps it saves. A chunk step replays the rank's decode graph with a row per token
    # (up to the rank's cuda_graph_max_seq_tokens), and at batch 1 a step of 1 + j rows costs
    # less than j + 1 steps of one row (weights read once a step, the host's share paid once),
    # so every jump pays (docs/performance.md, "Constrained decoding").
    jump_forward_min_tokens: int = 1
    # A stream that falls behind sends the outputs queued for it as one message
    # (the tokens and text since its previous message); false: one message per step.
    coalesce_stream_outputs: bool = True
    # Tokens per stream message while a request decodes: its first token goes
    # out at once, then its stream is woken once this many outputs are queued
    # (and at its end). Fewer gRPC messages at high concurrency, burstier tokens.
    stream_interval: int = 1
    # If set, the gateway's counters (prefix-cache hit rate, preemptions, host
    # time per step) are written to this JSON file every stats_interval_s and at exit.
    stats_file: str = ""
    # Seconds between writes of stats_file; 0 writes it only at exit.
    stats_interval_s: float = 5.0
    # Port of the OpenAI-compatible HTTP endpoint (/v1/completions,
    # /v1/chat/completions, /v1/models, /health) on host; 0 picks a free one
    # (written to port_file + ".http"), -1 turns it off.
    http_port: int = 8000
    # Tokens generated when a request leaves max_new_tokens at 0.
    max_new_tokens_default: int = 256
    # The most tokens a request may ask for; 0 means up to the model's context length.
    max_new_tokens_limit: int = 0
    # A step not answered by every rank within this many seconds fails the group.
    step_timeout_s: float = 120.0
    # Deadline of the calls that set up a group (GetRankInfo), in seconds.
    rank_call_timeout_s: float = 10.0
    # On SIGTERM, how long requests in flight may run before they are cut off.
    shutdown_grace_s: float = 30.0
    # When the worker group fails, how long its requests (and new ones, queued)
    # wait for it to be re-formed and resume from their checkpoints before they
    # fail with UNAVAILABLE. Longer than the scheduler's reform_wait_s plus a
    # rank's rejoin, so a group that waits for a restarted rank keeps them.
    resume_timeout_s: float = 60.0
    # Client API keys (docs/security.md): a JSON file of hashed keys and their limits, re-read
    # when it changes. Empty: no authentication (a gateway bound to loopback, local use).
    api_keys: str = ""
    # A stream whose client has not taken its queued outputs for this long (it stopped reading)
    # is aborted and its KV blocks freed; 0: never.
    slow_reader_timeout_s: float = 30.0
    # The largest gRPC message received or sent (larger: RESOURCE_EXHAUSTED).
    max_message_bytes: int = 64 * 1024 * 1024
    # gRPC calls one client connection may have open at once (HTTP/2 concurrent streams).
    max_concurrent_streams: int = 1024
    # The largest request metadata (headers) of a gRPC call, in bytes.
    max_metadata_bytes: int = 16 * 1024
    # The server pings a connection idle this long and drops it when no answer comes within
    # keepalive_timeout_s: dead clients are found.
    keepalive_time_s: float = 60.0
    keepalive_timeout_s: float = 20.0
    # Clients may ping at most this often; a client that pings more often is disconnected.
    min_ping_interval_s: float = 10.0
    # Whether clients may send keepalive pings while they have no call open.
    keepalive_permit_without_calls: bool = False
    # A client connection with no call open for this long is closed (GOAWAY); 0: never.
    max_connection_idle_s: float = 0.0

    def server_limits(self) -> ServerLimits:
        """The public gRPC server's limits (services/grpc_limits.py)."""
        return ServerLimits(
            max_message_bytes=self.max_message_bytes, max_concurrent_streams=self.max_concurrent_streams,
            max_metadata_bytes=self.max_metadata_bytes, keepalive_time_s=self.keepalive_time_s,
            keepalive_timeout_s=self.keepalive_timeout_s, min_ping_interval_s=self.min_ping_interval_s,
            permit_keepalive_without_calls=self.keepalive_permit_without_calls,
            max_connection_idle_s=self.max_connection_idle_s)

    def __post_init__(self) -> None:
        MemberConfig.__post_init__(self)
        self.server_limits()  # checks the limits (ValueError naming the bad one)
        if not self.slow_reader_timeout_s >= 0:
            raise ValueError(f"slow_reader_timeout_s must be >= 0, got {self.slow_reader_timeout_s}")
        if not self.model:
            raise ValueError(f"model must be a checkpoint directory, got {self.model!r}")
        for name in ("max_running_requests", "max_batch_tokens", "max_new_tokens_default",
                     "max_waiting_requests", "stream_interval", "jump_forward_min_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("prefill_chunk_size", "min_prefill_tokens", "tpot_target_ms", "ttft_target_ms"):
            if not 0 <= getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be >= 0 (0: off), got {getattr(self, name)}")
        if self.max_running_requests > self.max_batch_tokens:
            raise ValueError(
                f"max_running_requests ({self.max_running_requests}) must not exceed max_batch_tokens "
                f"({self.max_batch_tokens}): every running sequence decodes one token per step")
        if self.max_new_tokens_limit < 0:
            raise ValueError(f"max_new_tokens_limit must be >= 0, got {self.max_new_tokens_limit}")
        if self.max_new_tokens_limit and self.max_new_tokens_default > self.max_new_tokens_limit:
            raise ValueError(
                f"max_new_tokens_default ({self.max_new_tokens_default}) exceeds "
                f"max_new_tokens_limit ({self.max_new_tokens_limit})")
        for name in ("step_timeout_s", "rank_call_timeout_s", "resume_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not -1 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in -1..65535 (-1: off), got {self.http_port}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(sorted(POLICIES))}, got {self.policy!r}")
        if self.stats_interval_s < 0:
            raise ValueError(f"stats_interval_s must be >= 0, got {self.stats_interval_s}")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")

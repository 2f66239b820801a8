"""The gateway's configuration: one frozen dataclass, checked on construction.

Every field is also a flag `--field-name` and an env var `MOEMESH_FIELD_NAME`
(services/settings.py builds both from this dataclass); the fields every
registered process shares (member_id, etcd, host, port, port_file, ...) come
from `MemberConfig`.
"""

import dataclasses

from services.settings import MemberConfig


@dataclasses.dataclass(frozen=True, slots=True)
class GatewayConfig(MemberConfig):
    """The gateway of one worker group: the public API, batching, the step streams."""

    # The checkpoint directory: config.json and the tokenizer (required).
    model: str = ""
    # Sequences one rank runs at once (its batch).
    max_running_requests: int = 64
    # Input tokens one rank processes in one step (prefill plus decode). A
    # prompt longer than this is rejected until chunked prefill lands.
    max_batch_tokens: int = 4096
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

    def __post_init__(self) -> None:
        MemberConfig.__post_init__(self)
        if not self.model:
            raise ValueError(f"model must be a checkpoint directory, got {self.model!r}")
        for name in ("max_running_requests", "max_batch_tokens", "max_new_tokens_default"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
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
        for name in ("step_timeout_s", "rank_call_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")

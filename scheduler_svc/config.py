"""The scheduler replica's configuration (flags and env via services.settings)."""

import dataclasses

from services.settings import MemberConfig


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerConfig(MemberConfig):
    """A scheduler replica: leader election, membership, group formation."""

    # Expert services per worker group (the world size of each group).
    group_size: int = 2
    # How often a follower health-checks the leader's gRPC address; 0 turns
    # probing off (a dead leader is then replaced only once its lease expires).
    leader_probe_interval_s: float = 0.1
    # Deadline of one health check of the leader.
    leader_probe_timeout_s: float = 0.1
    # Consecutive failed health checks after which a follower revokes the
    # leader's lease (only if etcd answers it and the leader key still holds
    # that lease).
    leader_probe_misses: int = 2
    # A leader whose health checks go unanswered (deadline exceeded, rather
    # than refused) is deposed only once they have for this many seconds: one
    # starved of CPU for a moment is not dead. A refused check is definite.
    leader_probe_silent_s: float = 0.5
    # How often the leader health-checks every gateway; one refused
    # leader_probe_misses times in a row (its process is gone) loses its lease
    # at once, so a standby takes its group over without waiting for the
    # TTL. 0 turns it off. Late answers and NOT_SERVING never count.
    gateway_probe_interval_s: float = 0.1
    # How often the leader health-checks every expert service; 0 turns it off
    # (a dead or hung rank is then found only by its lease and the collective
    # timeout). Each check waits for its answer, however late: a slow rank is
    # kept. A rank that answered once and then is refused rank_probe_misses
    # checks in a row (its process is gone), or does not answer for
    # rank_probe_silent_s after a SERVING answer (hung: a lost one), loses its
    # lease at once, and its group is re-formed.
    rank_probe_interval_s: float = 0.1
    # Refused checks in a row after which a rank's lease is revoked.
    rank_probe_misses: int = 2
    # Seconds of silence, after a SERVING answer, after which a rank's lease is
    # revoked: far above a rank's answer time (its event loop answers, never
    # the model thread), below the one-second recovery budget.
    rank_probe_silent_s: float = 0.45
    # How long a group that lost a rank waits for a member to fill it (a
    # standby expert, or the same member registering again) before it is
    # deleted and its requests fail.
    reform_wait_s: float = 30.0
    # How long a group whose ranks are all registered but one of which
    # reported a failure waits before it is re-formed with the same members:
    # longer than the experts' lease TTL, so that a rank that died without a
    # word is seen gone (and replaced) first.
    reform_settle_s: float = 3.0

    def __post_init__(self) -> None:
        MemberConfig.__post_init__(self)
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if self.leader_probe_interval_s < 0:
            raise ValueError(f"leader_probe_interval_s must be >= 0, got {self.leader_probe_interval_s}")
        if self.leader_probe_timeout_s <= 0:
            raise ValueError(f"leader_probe_timeout_s must be > 0, got {self.leader_probe_timeout_s}")
        for name in ("reform_wait_s", "reform_settle_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.gateway_probe_interval_s < 0:
            raise ValueError(f"gateway_probe_interval_s must be >= 0, got {self.gateway_probe_interval_s}")
        if self.leader_probe_silent_s < 0:
            raise ValueError(f"leader_probe_silent_s must be >= 0, got {self.leader_probe_silent_s}")
        if self.rank_probe_interval_s < 0:
            raise ValueError(f"rank_probe_interval_s must be >= 0, got {self.rank_probe_interval_s}")
        if self.rank_probe_silent_s <= 0:
            raise ValueError(f"rank_probe_silent_s must be > 0, got {self.rank_probe_silent_s}")
        if self.rank_probe_misses < 1:
            raise ValueError(f"rank_probe_misses must be >= 1, got {self.rank_probe_misses}")
        if self.leader_probe_misses < 1:
            raise ValueError(f"leader_probe_misses must be >= 1, got {self.leader_probe_misses}")

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

    def __post_init__(self) -> None:
        MemberConfig.__post_init__(self)
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if self.leader_probe_interval_s < 0:
            raise ValueError(f"leader_probe_interval_s must be >= 0, got {self.leader_probe_interval_s}")
        if self.leader_probe_timeout_s <= 0:
            raise ValueError(f"leader_probe_timeout_s must be > 0, got {self.leader_probe_timeout_s}")
        if self.leader_probe_misses < 1:
            raise ValueError(f"leader_probe_misses must be >= 1, got {self.leader_probe_misses}")

"""The scheduler replica's configuration (flags and env via services.settings)."""

import dataclasses

from services.settings import MemberConfig


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerConfig(MemberConfig):
    """A scheduler replica: leader election, membership, group formation."""

    # Expert services per worker group (the world size of each group).
    group_size: int = 2

    def __post_init__(self) -> None:
        MemberConfig.__post_init__(self)
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")

"""The router service's configuration (flags and env via services.settings)."""

import dataclasses

from services.settings import MemberConfig


@dataclasses.dataclass(frozen=True, slots=True)
class RouterConfig(MemberConfig):
    """The router service: expert load statistics of every group."""

    def __post_init__(self) -> None:
        MemberConfig.__post_init__(self)

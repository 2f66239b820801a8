"""The router service's configuration (flags and env via services.settings)."""

import dataclasses

from router_svc.policy import ScalingPolicy
from services.settings import MemberConfig


@dataclasses.dataclass(frozen=True, slots=True)
class RouterConfig(MemberConfig):
    """The router service: expert load statistics of every group, and expert scaling."""

    # How often the scaling policy looks at every group (seconds); 0 turns
    # dynamic expert scaling off (statistics only). Groups whose expert
    # services have no spare slots (--num-spare-expert-slots) are never scaled.
    policy_interval_s: float = 10.0
    # An expert whose share of its layer's hits stays above this for
    # scale_up_window_s gets another replica (up to max_replicas).
    scale_up_hit_rate: float = 0.10
    # The window of scale_up_hit_rate (seconds); also the window a rebalance plans from.
    scale_up_window_s: float = 300.0
    # An expert with replicas whose share stays below this for
    # scale_down_window_s loses one (never the last copy).
    scale_down_hit_rate: float = 0.03
    # The window of scale_down_hit_rate (seconds).
    scale_down_window_s: float = 600.0
    # Copies of one expert at most, its primary included.
    max_replicas: int = 3
    # How often the spares are planned afresh to minimise the largest rank
    # load (over the scale-up window); 0 never.
    rebalance_interval_s: float = 900.0
    # A rebalance is proposed only if it lowers the max/mean rank load by at
    # least this share.
    rebalance_min_gain: float = 0.05
    # Deadline of one ProposePlacement call to the scheduler leader.
    propose_deadline_s: float = 5.0

    def __post_init__(self) -> None:
        MemberConfig.__post_init__(self)
        _ = self.policy  # checks the thresholds
        for name in ("policy_interval_s", "rebalance_interval_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.rebalance_min_gain < 1:
            raise ValueError(f"rebalance_min_gain must be in [0, 1), got {self.rebalance_min_gain}")
        if self.propose_deadline_s <= 0:
            raise ValueError(f"propose_deadline_s must be positive, got {self.propose_deadline_s}")

    @property
    def policy(self) -> ScalingPolicy:
        """The scaling thresholds (ValueError if inconsistent)."""
        return ScalingPolicy(self.scale_up_hit_rate, self.scale_up_window_s, self.scale_down_hit_rate,
                             self.scale_down_window_s, self.max_replicas)

    @property
    def window_horizon_s(self) -> float:
        """How long hit reports are kept: the longest window."""
        return max(self.scale_up_window_s, self.scale_down_window_s)

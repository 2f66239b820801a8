"""What a rank is: its group, experts and KV pool, as GetRankInfo reports them.

Its own module so that the servicer, the lifecycle and the observability read
it without importing the step machinery (runner.py and executor.py import
each other's types otherwise).
"""

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-heavy; only the annotation needs it
    from expert_svc.executor import StepExecutor


@dataclasses.dataclass(slots=True)
class RankState:
    """What the rank is, as GetRankInfo reports it; `executor` is set once ready."""

    member_id: str
    model_name: str
    group_id: str = ""
    rank: int = 0
    world_size: int = 0
    placement_epoch: int = 0
    expert_ids: tuple[int, ...] = ()
    num_kv_blocks: int = 0
    kv_block_size: int = 0
    executor: "StepExecutor | None" = None

    @property
    def is_ready(self) -> bool:
        """True once the weights are loaded and the process group is up."""
        return self.executor is not None

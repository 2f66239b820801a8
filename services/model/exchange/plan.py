"""A group's exchange design per step size: --ep-dispatch over cost_model.py's choice.

Every rank of a group builds the same DispatchPlan (the same flags, the
same group: expert_svc/model_builder.py's plan_dispatch) and asks it with
the same step size (the largest rank's tokens), so the ranks take the same
design each step. Pure Python, no torch.
"""

import dataclasses

from services.model.exchange.cost_model import SETTINGS, LinkCosts, RowShape, Topology, choose


@dataclasses.dataclass(frozen=True, slots=True)
class DispatchPlan:
    """A group's exchange design per step size: --ep-dispatch (auto, gather or alltoall) over its
    topology, the row shape and the link costs (see the module doc)."""

    setting: str
    topology: Topology
    shape: RowShape
    costs: LinkCosts
    max_fixed_tokens: int  # steps up to this many tokens per rank run at a fixed capacity (0: none)

    def __post_init__(self) -> None:
        if self.setting not in SETTINGS:
            raise ValueError(f"ep_dispatch must be one of {SETTINGS}, got {self.setting!r}")

    def is_fixed(self, tokens_per_rank: int) -> bool:
        """Whether the all-to-all design runs this step at a fixed capacity (else host splits)."""
        return 0 < self.max_fixed_tokens and tokens_per_rank <= self.max_fixed_tokens

    def design(self, tokens_per_rank: int) -> str:
        """The design of a step whose largest rank has this many tokens."""
        if self.setting != "auto":
            return self.setting
        return _chosen(self, max(tokens_per_rank, 1))

    def splits_design(self) -> str | None:
        """The design of every step too big for a fixed capacity (up to 2^16 tokens per rank),
        or None where it depends on the step's size."""
        if self.setting != "auto":
            return self.setting
        first = self.max_fixed_tokens + 1
        designs = {self.design(size) for size in (first, *(1 << i for i in range(17) if 1 << i > first))}
        return designs.pop() if len(designs) == 1 else None

    def describe(self) -> str:
        """One line for the log: the setting, the topology and the design per range of step sizes."""
        sizes = [1 << i for i in range(15)]
        spans: list[list] = []  # [design, first size, last size]
        for size in sizes:
            design = self.design(size)
            if spans and spans[-1][0] == design:
                spans[-1][2] = size
            else:
                spans.append([design, size, size])
        ranges = ", ".join(f"{d} at {a}" + (f"-{b}" if b > a else "") for d, a, b in spans)
        return (f"--ep-dispatch {self.setting} over {self.topology.describe()}: {ranges} tokens per rank"
                + (" (the cost model's choice)" if self.setting == "auto" else ""))


def _chosen(plan: DispatchPlan, tokens_per_rank: int) -> str:
    cache = _CHOICES.setdefault(plan, {})
    if tokens_per_rank not in cache:
        cache[tokens_per_rank] = choose(tokens_per_rank, plan.shape, plan.topology, plan.costs,
                                        is_fixed=plan.is_fixed(tokens_per_rank)).design
    return cache[tokens_per_rank]


# Per plan, the design per step size: every MoE layer of a step asks for it.
_CHOICES: dict[DispatchPlan, dict[int, str]] = {}

"""How many spare expert slots a rank reserves for replicas: `--num-spare-expert-slots auto`. Pure.

A spare slot holds one expert's weights in every MoE layer, and it is taken
from the memory the KV pool would otherwise get. `auto` spends at most
`KV_SHARE` of the rank's KV budget (the free memory after the weights times
--kv-memory-fraction on CUDA, --kv-memory-bytes on the CPU) and never more
slots per layer than the router's default policy can fill:

- at most `HOT_EXPERTS` experts of a layer can be above the scale-up share
  (10%: shares sum to 1, so at most 9 are strictly above it);
- each gets at most `MAX_COPIES - 1` replicas, and never two on one rank,
  so at most `min(MAX_COPIES, N) - 1` of them;
- those replicas spread over the N ranks: ceil(HOT_EXPERTS * (copies - 1) / N)
  slots per rank, and never more than the E - E/N experts the rank does not
  hold already.

A group of one rank gets 0: a replica on the rank that already holds the
expert only adds a slot, never spreads a load. Every rank of a group must
agree (the caller takes the minimum over the ranks on CUDA, where free
memory is measured; on the CPU the inputs are the same on every rank).
"""

import dataclasses
import math

AUTO = "auto"
# The largest share of the KV budget the spares may take.
KV_SHARE = 0.10
# The router's default policy (router_svc/config.py): experts strictly above a 10% share
# of their layer's hits, at most 3 copies of one expert.
HOT_EXPERTS = 9
MAX_COPIES = 3


@dataclasses.dataclass(frozen=True, slots=True)
class SpareSlots:
    """The resolved number of spare slots per MoE layer, and why (for the log)."""

    num_slots: int
    reason: str


def parse_setting(text: str) -> int | None:
    """`auto` -> None, else the explicit count; ValueError quoting a bad value."""
    if text.strip().lower() == AUTO:
        return None
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"num_spare_expert_slots must be 'auto' or an integer >= 0, got {text!r}") from None
    if value < 0:
        raise ValueError(f"num_spare_expert_slots must be 'auto' or an integer >= 0, got {text!r}")
    return value


def slots_cap(num_experts: int, num_ranks: int) -> int:
    """The most spare slots per layer and rank the default policy can use (see the module doc)."""
    if num_ranks <= 1:
        return 0
    copies = min(MAX_COPIES, num_ranks) - 1
    return min(math.ceil(HOT_EXPERTS * copies / num_ranks), num_experts - num_experts // num_ranks)


def auto_spare_slots(*, num_experts: int, num_ranks: int, kv_budget_bytes: int, slot_bytes: int) -> SpareSlots:
    """The `auto` count for a rank of `num_ranks` whose KV pool would get kv_budget_bytes; a
    spare slot costs slot_bytes (one expert's weights in every MoE layer)."""
    if slot_bytes <= 0:
        raise ValueError(f"slot_bytes must be positive, got {slot_bytes}")
    if num_ranks <= 1:
        return SpareSlots(0, "a group of one rank: a replica could only sit beside its primary")
    cap = slots_cap(num_experts, num_ranks)
    affordable = int(max(0, kv_budget_bytes) * KV_SHARE) // slot_bytes
    num_slots = min(cap, affordable)
    return SpareSlots(num_slots, (
        f"{num_slots} = min(policy cap {cap} for {num_experts} experts over {num_ranks} ranks, "
        f"{affordable} affordable in {KV_SHARE:.0%} of the {kv_budget_bytes / 2**20:.0f} MiB KV budget "
        f"at {slot_bytes / 2**20:.1f} MiB a slot)"))

"""A rank's side of expert placements: stage each new placement in the background, install it at a step.

`PlacementFollower.run` watches the group's placement key. For each new
epoch it reads the weights of the replicas this rank must add (the spares
whose expert changes) in a worker thread, keeping the steps running, and
then marks the rank ready for that epoch in etcd. The gateway stamps the
epoch on the plans once every rank is ready, and `install(epoch)` runs on
the model thread before the first step that carries it: it copies the
staged weights into the spare slots and rewrites every MoE layer's slot map
in place (shapes never change, so captured CUDA graphs stay valid). All
ranks install at the same step, so the routing tables always agree. The
gates are never touched.

If the applied placement changed between staging and installing (an epoch
skipped), install loads what it needs synchronously (slower, logged).
Epoch 0 is the placement with every spare empty.
"""

import asyncio
import logging
from collections.abc import Callable, Mapping

from torch import Tensor

from services.cluster import ClusterUnavailableError
from services.model.checkpoint import CheckpointError, load_weights
from services.model.expert_map import apply_placement, replica_tensor_names
from services.model.random_weights import RandomWeights
from services.placement import Placement
from services.placement_store import PlacementStore

log = logging.getLogger("expert_svc.placement")

# (hub name -> tensor) for the given experts; only their `...experts.E.*` tensors are read.
LoadExperts = Callable[[list[int]], Mapping[str, Tensor]]


class PlacementFollower:
    """Stages and installs the expert placements of one rank's group."""

    def __init__(self, model, store: PlacementStore, *, group_id: str, rank: int, member_id: str,
                 load_experts: LoadExperts):
        self._model, self._store, self._load_experts = model, store, load_experts
        self._group_id, self._rank, self._member_id = group_id, rank, member_id
        mc = model.config
        self._empty = Placement(mc.num_experts, model.comm.world_size, model.num_spare_expert_slots)
        self.applied = self._empty
        self._known: dict[int, Placement] = {}
        # epoch -> (the applied epoch the weights were staged against, the weights)
        self._staged: dict[int, tuple[int, dict[str, Tensor]]] = {}

    async def run(self) -> None:
        """Follows the placement key until cancelled."""
        async for placement in self._store.watch(self._group_id):
            if placement is None or placement.epoch in self._known or placement.epoch <= self.applied.epoch:
                continue
            if (placement.num_experts, placement.num_ranks, placement.num_spare_slots) != (
                    self._empty.num_experts, self._empty.num_ranks, self._empty.num_spare_slots):
                log.error("ignoring placement epoch %d: it is for %d experts, %d ranks, %d spares; this rank "
                          "has %d, %d, %d", placement.epoch, placement.num_experts, placement.num_ranks,
                          placement.num_spare_slots, self._empty.num_experts, self._empty.num_ranks,
                          self._empty.num_spare_slots)
                continue
            self._known[placement.epoch] = placement
            base = self.applied
            try:
                weights = await asyncio.to_thread(self._read, base, placement)
                self._staged[placement.epoch] = (base.epoch, weights)
                await self._store.mark_ready(self._group_id, placement.epoch, self._rank, self._member_id)
            except (CheckpointError, ClusterUnavailableError, KeyError) as error:
                # Not ready: the gateway keeps the applied placement; the next epoch tries again.
                log.error("could not stage placement epoch %d: %r", placement.epoch, error)
                continue
            log.info("staged placement epoch %d (%d tensors); ready", placement.epoch, len(weights))

    def _read(self, base: Placement, target: Placement) -> dict[str, Tensor]:
        """The hub tensors of the replicas going from base to target adds on this rank."""
        needed = base.loads_needed(target, self._rank)
        experts = sorted({e for changes in needed.values() for _, e in changes})
        if not experts:
            return {}
        wanted = replica_tensor_names(base, target, self._rank)
        weights = self._load_experts(experts)
        return {name: weights[name] for name in wanted}

    def install(self, epoch: int) -> None:
        """Model thread, before a step: makes `epoch` the applied placement.
        ValueError if this rank has never seen that epoch."""
        if epoch == self.applied.epoch:
            return
        target = self._empty if epoch == 0 else self._known.get(epoch)
        if target is None:
            raise ValueError(f"expert placement epoch {epoch} is unknown to rank {self._rank}")
        base_epoch, weights = self._staged.pop(epoch, (None, {}))
        if base_epoch != self.applied.epoch and self.applied.loads_needed(target, self._rank):
            log.warning("placement epoch %d was staged against epoch %s, but %d is applied: loading now",
                        epoch, base_epoch, self.applied.epoch)
            weights = self._read(self.applied, target)
        apply_placement(self._model, self.applied, target, self._rank, weights)
        self.applied = target
        for old in [e for e in self._staged if e <= epoch]:
            del self._staged[old]
        log.info("installed expert placement epoch %d", epoch)


def expert_loader(config, model_config, dtype) -> LoadExperts:
    """Where a rank reads replica weights: the checkpoint (to host memory;
    installing copies them to the device), or for `--random-weights` the
    same generator as the primaries, drawn on the device (a tensor's values
    depend only on the seed and its name). Quantized experts come in their stored layouts
    (their scales included), which installing copies as they are."""
    if config.random_weights:
        return lambda ids: RandomWeights.for_preset(config.random_weights, model_config, ids,
                                                    config.random_weights_seed, dtype=dtype, device=config.device)
    return lambda ids: load_weights(config.model, model_config, ids, dtype=dtype, device="cpu")


def start_following(model, runner, cluster, *, group_id: str, rank: int, member_id: str,
                    load_experts: LoadExperts) -> asyncio.Task:
    """Hooks a PlacementFollower into the runner and starts it; returns its task."""
    follower = PlacementFollower(model, PlacementStore(cluster), group_id=group_id, rank=rank,
                                 member_id=member_id, load_experts=load_experts)
    runner.install_placement = follower.install
    return asyncio.create_task(follower.run(), name="placement-follower")

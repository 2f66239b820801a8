"""A rank's PlacementFollower: stages a new placement from the checkpoint, marks itself
ready, installs it before a step (weights into the spare slots, slot maps in place), and
refuses an epoch it never saw. No etcd: the store is a fake fed by the test."""

import asyncio

import pytest
import torch

from expert_svc.config import ExpertConfig
from expert_svc.placement import PlacementFollower, expert_loader
from services.model.checkpoint import load_weights
from services.model.config import ModelConfig
from services.model.moe_dispatch import local_expert_ids
from services.model.qwen3_moe import Qwen3MoeModel
from services.placement import EMPTY, Placement
from tests.bounded import eventually, run


class _Comm:
    """Rank 1 of 2 without a process group: enough to build and install, not to step."""

    rank, world_size = 1, 2


class FakeStore:
    def __init__(self):
        self.placements: asyncio.Queue = asyncio.Queue()
        self.ready: list[tuple] = []

    async def watch(self, group_id):
        while True:
            yield await self.placements.get()

    async def mark_ready(self, group_id, epoch, rank, member_id):
        self.ready.append((group_id, epoch, rank, member_id))


def test_stages_then_installs_replicas_and_refuses_unknown_epochs(small_model_dir):
    config = ModelConfig.from_model_dir(small_model_dir)
    own = local_expert_ids(config.num_experts, 1, 2)  # experts 4..7
    model = Qwen3MoeModel(config, load_weights(small_model_dir, config, own), expert_ids=own, comm=_Comm(),
                          num_spare_expert_slots=2)
    loader = expert_loader(ExpertConfig(member_id="e1", model=str(small_model_dir)), config, torch.float32)
    store = FakeStore()
    follower = PlacementFollower(model, store, group_id="g", rank=1, member_id="e1", load_experts=loader)
    layer = config.moe_layers[0]
    moe = model.layers[layer].feed_forward
    hub = load_weights(small_model_dir, config, [0, 1])

    async def body():
        task = asyncio.create_task(follower.run())
        # Rank 1's spares: expert 0 then nothing; rank 0's spares are not this rank's business.
        store.placements.put_nowait(Placement(8, 2, 2, {layer: (5, EMPTY, 0, EMPTY)}, epoch=1))
        assert await eventually(lambda: store.ready == [("g", 1, 1, "e1")])
        assert torch.count_nonzero(moe.w_gate_up_LGD[4]) == 0  # staged only, nothing installed yet
        follower.install(1)
        prefix = f"model.layers.{layer}.mlp.experts.0."
        assert torch.equal(moe.w_gate_up_LGD[4], torch.cat((hub[prefix + "gate_proj.weight"],
                                                              hub[prefix + "up_proj.weight"])))
        assert torch.equal(moe.w_down_LDF[4], hub[prefix + "down_proj.weight"])
        # Expert 0 now lives in slot 0 (rank 0) and slot 10 (rank 1, spare 0), rank 1's first.
        assert moe.slot_map.replicas_EX[0, :2].tolist() == [10, 0] and moe.slot_map.num_replicas_E[0] == 2
        assert moe.slot_map.replicas_EX[5, :2].tolist() == [7, 4]  # rank 0's spare holds 5: rank 1's primary first
        # Epoch 2 moves expert 1 into rank 1's second spare, expert 0 stays in the first.
        store.placements.put_nowait(Placement(8, 2, 2, {layer: (EMPTY, EMPTY, 0, 1)}, epoch=2))
        assert await eventually(lambda: len(store.ready) == 2)
        with pytest.raises(ValueError, match="epoch 3 is unknown"):
            follower.install(3)
        follower.install(2)
        assert moe.slot_map.num_replicas_E.tolist()[:2] == [2, 2] and follower.applied.epoch == 2
        assert torch.equal(moe.w_down_LDF[5], hub[f"model.layers.{layer}.mlp.experts.1.down_proj.weight"])
        follower.install(0)  # back to no replicas: the maps only
        assert moe.slot_map.num_replicas_E.tolist() == [1] * 8
        task.cancel()

    run(body())


@pytest.mark.parametrize("method", ["fp8", "awq"])
def test_replicas_of_quantized_experts_copy_the_stored_weights_and_scales(tmp_path, method):
    import dataclasses

    from services.model.make_model import PRESETS, make_random_checkpoint
    from services.model.quant.formats import QuantConfig

    config = dataclasses.replace(PRESETS["tiny-h160"], vocab_size=512, eos_token_ids=(510, 511))
    quant = QuantConfig("fp8") if method == "fp8" else QuantConfig("awq", group_size=32)
    make_random_checkpoint(tmp_path, config, seed=4, with_tokenizer=False, quant=quant)
    own = local_expert_ids(config.num_experts, 1, 2)
    model = Qwen3MoeModel(config, load_weights(tmp_path, config, own), expert_ids=own, comm=_Comm(),
                          num_spare_expert_slots=1)
    loader = expert_loader(ExpertConfig(member_id="e1", model=str(tmp_path)), config, torch.float32)
    store = FakeStore()
    follower = PlacementFollower(model, store, group_id="g", rank=1, member_id="e1", load_experts=loader)
    layer = config.moe_layers[-1]
    experts = model.layers[layer].feed_forward.quant_experts
    stored = load_weights(tmp_path, config, [2])

    async def body():
        task = asyncio.create_task(follower.run())
        store.placements.put_nowait(Placement(8, 2, 1, {layer: (EMPTY, 2)}, epoch=1))
        assert await eventually(lambda: store.ready == [("g", 1, 1, "e1")])
        follower.install(1)
        task.cancel()

    run(body())
    for proj, stack in (("gate_proj", experts.gate), ("up_proj", experts.up), ("down_proj", experts.down)):
        for key, tensor in stored[f"model.layers.{layer}.mlp.experts.2.{proj}.weight"].tensors.items():
            assert torch.equal(stack.tensors[key][4], tensor), (proj, key)  # slot 4: rank 1's spare
    w_down_QDF = model.layers[layer].feed_forward.w_down_LDF
    assert torch.equal(w_down_QDF[4], stored[f"model.layers.{layer}.mlp.experts.2.down_proj.weight"].dequantize())

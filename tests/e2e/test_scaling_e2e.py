"""Dynamic expert scaling through the whole mesh: a model whose gate sends every token to
experts 0 and 1 (both on rank 0 of 2), spare slots, and a router with windows of seconds.
The second test runs the `tiny-skewed` random weights with the spare slots left at `auto`:
replicas come for the hot experts, and go when the load moves to others.

The router sees experts 0 and 1 at 50% of the hits each, proposes a replica of each in
rank 1's spares, the scheduler leader commits placement epoch 1, both ranks stage the
replicas in the background and switch at the same step while requests keep flowing. The
max/mean rank load (router statistics: real hit counts, each expert's hits spread over
its replicas as the dispatch does) drops from 2.0 to 1.0, and every greedy request,
before, during and after the switch, gives transformers' tokens.
"""

import asyncio
import concurrent.futures
import random
import threading
import time
import urllib.request

import grpc
import pytest
import torch

from moe.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from moe.router.v1 import router_pb2, router_pb2_grpc
from moe.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from moemesh import launcher
from router_svc.policy import imbalance
from services.cluster import ClusterClient
from services.model import random_weights
from services.model.config import ModelConfig
from services.model.random_weights import SKEW_B_MODULUS, Skew
from services.placement import EMPTY, Placement
from services.placement_store import PlacementStore
from tests.conftest import hf_greedy
from tests.e2e.test_expert_parallel_e2e import _write_one_rank_routing_variant
from tests.e2e.test_mesh_e2e import generate, greedy

NUM_NEW_TOKENS = 8
PROMPTS = [[9707, 11, 1879, 0], [785, 3974, 13876, 38835], [1, 2, 3, 4, 5, 6, 7, 8, 9], [151644, 872, 198, 13048],
           [40, 1079, 264, 1273, 315, 279, 6371, 1849], [2610, 525, 279, 1196, 30]]
NUM_SPARES = 2
EXPERT_ARGS = ["--num-spare-expert-slots", str(NUM_SPARES), "--stats-every-steps", "2",
               "--max-fixed-capacity-tokens", "16"]
ROUTER_ARGS = ["--policy-interval-s", "0.3", "--scale-up-window-s", "1.5", "--scale-down-window-s", "30",
               "--rebalance-interval-s", "0"]
# The measured drop of the max/mean rank load must be at least this factor (2.0 expected).
MIN_IMBALANCE_DROP = 1.8
INSTALLED = "installed expert placement epoch 1"


@pytest.fixture(scope="module")
def skewed_model_dir(tiny_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("skewed") / "model"
    _write_one_rank_routing_variant(tiny_model_dir, path, ModelConfig.from_model_dir(tiny_model_dir).num_experts_per_tok)
    return path


@pytest.fixture(scope="module")
def expected(skewed_model_dir):
    from transformers import Qwen3MoeForCausalLM

    hf = Qwen3MoeForCausalLM.from_pretrained(skewed_model_dir, dtype=torch.float32, attn_implementation="eager",
                                             experts_implementation="eager").eval()
    return [hf_greedy(hf, p, NUM_NEW_TOKENS) for p in PROMPTS]


def _generate_all(stub, tag: str) -> list[list[int]]:
    def one(i: int) -> list[int]:
        request = gateway_pb2.GenerateRequest(request_id=f"{tag}-{i}", input_ids=gateway_pb2.TokenIds(ids=PROMPTS[i]),
                                              sampling=greedy(n=NUM_NEW_TOKENS))
        return generate(stub, request, timeout=60)[0]

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, range(len(PROMPTS))))


def _installed_on_every_rank(mesh: launcher.Mesh) -> bool:
    return all(INSTALLED in (mesh.work_dir / f"expert-{r}.log").read_text() for r in range(2))


def test_hot_experts_get_replicas_and_the_rank_loads_even_out_with_identical_outputs(skewed_model_dir, expected):
    spec = launcher.MeshSpec(model_dir=str(skewed_model_dir), num_ranks=2, device="cpu",
                             extra_args={"expert_svc": EXPERT_ARGS, "router_svc": ROUTER_ARGS})
    with launcher.Mesh(spec) as mesh, grpc.insecure_channel(mesh.gateway_address) as gw, \
            grpc.insecure_channel(mesh.scheduler_addresses[0]) as sched:
        stub = gateway_pb2_grpc.GenerationServiceStub(gw)
        [group] = scheduler_pb2_grpc.SchedulerServiceStub(sched).GetClusterState(
            scheduler_pb2.GetClusterStateRequest(), timeout=5).groups
        router_port = next(r.port for r in mesh.roles if r.name == 'router')
        router_address = f'127.0.0.1:{router_port}'
        outputs = _generate_all(stub, "before")
        assert outputs == expected

        # Traffic through the switch: every request of every round must give the reference tokens.
        during, stop = [], threading.Event()

        def keep_sending():
            while not stop.is_set():
                during.append(_generate_all(stub, f"during{len(during)}"))

        sender = threading.Thread(target=keep_sending)
        sender.start()
        try:
            deadline = time.monotonic() + 60
            while not _installed_on_every_rank(mesh):
                assert time.monotonic() < deadline, "the placement was never installed"
                assert sender.is_alive()
                time.sleep(0.2)
            switched_at = time.monotonic()
            while time.monotonic() < switched_at + 2.0 or len(during) < 2:
                time.sleep(0.1)
        finally:
            stop.set()
            sender.join(timeout=60)
        assert during and all(round_ == expected for round_ in during)
        assert _generate_all(stub, "after") == expected

        with grpc.insecure_channel(router_address) as ch:
            stats = router_pb2_grpc.RouterServiceStub(ch).GetExpertStats(
                router_pb2.GetExpertStatsRequest(group_id=group.group_id, window_s=5.0), timeout=5)
        router = next(r for r in mesh.roles if r.name == "router")
        scraped = urllib.request.urlopen(f"http://127.0.0.1:{router.metrics_port}/metrics", timeout=5).read().decode()
    assert f'moemesh_router_placement_epoch{{group="{group.group_id}"}} 1.0' in scraped
    assert "moemesh_router_window_rank_load_imbalance_ratio{" in scraped
    assert stats.layers, "no hits in the last window"
    before = Placement(8, 2, NUM_SPARES)  # no replicas
    for layer in stats.layers:
        assert sum(layer.hit_rates[:2]) == pytest.approx(1.0)  # the gate sends everything to experts 0 and 1
        loads_before = before.rank_loads(layer.layer, list(layer.counts))
        assert loads_before[1] == 0 and imbalance(loads_before) == pytest.approx(2.0)
        after = layer.rank_load_imbalance
        assert len(layer.rank_loads) == 2 and after == pytest.approx(imbalance(list(layer.rank_loads)))
        print(f"layer {layer.layer}: max/mean rank load {imbalance(loads_before):.3f} -> {after:.3f}")
        assert imbalance(loads_before) / after >= MIN_IMBALANCE_DROP


# The skewed preset's mesh: spare slots left at auto (4 a rank: the cap for 8 experts on 2 ranks).
SKEW_SEED = 0
SKEW_EXPERT_ARGS = ["--random-weights", "tiny-skewed", "--random-weights-seed", str(SKEW_SEED),
                    "--stats-every-steps", "2", "--max-fixed-capacity-tokens", "16"]
# Hot experts take about half of their layer's hits, cold ones a few percent at most.
SKEW_ROUTER_ARGS = ["--policy-interval-s", "0.3", "--scale-up-window-s", "1.5", "--scale-down-window-s", "3",
                    "--scale-up-hit-rate", "0.3", "--scale-down-hit-rate", "0.1", "--rebalance-interval-s", "0"]
# Every prompt is prefilled in full (no cached prefix hides its hits from the router).
SKEW_GATEWAY_ARGS = ["--no-enable-prefix-cache"]


def _skewed_prompts(kind: str, count: int, seed: int) -> list[list[int]]:
    """A prompts (no B token) or B prompts (B tokens only) of the skewed preset."""
    rng = random.Random(seed)
    return [[SKEW_B_MODULUS * rng.randrange(1, 9000) + (SKEW_B_MODULUS - 1 if kind == "B" else rng.randrange(15))
             for _ in range(24)] for _ in range(count)]


def _run(stub, prompts: list[list[int]], tag: str, num_new_tokens: int) -> list[list[int]]:
    def one(i: int) -> list[int]:
        request = gateway_pb2.GenerateRequest(request_id=f"{tag}-{i}", input_ids=gateway_pb2.TokenIds(ids=prompts[i]),
                                              sampling=greedy(n=num_new_tokens))
        return generate(stub, request, timeout=60)[0]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, range(len(prompts))))


def _placement(endpoint: str, group_id: str) -> Placement | None:
    async def read():
        async with ClusterClient(endpoint) as client:
            return await PlacementStore(client).get(group_id)

    return asyncio.run(read())


def _until(condition, stub, kind: str, what: str, timeout_s: float = 90.0) -> None:
    """Sends `kind` traffic until condition() holds."""
    deadline, round_ = time.monotonic() + timeout_s, 0
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen in {timeout_s} s"
        _run(stub, _skewed_prompts(kind, 4, seed=1000 + round_), f"{kind}{round_}", 2)
        round_ += 1


def test_skewed_routing_gets_replicas_from_auto_spares_and_loses_them_when_the_load_moves(tmp_path):
    model_dir = random_weights.write_model_dir(tmp_path / "tiny-skewed", "tiny-skewed")
    spec = launcher.MeshSpec(model_dir=str(model_dir), num_ranks=2, device="cpu",
                             extra_args={"expert_svc": SKEW_EXPERT_ARGS, "router_svc": SKEW_ROUTER_ARGS,
                                         "gateway": SKEW_GATEWAY_ARGS})
    config = random_weights.preset("tiny-skewed")
    hot = {layer: Skew(config, SKEW_SEED).hot_experts(layer) for layer in config.moe_layers}
    fixed = _skewed_prompts("A", 6, seed=0)
    with launcher.Mesh(spec) as mesh, grpc.insecure_channel(mesh.gateway_address) as gw, \
            grpc.insecure_channel(mesh.scheduler_addresses[0]) as sched:
        stub = gateway_pb2_grpc.GenerationServiceStub(gw)
        [group] = scheduler_pb2_grpc.SchedulerServiceStub(sched).GetClusterState(
            scheduler_pb2.GetClusterStateRequest(), timeout=5).groups
        for r in range(2):
            assert "--num-spare-expert-slots auto: 4 spare slots" in (mesh.work_dir / f"expert-{r}.log").read_text()
        before = _run(stub, fixed, "before", NUM_NEW_TOKENS)

        def replicated(kind: str, expect: bool):
            def check() -> bool:
                placement = _placement(mesh.etcd_endpoint, group.group_id)
                if placement is None or not all(f"installed expert placement epoch {placement.epoch}"
                                                in (mesh.work_dir / f"expert-{r}.log").read_text() for r in range(2)):
                    return False
                held = {layer: set(placement.spares(layer)) - {EMPTY} for layer in hot}
                side = 0 if kind == "A" else 1
                return all((set(hot[layer][side]) <= held[layer]) == expect for layer in hot)
            return check

        # Hot A experts (all on rank 0) get replicas in rank 1's spares.
        _until(replicated("A", True), stub, "A", "replicas of the hot A experts")
        assert _run(stub, fixed, "after", NUM_NEW_TOKENS) == before
        router = next(r for r in mesh.roles if r.name == "router")
        with grpc.insecure_channel(f"127.0.0.1:{router.port}") as ch:
            stats = router_pb2_grpc.RouterServiceStub(ch).GetExpertStats(
                router_pb2.GetExpertStatsRequest(group_id=group.group_id, window_s=1.5), timeout=5)
        assert stats.layers
        for layer in stats.layers:
            loads_before = Placement(8, 2, 4).rank_loads(layer.layer, list(layer.counts))
            print(f"layer {layer.layer}: rank loads {loads_before} -> {list(layer.rank_loads)}")
            assert max(layer.rank_loads) <= 0.75 * max(loads_before)  # the slowest rank's share drops

        # The load moves to the B experts (rank 1): A's replicas go, B's come, outputs stay.
        _until(replicated("A", False), stub, "B", "retiring the A replicas")
        _until(replicated("B", True), stub, "B", "replicas of the hot B experts")
        assert _run(stub, fixed, "moved", NUM_NEW_TOKENS) == before

"""A rank 0 whose registered rendezvous port was taken by another process since it was picked:
ProcessGroupLink.connect raises StorePortError (a RendezvousError, so the epoch fails as any
rendezvous does), and the link joins the next epoch at another port (one gloo rank in a process
of its own: the default process group is per process); the rank registers a fresh port unless
the operator set one."""

import asyncio
import json
import subprocess
import sys
import types

from expert_svc.rendezvous import RendezvousError, StorePortError
from expert_svc.server import ExpertRank
from moemesh.etcd import free_port
from tests.expert_svc.link_scripts import NEXT_EPOCH_ALONE

_RANK = r"""
import json, socket, sys
import torch, torch.distributed as dist
from expert_svc.rendezvous import ProcessGroupLink, RendezvousError, StorePortError
from services.cluster import GroupAssignment, RankInfo

taken, next_port = int(sys.argv[1]), int(sys.argv[2])
squatter = socket.socket()
squatter.bind(("127.0.0.1", taken))
squatter.listen()
link = ProcessGroupLink("gloo", timeout_s=20)
outcome = {}
try:
    link.connect(GroupAssignment("g0", 1, 1, 1, f"127.0.0.1:{taken}", [RankInfo(0, "e0", "a")], None), 0)
    outcome["error"] = None
except RendezvousError as error:
    outcome["error"], outcome["port_error"] = str(error), isinstance(error, StorePortError)
""" + NEXT_EPOCH_ALONE


def test_a_taken_store_port_is_a_port_error_and_the_next_epoch_meets_elsewhere():
    taken, next_port = free_port(), free_port()
    out = subprocess.run([sys.executable, "-c", _RANK, str(taken), str(next_port)], capture_output=True, text=True,
                         timeout=90)
    assert out.returncode == 0, out.stderr[-3000:]
    outcome = json.loads(out.stdout.strip().splitlines()[-1])
    assert outcome["port_error"] is True
    assert f"127.0.0.1:{taken}" in outcome["error"] and "epoch 1" in outcome["error"]
    assert outcome["next_epoch_sum"] == [1.0, 1.0]


def _rank(rendezvous_port: int):
    """An ExpertRank with only what _move_rendezvous_port reads: its config and a cluster client."""
    rank = ExpertRank.__new__(ExpertRank)
    rank.config = types.SimpleNamespace(host="127.0.0.1", rendezvous_port=rendezvous_port)
    updates = []

    async def update_info(info):
        updates.append(info)
    rank._cluster = types.SimpleNamespace(update_info=update_info)
    return rank, updates


def test_a_taken_port_picked_by_the_rank_is_replaced_in_its_registration():
    rank, updates = _rank(0)
    asyncio.run(rank._move_rendezvous_port(RendezvousError("a peer did not come")))
    assert updates == []  # only a taken store port moves it
    asyncio.run(rank._move_rendezvous_port(StorePortError("address in use")))
    assert len(updates) == 1 and set(updates[0]) == {"rendezvous_port"} and updates[0]["rendezvous_port"] > 0


def test_a_port_set_by_the_operator_is_kept():
    rank, updates = _rank(29500)
    asyncio.run(rank._move_rendezvous_port(StorePortError("address in use")))
    assert updates == []

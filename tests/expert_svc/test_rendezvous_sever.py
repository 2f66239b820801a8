"""ProcessGroupLink.sever: a collective waiting on a peer that hung (alive, its sockets
open, never answering) fails at once instead of at the collective timeout, and the link
joins the next epoch afterwards. Two real gloo ranks, each a process of its own (the
default process group is per process)."""

import json
import subprocess
import sys

from moemesh.etcd import free_port
from tests.expert_svc.link_scripts import NEXT_EPOCH_ALONE

_RANK = r"""
import json, sys, threading, time
import torch, torch.distributed as dist
from expert_svc.rendezvous import ProcessGroupLink
from services.cluster import GroupAssignment, RankInfo

rank, port, next_port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
group = GroupAssignment("g0", 1, 1, 2, f"127.0.0.1:{port}", [RankInfo(0, "e0", "a"), RankInfo(1, "e1", "b")], None)
link = ProcessGroupLink("gloo", timeout_s=60)  # far above the bound asserted below
link.connect(group, rank)
dist.all_reduce(torch.ones(2))
if rank == 1:
    time.sleep(30)  # hung: alive, connections open, never in the next collective
    sys.exit(0)
outcome = {}
def step():
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(2))
        outcome["error"] = None
    except RuntimeError as error:
        outcome["error"] = str(error)
    outcome["waited_s"] = time.monotonic() - started
thread = threading.Thread(target=step)
thread.start()
time.sleep(0.5)
outcome["stale_epoch_severed"] = link.sever(epoch=7)
outcome["still_waiting"] = thread.is_alive()
severed_at = time.monotonic()
outcome["num_severed"] = link.sever(epoch=1)
thread.join(10)
outcome["freed_after_s"] = time.monotonic() - severed_at
link.close(1)
""" + NEXT_EPOCH_ALONE  # the next epoch: the link works again


def test_sever_fails_a_collective_stuck_on_a_hung_peer_at_once():
    port, next_port = free_port(), free_port()
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(rank), str(port), str(next_port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        out, err = procs[0].communicate(timeout=60)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert procs[0].returncode == 0, err
    outcome = json.loads(out.strip().splitlines()[-1])
    assert outcome["num_severed"] >= 1
    assert outcome["stale_epoch_severed"] == 0 and outcome["still_waiting"]  # another epoch's: nothing
    assert outcome["error"] is not None and "closed" in outcome["error"].lower(), outcome
    assert outcome["freed_after_s"] < 2.0, outcome  # not the 60 s collective timeout
    assert outcome["next_epoch_sum"] == [1.0, 1.0]

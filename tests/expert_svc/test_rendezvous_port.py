"""A rank 0 whose registered rendezvous port was taken by another process since it was picked:
ProcessGroupLink.connect raises StorePortError (a RendezvousError, so the epoch fails as any
rendezvous does), and the link joins the next epoch at another port. One gloo rank in a process
of its own (the default process group is per process)."""

import json
import subprocess
import sys

from moemesh.etcd import free_port

_RANK = r"""
import json, socket, sys
import torch, torch.distributed as dist
from expert_svc.rendezvous import ProcessGroupLink, RendezvousError, StorePortError
from services.cluster import GroupAssignment, RankInfo

taken, fresh = int(sys.argv[1]), int(sys.argv[2])
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
link.connect(GroupAssignment("g0", 2, 1, 1, f"127.0.0.1:{fresh}", [RankInfo(0, "e0", "a")], None), 0)
total = torch.ones(2)
dist.all_reduce(total)
outcome["next_epoch_sum"] = total.tolist()
link.close()
print(json.dumps(outcome), flush=True)
"""


def test_a_taken_store_port_is_a_port_error_and_the_next_epoch_meets_elsewhere():
    taken, fresh = free_port(), free_port()
    out = subprocess.run([sys.executable, "-c", _RANK, str(taken), str(fresh)], capture_output=True, text=True,
                         timeout=90)
    assert out.returncode == 0, out.stderr[-3000:]
    outcome = json.loads(out.stdout.strip().splitlines()[-1])
    assert outcome["port_error"] is True
    assert f"127.0.0.1:{taken}" in outcome["error"] and "epoch 1" in outcome["error"]
    assert outcome["next_epoch_sum"] == [1.0, 1.0]

"""How an expert rank plans its group's exchange design (expert_svc/model_builder.py, plan_dispatch):
the ranks all_gather their hosts (--ep-node, else the advertised host) over the group right after the
rendezvous, and every rank gets the same DispatchPlan, logged; a lost peer is a failed rendezvous,
settings that differ between the ranks a clear error on every rank.
Over two gloo processes."""

import datetime
import logging

import pytest
import torch
import torch.distributed as dist

from expert_svc.config import ExpertConfig
from expert_svc.model_builder import ModelBuilder
from expert_svc.rendezvous import RendezvousError
from services.model.exchange.comm import ExpertComm
from tests.gloo_ranks import leave_rank


def _builder(**fields) -> ModelBuilder:
    return ModelBuilder(ExpertConfig(member_id="e0", random_weights="tiny", **fields))


def _worker(rank: int, init_file: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        comm = ExpertComm(dist.group.WORLD)
        # the same advertised host: one host
        _builder(advertise_host="10.0.0.1", ep_dispatch="auto").plan_dispatch(comm)
        one_host = comm.plan
        # a node name each (a pod network: every pod its own address, the node shared or not)
        _builder(advertise_host=f"10.0.0.{rank + 1}", ep_node=f"node-{rank}", ep_dispatch="alltoall",
                 ep_link_costs="network_gbps=3").plan_dispatch(comm)
        results.put((rank, one_host.topology.num_hosts, one_host.setting, comm.plan.topology.num_hosts,
                     comm.plan.setting, comm.plan.costs.network.bytes_per_s, comm.plan.topology.hosts))
        # settings that differ: every rank refuses, none hangs
        with pytest.raises(ValueError, match=rf"must be the same on every rank of a group: ranks \[{1 - rank}\] "
                                             rf"differ from rank {rank}'s"):
            _builder(ep_dispatch=("gather", "alltoall")[rank]).plan_dispatch(comm)
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_rank()


def test_ranks_agree_on_their_hosts_and_the_plan(tmp_path):
    context = torch.multiprocessing.get_context("spawn")
    results = context.SimpleQueue()
    torch.multiprocessing.spawn(_worker, args=(str(tmp_path / "rendezvous"), results), nprocs=2)
    got = sorted(results.get() for _ in range(2))
    assert [g[1:6] for g in got] == [(1, "auto", 2, "alltoall", 3e9)] * 2
    assert got[0][6] == got[1][6] and len(set(got[0][6])) == 2  # the same topology on both ranks


def test_one_rank_has_no_plan():
    comm = ExpertComm.local()
    _builder().plan_dispatch(comm)
    assert comm.plan is None


def test_a_peer_lost_while_exchanging_hosts_fails_the_rendezvous(monkeypatch, caplog):
    comm = ExpertComm.local()
    comm.world_size = 2

    def lost(*args, **kwargs):
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather", lost)
    with pytest.raises(RendezvousError, match="could not exchange their hosts: Connection closed by peer"):
        _builder().plan_dispatch(comm)


def test_the_plan_is_logged_with_its_topology(monkeypatch, caplog):
    comm = ExpertComm.local()
    comm.world_size = 2

    def gather(every, mine, group=None):
        every[0].copy_(mine)
        every[1].copy_(mine)
        every[1][0] = 7  # another host, the same settings

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather", gather)
    with caplog.at_level(logging.INFO, logger="expert_svc"):
        _builder(ep_dispatch="gather").plan_dispatch(comm)
    assert comm.plan.setting == "gather" and comm.plan.topology.num_hosts == 2
    assert "expert exchange design: --ep-dispatch gather over 2 ranks on 2 hosts (1 per host): gather at 1-16384" \
        in caplog.text

"""The gateway refuses a group whose ranks serve another model (gateway/model_check.py,
services/model_identity.py, GroupManager): never a step to it, the error named, NOT_SERVING."""

import asyncio
import dataclasses
import types

import pytest

from expert_svc.config import ExpertConfig
from gateway import model_check
from gateway.frontend import Frontend
from gateway.observability import GatewayReadiness
from gateway.requests import ErrorCode, GenerationError
from moe.expert.v1 import expert_pb2_grpc
from services import grpc_util, model_identity
from services.cluster import GroupAssignment, Member, RankInfo
from services.model.make_model import PRESETS
from services.tokenizer import write_tokenizer_files
from tests.gateway.fakes import make_request
from tests.gateway.test_engine import (FakeCluster, FakeExpertService, assignment, collect, make_from_infos, run,
                                       start_manager, wait_for)

TINY = PRESETS["tiny"]


def _dir(path, tokenizer: bytes | None = None):
    path.mkdir()
    if tokenizer is not None:
        (path / "tokenizer.json").write_bytes(tokenizer)
    return str(path)


def _member(member_id: str, identity: dict | None) -> Member:
    info = {"num_experts": 8}
    if identity is not None:
        info["group_settings"] = {**identity, "backend": "gloo", "dtype": "float32"}
    return Member(member_id, "expert", "127.0.0.1:1", info)


def _group(*member_ids: str) -> GroupAssignment:
    return GroupAssignment("g1", 3, 7, len(member_ids), "h:1",
                           [RankInfo(i, m, f"127.0.0.1:{i + 1}") for i, m in enumerate(member_ids)], "gw0")


def test_the_identity_is_the_config_and_the_tokenizer_bytes_not_the_path(tmp_path):
    a = model_identity.identity(TINY, _dir(tmp_path / "a", b'{"v": 1}'))
    assert a == model_identity.identity(TINY, _dir(tmp_path / "b", b'{"v": 1}'))
    assert a["model_shape"] == (f"vocab {TINY.vocab_size}, hidden {TINY.hidden_size}, {TINY.num_hidden_layers} "
                                f"layers, {TINY.num_experts} experts (top {TINY.num_experts_per_tok})")
    other_vocab = model_identity.identity(dataclasses.replace(TINY, vocab_size=TINY.vocab_size + 64), _dir(
        tmp_path / "c", b'{"v": 1}'))
    assert other_vocab["model_config"] != a["model_config"] and other_vocab["tokenizer"] == a["tokenizer"]
    other_tokenizer = model_identity.identity(TINY, _dir(tmp_path / "d", b'{"v": 2}'))
    assert other_tokenizer["tokenizer"] != a["tokenizer"] and other_tokenizer["model_config"] == a["model_config"]


def test_a_directory_without_a_tokenizer_and_no_directory_mean_qwen3s_as_a_copy_of_it_does(tmp_path):
    copied = tmp_path / "copied"
    write_tokenizer_files(copied)
    qwen3 = model_identity.tokenizer_hash("")
    assert qwen3 == model_identity.tokenizer_hash(_dir(tmp_path / "bare")) == model_identity.tokenizer_hash(
        str(copied))


def test_the_expert_registers_the_identity_the_gateway_computes(tmp_path):
    model_dir = _dir(tmp_path / "m", b"tok")
    settings = ExpertConfig(member_id="e0", model=model_dir).group_settings(TINY)
    gateway = model_identity.identity(TINY, model_dir)
    assert model_check.mismatch(gateway, _group("e0"), [_member("e0", settings)]) is None
    assert model_check.rank_identity(_member("e0", settings)) == gateway


def test_a_mismatch_names_the_gateways_model_and_each_differing_ranks(tmp_path):
    gateway = model_identity.identity(TINY, _dir(tmp_path / "g", b"tok"))
    bigger = dataclasses.replace(TINY, hidden_size=TINY.hidden_size * 2, num_hidden_layers=3)
    theirs = model_identity.identity(bigger, _dir(tmp_path / "r", b"tok"))
    members = [_member("e0", gateway), _member("e1", theirs)]
    error = model_check.mismatch(gateway, _group("e0", "e1"), members)
    assert error is not None
    assert model_identity.describe(gateway) in error and model_identity.describe(theirs) in error
    assert "rank 1 (e1)" in error and "rank 0" not in error and "group 'g1' epoch 3" in error
    # Another tokenizer alone is a mismatch too.
    other_tokenizer = model_identity.identity(TINY, _dir(tmp_path / "t", b"other"))
    assert model_check.mismatch(gateway, _group("e0"), [_member("e0", other_tokenizer)]) is not None


def test_ranks_that_registered_no_identity_or_are_gone_are_not_checked(tmp_path):
    gateway = model_identity.identity(TINY, _dir(tmp_path / "g", b"tok"))
    assert model_check.mismatch(gateway, _group("e0", "e1"), [_member("e0", None)]) is None
    assert model_check.rank_identity(Member("e0", "expert", "a:1", {"group_settings": "x"})) == {}


class MembersCluster(FakeCluster):
    """FakeCluster with the expert members the model check reads."""

    def __init__(self, members):
        super().__init__()
        self.members = members

    async def list_members(self, role=None):
        assert role == "expert"
        return list(self.members)


class CountingExpert(FakeExpertService):
    def __init__(self):
        super().__init__()
        self.num_info_calls = 0

    async def GetRankInfo(self, request, context):
        self.num_info_calls += 1
        return await super().GetRankInfo(request, context)


@pytest.mark.parametrize("same_model", [True, False])
def test_the_gateway_serves_only_a_group_of_its_own_model(tmp_path, same_model):
    gateway = model_identity.identity(TINY, _dir(tmp_path / "g", b"tok"))
    ranks = gateway if same_model else model_identity.identity(
        dataclasses.replace(TINY, vocab_size=TINY.vocab_size + 64), str(tmp_path / "g"))

    async def scenario():
        expert_service = CountingExpert()
        expert = await grpc_util.start_server(
            [lambda s: expert_pb2_grpc.add_ExpertServiceServicer_to_server(expert_service, s)], [])
        cluster, serving = MembersCluster([_member("e0", ranks)]), []
        manager = start_manager(cluster, make_from_infos, serving, model_identity=gateway)
        readiness = GatewayReadiness(manager, 8, types.SimpleNamespace(ready_ranks=lambda *a: asyncio.sleep(0, set())))
        frontend = Frontend(tokenizer=None, limits=None, model_info=None, get_engine=lambda: manager.engine,
                            no_group_reason=lambda: manager.model_mismatch)
        task = asyncio.create_task(manager.run())
        try:
            await cluster.assignments.put(assignment(f"127.0.0.1:{expert.port}"))
            if same_model:
                await wait_for(lambda: manager.engine is not None)
                outputs = await collect(manager.engine.submit(make_request(prompt_ids=[30], max_new_tokens=2)))
                return outputs, None, serving, expert_service.num_info_calls, await readiness(), manager
            await wait_for(lambda: manager.model_mismatch is not None)
            await asyncio.sleep(0.2)
            with pytest.raises(GenerationError) as refused:
                await collect(frontend.generate(make_request()))
            return None, refused.value, serving, expert_service.num_info_calls, await readiness(), manager
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await expert.stop(0)

    outputs, refused, serving, num_info_calls, report, manager = run(scenario())
    if same_model:
        assert len([t for o in outputs for t in o.token_ids]) == 2 and True in serving
        assert manager.model_mismatch is None and "model_mismatch" not in report
        return
    assert num_info_calls == 0 and True not in serving and manager.engine is None   # never connected
    assert refused.code is ErrorCode.UNAVAILABLE
    assert refused.message.startswith("no worker group is ready: the gateway's model")
    assert model_identity.describe(gateway) in refused.message and model_identity.describe(ranks) in refused.message
    assert report["ready"] is False and report["serving"] is False
    assert report["model_mismatch"] == manager.model_mismatch


def test_requests_parked_for_a_group_that_is_re_formed_on_another_model_fail_at_once(tmp_path):
    gateway = model_identity.identity(TINY, _dir(tmp_path / "g", b"tok"))
    other = model_identity.identity(dataclasses.replace(TINY, num_hidden_layers=TINY.num_hidden_layers + 1),
                                    str(tmp_path / "g"))

    async def scenario():
        expert = await grpc_util.start_server(
            [lambda s: expert_pb2_grpc.add_ExpertServiceServicer_to_server(FakeExpertService(), s)], [])
        address = f"127.0.0.1:{expert.port}"
        cluster = MembersCluster([_member("e0", gateway)])
        manager = start_manager(cluster, make_from_infos, model_identity=gateway, resume_timeout_s=60)
        task = asyncio.create_task(manager.run())
        try:
            await cluster.assignments.put(assignment(address))
            await wait_for(lambda: manager.engine is not None)
            running = manager.engine.submit(make_request(2, max_new_tokens=10_000))
            await running.__anext__()
            cluster.members = [_member("e0", other)]     # the rank came back with another checkpoint
            start = asyncio.get_running_loop().time()
            await cluster.assignments.put(assignment(address, epoch=2))
            with pytest.raises(GenerationError) as failed:
                await collect(running)
            return failed.value, asyncio.get_running_loop().time() - start, manager.engine
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await expert.stop(0)

    failed, seconds, engine = run(scenario())
    assert failed.code is ErrorCode.UNAVAILABLE and "differs from the model of group 'g1' epoch 2" in failed.message
    assert seconds < 5 and engine is None     # not the 60 s resume timeout

"""Priority classes in admission: interactive before batch, first come first served within a class."""

import dataclasses

import pytest

from gateway.policy import interactive_first, make_policy
from gateway.requests import SeqStatus
from gateway.validation import validate_request, RequestError
from moe.gateway.v1 import gateway_pb2
from tests.gateway.fakes import FakeTokenizer, make_request
from tests.gateway.test_batcher import add, make_batcher, step
from tests.gateway.test_validation import LIMITS


def _request(request_id: str, *, is_batch: bool):
    return dataclasses.replace(make_request(4, max_new_tokens=3, ignore_eos=True, request_id=request_id),
                               is_batch=is_batch)


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_waiting_interactive_requests_are_admitted_before_batch_ones_in_arrival_order(policy):
    batcher = make_batcher(max_running_requests=1, policy=policy)
    order = [("b1", True), ("i1", False), ("b2", True), ("i2", False), ("b3", True)]
    seqs = {rid: add(batcher, _request(rid, is_batch=is_batch)) for rid, is_batch in order}
    started = []
    for _ in range(100):
        if not batcher.has_work:
            break
        step(batcher)
        started += [rid for rid, seq in seqs.items() if seq.status is not SeqStatus.WAITING and rid not in started]
    assert started == ["i1", "i2", "b1", "b2", "b3"]


def test_interactive_first_keeps_each_class_in_order_and_returns_an_all_interactive_list_as_is():
    class Seq:
        def __init__(self, name, is_batch):
            self.name, self.request = name, dataclasses.replace(make_request(), is_batch=is_batch)

    seqs = [Seq("a", True), Seq("b", False), Seq("c", True), Seq("d", False)]
    assert [s.name for s in interactive_first(seqs)] == ["b", "d", "a", "c"]
    interactive = [Seq("x", False), Seq("y", False)]
    assert interactive_first(interactive) is interactive
    assert [s.name for s in make_policy("fcfs").order(seqs, lambda s: 0)] == ["b", "d", "a", "c"]


@pytest.mark.parametrize("priority,is_batch", [(gateway_pb2.PRIORITY_UNSPECIFIED, False),
                                               (gateway_pb2.PRIORITY_INTERACTIVE, False),
                                               (gateway_pb2.PRIORITY_BATCH, True)])
def test_the_request_priority_becomes_its_class(priority, is_batch):
    request = gateway_pb2.GenerateRequest(prompt="abc", priority=priority)
    assert validate_request(request, LIMITS, FakeTokenizer()).is_batch is is_batch


def test_an_unknown_priority_is_invalid_argument():
    with pytest.raises(RequestError, match="priority must be one of"):
        validate_request(gateway_pb2.GenerateRequest(prompt="abc", priority=7), LIMITS, FakeTokenizer())

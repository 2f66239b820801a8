"""How an expert rank picks its group's exchange (expert_svc/model_builder.py, symmetric_exchange): the ranks
agree through one all_reduce, so a rank that could not set up symmetric memory takes the whole group
to the collectives under --ep-exchange auto, and fails it under symmetric. Symmetric memory itself
needs GPUs (bench/ep_gpu.py); here SymmetricExchange is replaced.

TRITON_INTERPRET=1 must be set before any kernel module is imported (model_builder.py imports
services.model.kernels.moe_ep and exchange.symmetric), as the kernel tests' modules do.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"


import pytest  # noqa: E402
import torch  # noqa: E402

from expert_svc.config import ExpertConfig  # noqa: E402
from expert_svc.model_builder import ModelBuilder  # noqa: E402
from services.model.random_weights import preset  # noqa: E402
from tests.triton_interpreter import interpreted  # noqa: E402


@pytest.fixture
def symm_exchange():
    with interpreted("exchange.symmetric") as module:
        yield module


class FakeComm:
    """max_over_ranks as a group where the other ranks pass `others`."""

    def __init__(self, others: list[int]):
        self.group, self.others = object(), others

    def max_over_ranks(self, value: int, device) -> int:
        return max([value, *self.others])


def _builder(ep_exchange: str = "auto", **fields) -> ModelBuilder:
    return ModelBuilder(ExpertConfig(member_id="e0", random_weights="tiny", device="cuda", ep_exchange=ep_exchange,
                                     **fields))


class Works:
    def __init__(self, group, max_rows_per_rank, row_width, hidden, dtype, device, timeout_ms, push, signals):
        self.args = (max_rows_per_rank, row_width, hidden, timeout_ms, push, signals)


class Fails:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("no P2P here")


@pytest.mark.parametrize("mine,others,required,expected", [
    (Works, [-1], False, "exchange"),   # every rank set it up (max of -1s)
    (Works, [0], False, None),          # another rank could not: the collectives
    (Fails, [-1], False, None),         # this rank could not
    (Works, [0], True, "error"),
    (Fails, [-1], True, "error"),
])
def test_the_ranks_agree_on_the_exchange(monkeypatch, symm_exchange, mine, others, required, expected):
    monkeypatch.setattr(symm_exchange, "SymmetricExchange", mine)
    builder = _builder("symmetric" if required else "auto")
    if expected == "error":
        with pytest.raises(RuntimeError, match="--ep-exchange symmetric: symmetric memory could not be set up"):
            builder.symmetric_exchange(FakeComm(others), required=True)
        return
    exchange = builder.symmetric_exchange(FakeComm(others), required=required)
    if expected is None:
        assert exchange is None
    else:
        mc = preset("tiny")
        assert isinstance(exchange, Works)
        # Buffers for the largest decode step, rows of the packed width, the collective timeout,
        # each rank reading its peers' buffers (pull: --ep-exchange-push is off by default).
        assert exchange.args == (256, mc.hidden_size + 8 * mc.num_experts_per_tok // 2, mc.hidden_size, 120_000,
                                 False, False)


@pytest.mark.parametrize("push,signals,expected", [(True, False, (True, False)), (False, True, (True, True)),
                                                   (True, True, (True, True))])
def test_signals_imply_push(monkeypatch, symm_exchange, push, signals, expected):
    monkeypatch.setattr(symm_exchange, "SymmetricExchange", Works)
    builder = _builder(ep_exchange_push=push, ep_exchange_signals=signals)
    assert builder.symmetric_exchange(FakeComm([-1]), required=False).args[4:] == expected


def test_signals_without_push_are_refused(symm_exchange):
    with pytest.raises(ValueError, match="signals need push"):
        symm_exchange.SymmetricExchange(None, 4, 8, 8, torch.bfloat16, "cpu", push=False, signals=True)

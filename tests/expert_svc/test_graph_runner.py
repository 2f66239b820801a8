"""The decode graph runner's logic on the CPU: buckets, padding, row mapping, the
eager-then-capture-then-replay order, padding hits taken back out, and one host
read per step. A stand-in "capture" returns the function itself, so a replay runs
the captured work eagerly on the static tensors; the real capture runs on a GPU
(bench/decode_graph_check.py)."""

import dataclasses
import datetime
import json
import pathlib
import sys

import pytest
import torch
import torch.distributed as dist

from expert_svc.graph_runner import DecodeGraphRunner, captures_decode, make_graph_runner
from expert_svc.runner import StepRunner
from services.kv_pool import KVPool
from services.model.attention import TorchReferenceAttention
from services.model.batch import SeqInput
from services.model.checkpoint import load_weights
from services.model.exchange.comm import ExpertComm
from services.model.moe_dispatch import local_expert_ids
from services.model.qwen3_moe import Qwen3MoeModel
from tests.expert_svc.conftest import SMALL
from tests.gloo_ranks import leave_rank
from services.step import NewSequence, SamplingSpec, ScheduledSequence, StepPlan

BLOCK_SIZE = 4
NUM_BLOCKS = 64
BLOCKS_PER_SEQ = 8
GREEDY = SamplingSpec(temperature=0.0)
DRAWN = SamplingSpec(temperature=0.9, top_p=0.9, seed=5)


class DeviceLensAttention(TorchReferenceAttention):
    """The reference reading context lengths from the device tensor, as a kernel would:
    a graph's static batch has no meaningful host lengths (test only: it reads back)."""

    def forward(self, layer, q_THK, k_TGK, v_TGK, batch, kv, scale, out=None):
        batch = dataclasses.replace(batch, context_lens=tuple(batch.context_lens_B.tolist()))
        return super().forward(layer, q_THK, k_TGK, v_TGK, batch, kv, scale, out)


class StandInCapture:
    """Records each capture; the "replay" runs the function again."""

    def __init__(self):
        self.num_captured = 0

    def __call__(self, fn):
        self.num_captured += 1
        return fn


@pytest.fixture(scope="module")
def weights(small_model_dir):
    return load_weights(small_model_dir, SMALL, range(SMALL.num_experts))


def make_model(weights) -> Qwen3MoeModel:
    return Qwen3MoeModel(SMALL, weights, expert_ids=range(SMALL.num_experts))


def make_runner(model, capture=None) -> StepRunner:
    kv = KVPool.for_model(SMALL, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu")
    graphs = None
    if capture is not None:
        model.attention = DeviceLensAttention()
        graphs = DecodeGraphRunner(model, kv, BLOCK_SIZE, buckets=(1, 2, 4, 8), max_blocks=BLOCKS_PER_SEQ,
                                   capture=capture)
    return StepRunner(model, kv, BLOCK_SIZE, vocab_size=SMALL.vocab_size, graphs=graphs)


def rows_per_token() -> int:
    return min(SMALL.num_experts_per_tok, SMALL.num_experts)


def test_bucket_and_fits(weights):
    model = make_model(weights)
    kv = KVPool.for_model(SMALL, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu")
    graphs = DecodeGraphRunner(model, kv, BLOCK_SIZE, buckets=(4, 1, 2, 8, 2), max_blocks=3,
                               capture=StandInCapture())
    assert graphs.buckets == (1, 2, 4, 8)
    assert [graphs.bucket(n) for n in (0, 1, 2, 3, 5, 8, 9)] == [1, 1, 2, 4, 8, 8, None]
    decode = [SeqInput(i, [7], 5, [i, 10 + i], True) for i in range(3)]
    capacity = model.dispatch_capacity(3)
    assert capacity == 4 * rows_per_token()
    assert graphs.fits(decode, capacity)
    assert graphs.fits([], model.dispatch_capacity(1))  # an idle rank of a decode step
    assert not graphs.fits(decode, None)  # host splits
    assert not graphs.fits(decode, 2 * rows_per_token())  # bucket 4 overflows a capacity of 2 tokens
    # A short chunk expands to decode rows (tests/expert_svc/test_graph_expanded.py): 4 rows, bucket 4.
    assert graphs.fits([*decode[:2], SeqInput(5, [1, 2], 0, [3], True)], capacity)
    assert not graphs.fits([*decode, SeqInput(5, [1, 2], 0, [3], True)], capacity)  # 5 rows: bucket 8
    assert not graphs.fits([SeqInput(6, [1], 12, [1, 2, 3, 4], True)], capacity)  # 4 blocks > max_blocks 3
    assert not graphs.fits([SeqInput(i, [1], 0, [i], True) for i in range(9)], model.dispatch_capacity(9))


def test_graphs_need_cuda_and_a_capturable_backend(weights):
    model = make_model(weights)
    kv = KVPool.for_model(SMALL, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu")
    assert not captures_decode(TorchReferenceAttention(), torch.device("cuda"))
    assert not captures_decode(DeviceLensAttention(), torch.device("cpu"))
    assert make_graph_runner(model, kv, BLOCK_SIZE, (1, 2)) is None  # the CPU
    assert make_graph_runner(model, kv, BLOCK_SIZE, ()) is None


def test_padded_rows_map_back_and_change_no_real_row(weights):
    model = make_model(weights)
    graphs = make_runner(model, StandInCapture()).graphs
    eager_model = make_model(weights)
    eager = make_runner(eager_model)
    seqs = [SeqInput(i, [11 * (i + 1)], 0, [2 * i, 2 * i + 1], True) for i in range(3)]
    from services.model.batch import build_forward_batch

    reference_SV = eager_model.forward(build_forward_batch(seqs, BLOCK_SIZE, "cpu"), eager.kv_pool)
    out = graphs.run(seqs, model.dispatch_capacity(3))
    assert out.logits_SV.shape == reference_SV.shape == (3, SMALL.vocab_size)
    torch.testing.assert_close(out.logits_SV, reference_SV, rtol=1e-5, atol=1e-5)
    assert out.greedy_S.tolist() == reference_SV.argmax(-1).tolist()
    # The padding row wrote no KV and its expert hits were taken back out.
    torch.testing.assert_close(graphs.kv_pool.k_cache, eager.kv_pool.k_cache)
    torch.testing.assert_close(graphs.kv_pool.v_cache, eager.kv_pool.v_cache)
    assert torch.equal(model.hit_counts_LE, eager_model.hit_counts_LE)


def test_pad_to_capacity_runs_the_capacitys_bucket(weights):
    """pad_to_capacity: a rank with 3 sequences in a step whose largest rank batch is 7 runs
    bucket 8 (the capacity's), not 4; its rows give the eager logits, the padding nothing."""
    model = make_model(weights)
    model.attention = DeviceLensAttention()
    kv = KVPool.for_model(SMALL, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu")
    graphs = DecodeGraphRunner(model, kv, BLOCK_SIZE, buckets=(1, 2, 4, 8), max_blocks=BLOCKS_PER_SEQ,
                               capture=StandInCapture(), pad_to_capacity=True)
    capacity = model.dispatch_capacity(7)
    assert graphs.step_bucket(3, capacity) == 8 and graphs.step_bucket(3, model.dispatch_capacity(3)) == 4
    assert graphs.step_bucket(3, 16 * rows_per_token()) == 4  # the capacity's rows are no bucket: its own
    eager_model = make_model(weights)
    eager = make_runner(eager_model)
    seqs = [SeqInput(i, [11 * (i + 1)], 0, [2 * i, 2 * i + 1], True) for i in range(3)]
    from services.model.batch import build_forward_batch

    reference_SV = eager_model.forward(build_forward_batch(seqs, BLOCK_SIZE, "cpu"), eager.kv_pool)
    assert graphs.fits(seqs, capacity)
    out = graphs.run(seqs, capacity)
    torch.testing.assert_close(out.logits_SV, reference_SV, rtol=1e-5, atol=1e-5)
    assert set(graphs._warmed) == {(8, capacity, False)}
    torch.testing.assert_close(graphs.kv_pool.k_cache, eager.kv_pool.k_cache)
    assert torch.equal(model.hit_counts_LE, eager_model.hit_counts_LE)


def _new(seq_id, sampling=GREEDY):
    return NewSequence(seq_id, sampling, tuple(range(seq_id * BLOCKS_PER_SEQ, (seq_id + 1) * BLOCKS_PER_SEQ)))


def _decode(*seq_ids):
    return tuple(ScheduledSequence(i) for i in seq_ids)


def steps_a() -> list[dict]:
    """Prefill three sequences, decode, finish one, add one mid-way, an idle step, decode on."""
    prompts = {0: (5, 9, 13, 2, 44), 1: (3, 8, 100), 2: (400, 17, 17, 1, 9, 30, 7), 3: (71, 72)}
    steps = [dict(new_sequences=(_new(0), _new(1, DRAWN), _new(2)),
                  scheduled=tuple(ScheduledSequence(i, prompts[i]) for i in (0, 1, 2)))]
    steps += [dict(scheduled=_decode(0, 1, 2))] * 4  # bucket 4: eager + probe, capture, replays
    steps += [dict(scheduled=_decode(0, 2), finished_seq_ids=(1,))]  # bucket 2, no padding: eager
    steps += [dict(scheduled=_decode(0, 2))] * 2  # capture, replay
    # A short prompt beside decodes: an expanded step (a decode row per token), its own key.
    steps += [dict(new_sequences=(_new(3),), scheduled=(*_decode(0, 2), ScheduledSequence(3, prompts[3])))]
    steps += [dict()]  # idle: bucket 1, all padding
    steps += [dict(scheduled=_decode(0, 2, 3))] * 3
    return steps


def steps_b() -> list[dict]:
    """Another rank's 13 steps: one sequence, then three, then two, then idle."""
    steps = [dict(new_sequences=(_new(5),), scheduled=(ScheduledSequence(5, (8, 9, 10, 11)),))]
    steps += [dict(scheduled=_decode(5))] * 4
    steps += [dict(new_sequences=(_new(6), _new(7, DRAWN)),
                   scheduled=(*_decode(5), ScheduledSequence(6, (1, 2)), ScheduledSequence(7, (3, 4, 5))))]
    steps += [dict(scheduled=_decode(5, 6, 7))] * 3
    steps += [dict(scheduled=_decode(6, 7), finished_seq_ids=(5,))]
    steps += [dict()] * 3
    return steps


def plans(*rank_steps: list[dict]) -> list[list[StepPlan]]:
    """Each rank's plans, every step carrying the largest token count of any rank."""
    def num_tokens(step: dict) -> int:
        return sum(len(s.token_ids) or 1 for s in step.get("scheduled", ()))

    return [[StepPlan(step_id=i + 1, group_id="", placement_epoch=0, **step,
                      max_tokens_per_rank=max(num_tokens(other[i]) for other in rank_steps))
             for i, step in enumerate(steps)] for steps in rank_steps]


def test_graph_steps_give_the_eager_tokens_with_one_host_read_each(weights, monkeypatch):
    eager_model, graph_model = make_model(weights), make_model(weights)
    eager, capture = make_runner(eager_model), StandInCapture()
    graphed = make_runner(graph_model, capture)
    reads = []
    for name in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, _counted(getattr(torch.Tensor, name), name, reads))
    for plan in plans(steps_a())[0]:
        expected = eager.run_step(plan)
        reads.clear()
        got = graphed.run_step(plan)
        assert got.tokens == expected.tokens, plan.step_id
        assert reads == ["tolist"] or not plan.scheduled, (plan.step_id, reads)
    assert torch.equal(graph_model.hit_counts_LE, eager_model.hit_counts_LE)
    g = graphed.graphs
    # Keys (4, ., plain), (2, ., plain), (4, ., expanded), (1, ., plain): eager once each (bucket 4
    # probed its padding there), then captured.
    assert (g.num_eager, capture.num_captured, g.num_captures) == (4, 2, 2)
    assert g.num_replays == 3 + 2 + 3  # bucket 4, bucket 2, bucket 4 after the mixed step


def _two_rank_worker(rank: int, init_file: str, model_dir: str, out_dir: str) -> None:
    """One rank of two (gloo): the rank's plans eagerly, then through the graph runner."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        torch.set_num_threads(1)
        expert_ids = local_expert_ids(SMALL.num_experts, rank, 2)
        weights = load_weights(model_dir, SMALL, expert_ids)
        result = {}
        for mode, capture in (("eager", None), ("graphed", StandInCapture())):
            model = Qwen3MoeModel(SMALL, weights, expert_ids=expert_ids, comm=ExpertComm(dist.group.WORLD))
            runner = make_runner(model, capture)
            result[mode] = [list(runner.run_step(p).tokens) for p in plans(steps_a(), steps_b())[rank]]
            result[mode + "_hits"] = model.hit_counts_LE.tolist()
            if capture is not None:
                g = runner.graphs
                result["counts"] = [g.num_eager, g.num_captures, g.num_replays]
        pathlib.Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_rank()


def test_two_ranks_capture_and_replay_at_different_steps_in_lockstep(small_model_dir, tmp_path):
    """The ranks' buckets differ step by step (one captures while the other replays, runs
    eagerly or idles in a padding-only graph): the collectives still line up, and every
    rank's tokens and hits are the eager ones."""
    torch.multiprocessing.spawn(_two_rank_worker, nprocs=2,
                                args=(str(tmp_path / "rendezvous"), str(small_model_dir), str(tmp_path)))
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["graphed"] == result["eager"], rank
        assert result["graphed_hits"] == result["eager_hits"], rank
        assert result["counts"][2] > 0, rank  # some steps replayed
    assert sum(len(step) for step in result["eager"]) > 10


def _counted(method, name, reads):
    """method, recording its name when called from the service code (not torch, not a test)."""
    def wrapper(*args, **kwargs):
        caller = sys._getframe(1).f_code.co_filename
        if ("/expert_svc/" in caller or "/services/" in caller) and "/tests/" not in caller:
            reads.append(name)
        return method(*args, **kwargs)
    return wrapper


def test_a_plan_with_more_tokens_than_its_max_is_rejected(weights):
    runner = make_runner(make_model(weights))
    plan = StepPlan(1, "", 0, new_sequences=(NewSequence(0, GREEDY, (0, 1)),),
                    scheduled=(ScheduledSequence(0, (1, 2, 3)),), max_tokens_per_rank=2)
    with pytest.raises(ValueError, match="more than its max_tokens_per_rank 2"):
        runner.run_step(plan)
    assert runner.seq_ids == []
    ok = dataclasses.replace(plan, max_tokens_per_rank=3)
    assert [seq_id for seq_id, _ in runner.run_step(ok).tokens] == [0]


def test_static_inputs_take_a_step_in_one_copy_plus_the_tables_columns():
    from torch.utils._python_dispatch import TorchDispatchMode

    from expert_svc.graph_inputs import StaticInputs
    from services.model.batch import build_decode_batch

    inputs = StaticInputs(rows=7, max_blocks=6, device=torch.device("cpu"))  # 7: parts padded to 8 rows
    inputs.block_tables_RM.fill_(99)  # columns a step does not send keep what they held
    device_storages = {inputs._bytes.untyped_storage().data_ptr(), inputs.block_tables_RM.untyped_storage().data_ptr()}

    class DeviceWrites(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.copy_.default and args[0].untyped_storage().data_ptr() in device_storages:
                self.count += 1
            return out

    seqs = [SeqInput(7, [11], 5, [3, 4], True), SeqInput(9, [12], 9, [5, 6, 7], True)]
    with DeviceWrites() as writes:
        inputs.upload(seqs, BLOCK_SIZE, 4)
    assert writes.count == 2  # the byte buffer, then the tables' used columns
    # What build_decode_batch makes of the same rows (the eager reference of a graph step).
    host = build_decode_batch(seqs, BLOCK_SIZE, "cpu", num_rows=4, max_blocks=3)
    assert torch.equal(inputs.input_ids_R[:4], host.input_ids_T)
    assert torch.equal(inputs.positions_R[:4], host.positions_T)
    assert torch.equal(inputs.slots_R[:4], host.slot_mapping_T)
    assert torch.equal(inputs.context_lens_R[:4], host.context_lens_B)
    assert torch.equal(inputs.block_tables_RM[:4, :3], host.block_tables_BM)
    assert inputs.input_ids_R[:4].tolist() == [11, 12, 0, 0]
    assert inputs.positions_R[:4].tolist() == [5, 9, 0, 0]
    assert inputs.slots_R.tolist() == [4 * 4 + 1, 7 * 4 + 1, -1, -1, -1, -1, -1]
    assert inputs.context_lens_R.tolist() == [6, 10, 0, 0, 0, 0, 0]
    assert inputs.block_tables_RM[:4].tolist() == [[3, 4, 0, 99, 99, 99], [5, 6, 7, 99, 99, 99],
                                                   [0, 0, 0, 99, 99, 99], [0, 0, 0, 99, 99, 99]]
    assert inputs.block_tables_RM[4:].eq(99).all()
    # A smaller step after it: its rows, and nothing stale in the rows it reads.
    inputs.upload(seqs[1:], BLOCK_SIZE, 1)
    assert (inputs.input_ids_R[:1].tolist(), inputs.context_lens_R[:2].tolist()) == ([12], [10, 0])
    assert inputs.block_tables_RM[0, :3].tolist() == [5, 6, 7]
    with pytest.raises(ValueError, match="more than max_blocks 6"):
        inputs.upload([SeqInput(1, [3], 0, list(range(7)), True)], BLOCK_SIZE, 1)
    with pytest.raises(ValueError, match="do not fit"):
        inputs.upload(seqs, BLOCK_SIZE, 8)
    with pytest.raises(ValueError, match="needs 3"):  # a table too short for the step's token
        inputs.upload([SeqInput(1, [3], 8, [1, 2], True)], BLOCK_SIZE, 1)
    for part in (inputs.input_ids_R, inputs.positions_R, inputs.slots_R, inputs.context_lens_R):
        assert part.is_contiguous() and part.data_ptr() % 16 == inputs._bytes.data_ptr() % 16

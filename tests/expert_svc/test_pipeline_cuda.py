"""The device side of pipelined steps, on a GPU (skipped without one): steps launched ahead
of their reads give the tokens of steps run one by one, through real CUDA graph captures;
a decode input is the last step's token, patched into the graph's static input on the
device; reading a step's tokens waits for that step only, not for the work queued after it.

    python -m pytest -q tests/expert_svc/test_pipeline_cuda.py
"""

import dataclasses

import pytest
import torch

from expert_svc.graph_runner import DecodeGraphRunner
from expert_svc.runner import StepRunner
from services.kv_pool import KVPool
from services.model.qwen3_moe import Qwen3MoeModel
from services.model.random_weights import RandomWeights, preset
from services.step import NewSequence, SamplingSpec, ScheduledSequence, StepPlan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BLOCK_SIZE, BLOCKS_PER_SEQ, NUM_SEQS = 16, 8, 4
GPU_SLEEP_CYCLES = 20_000_000  # about 10 ms of GPU time queued behind a launched step


@pytest.fixture(scope="module")
def model():
    config = dataclasses.replace(preset("qwen3-30b-a3b"), num_hidden_layers=2)
    weights = RandomWeights(config, range(config.num_experts), 0, dtype=torch.bfloat16, device="cuda")
    return Qwen3MoeModel(config, weights, expert_ids=range(config.num_experts), dtype=torch.bfloat16,
                         device="cuda", attention="triton")


def _runner(model) -> StepRunner:
    """A runner on a KV pool of seeded noise (the cached contexts) and real CUDA graphs."""
    kv = KVPool.for_model(model.config, NUM_SEQS * BLOCKS_PER_SEQ, BLOCK_SIZE, torch.bfloat16, "cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    kv.k_cache.normal_(0, 1, generator=g)
    kv.v_cache.normal_(0, 1, generator=g)
    graphs = DecodeGraphRunner(model, kv, BLOCK_SIZE, buckets=(1, 2, 4), max_blocks=BLOCKS_PER_SEQ)
    return StepRunner(model, kv, BLOCK_SIZE, vocab_size=model.config.vocab_size, device="cuda", graphs=graphs)


def _plans() -> list[StepPlan]:
    """An eager prefill of 3 tokens per sequence (odd ones draw), then graphed decodes;
    sequence 3 sits out step 4, sequence 1 finishes in step 7."""
    drawn = SamplingSpec(temperature=0.8, top_p=0.9, seed=3)
    new = tuple(NewSequence(i, drawn if i % 2 else SamplingSpec(temperature=0.0),
                            tuple(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ)), 20 + 9 * i)
                for i in range(NUM_SEQS))
    plans = [StepPlan(1, "", 0, new_sequences=new, max_tokens_per_rank=3 * NUM_SEQS,
                      scheduled=tuple(ScheduledSequence(i, (7 + i, 8, 9)) for i in range(NUM_SEQS)))]
    for step_id in range(2, 12):
        ids = [i for i in range(NUM_SEQS) if not (step_id == 4 and i == 3) and not (step_id >= 7 and i == 1)]
        plans.append(StepPlan(step_id, "", 0, scheduled=tuple(ScheduledSequence(i) for i in ids),
                              finished_seq_ids=(1,) if step_id == 7 else (), max_tokens_per_rank=NUM_SEQS))
    return plans


def test_steps_launched_ahead_give_the_one_by_one_tokens_and_reads_wait_for_their_step_only(model):
    expected = [r.tokens for r in map(_runner(model).run_step, _plans())]
    runner = _runner(model)
    got, last, num_fed = [], None, 0
    for plan in _plans():
        step = runner.launch(plan)
        torch.cuda._sleep(GPU_SLEEP_CYCLES)
        input_ids_S = runner.graphs._input_ids_R[:len(plan.scheduled)].clone()
        if last is not None:
            result = runner.finish(last)
            assert not torch.cuda.current_stream().query(), "the read waited for the steps queued after it"
            got.append(result.tokens)
            # A graphed decode (row i is scheduled[i]) fed with the step before's tokens.
            last_tokens = dict(result.tokens)
            fed = [(row, last_tokens[s.seq_id]) for row, s in enumerate(plan.scheduled) if s.seq_id in last_tokens]
            assert [(row, input_ids_S[row].item()) for row, _ in fed] == fed
            num_fed += len(fed)
        last = step
    got.append(runner.finish(last).tokens)
    assert got == expected
    assert num_fed > 20
    assert runner.graphs.num_captures == 1 and runner.graphs.num_replays > 5


def test_each_read_step_adds_its_device_time_by_kind(model):
    """moemesh_expert_step_device_seconds: one observation per step read, the prefill under
    "prefill", the decodes under "decode", each a positive time no longer than the step's own;
    moemesh_expert_step_device_gap_seconds: one per step after the first."""
    from services import metrics

    from tests.expert_svc.test_runner import histogram_totals

    expert = metrics.expert_metrics()

    def all_totals():
        return {(name, kind): histogram_totals(getattr(expert, name), kind)
                for name in ("step_device", "step_device_gap") for kind in ("prefill", "decode")}

    before = all_totals()
    results = [r for r in map(_runner(model).run_step, _plans())]
    after = {key: (s - s0, n - n0) for (key, (s, n)), (s0, n0) in zip(all_totals().items(), before.values())}
    assert after["step_device", "prefill"][1] == 1
    assert after["step_device", "decode"][1] == len(results) - 1
    device_s = after["step_device", "prefill"][0] + after["step_device", "decode"][0]
    assert 0 < device_s <= sum(r.execute_seconds for r in results)
    # A fresh runner's first step has no gap before it; each decode after it one, while the host read
    # the step before and queued this one (run_step does not launch ahead).
    assert after["step_device_gap", "prefill"][1] == 0
    assert after["step_device_gap", "decode"][1] == len(results) - 1 and after["step_device_gap", "decode"][0] > 0

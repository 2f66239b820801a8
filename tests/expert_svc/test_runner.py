"""StepRunner against transformers: step plans of a small mixed batch give HF's greedy tokens.

The model runs with a real (world size 1, gloo) process group, so the expert
collectives are the ones a group runs.
"""

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist

from tests.conftest import hf_greedy
from expert_svc.runner import StalePlanError, StepRunner
from services.kv_pool import KVPool
from services.model.checkpoint import load_weights
from tests.expert_svc.conftest import SMALL
from services.model.exchange.comm import ExpertComm
from services.model.qwen3_moe import Qwen3MoeModel
from services.step import NewSequence, SamplingSpec, ScheduledSequence, StepPlan

BLOCK_SIZE = 4
NUM_BLOCKS = 128
NUM_NEW_TOKENS = 16
GROUP, EPOCH = "g1", 3
GREEDY = SamplingSpec(temperature=0.0)






@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    init_file = tmp_path_factory.mktemp("pg") / "init"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", world_size=1, rank=0)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def model(small_model_dir, process_group):
    weights = load_weights(small_model_dir, SMALL, range(SMALL.num_experts))
    return Qwen3MoeModel(SMALL, weights, expert_ids=range(SMALL.num_experts),
                         comm=ExpertComm(process_group))


@pytest.fixture()
def runner(model):
    kv = KVPool.for_model(SMALL, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu")
    return StepRunner(model, kv, BLOCK_SIZE, vocab_size=SMALL.vocab_size, group_id=GROUP,
                      placement_epoch=EPOCH)




@dataclasses.dataclass
class Req:
    """One sequence as a tiny gateway drives it."""

    prompt: list[int]
    join_step: int = 1
    chunk: int = 1000  # prompt tokens per step
    sampling: SamplingSpec = GREEDY
    share_prefix_of: int | None = None  # reuse this request's first full blocks (prefix cache)
    num_cached: int = 0
    generated: list[int] = dataclasses.field(default_factory=list)
    blocks: list[int] = dataclasses.field(default_factory=list)
    num_sent: int = 0  # prompt tokens sent so far
    is_started: bool = False


def drive(runner: StepRunner, reqs: list[Req], num_new: int = NUM_NEW_TOKENS) -> list[list[int]]:
    """Runs plans until every request has num_new tokens; checks the protocol's bookkeeping."""
    next_block, finished, step_id = 0, [], 0
    while any(len(r.generated) < num_new for r in reqs) or finished:
        step_id += 1
        new, scheduled = [], []
        for seq_id, r in enumerate(reqs):
            if len(r.generated) >= num_new or r.join_step > step_id:
                continue
            if not r.is_started:
                if r.share_prefix_of is not None:
                    r.blocks = reqs[r.share_prefix_of].blocks[:r.num_cached // BLOCK_SIZE]
                r.num_sent = r.num_cached
            tokens = r.prompt[r.num_sent:r.num_sent + r.chunk]
            num_after = r.num_sent + len(tokens) if tokens else len(r.prompt) + len(r.generated)
            new_blocks = list(range(next_block, next_block + math.ceil(num_after / BLOCK_SIZE) - len(r.blocks)))
            next_block += len(new_blocks)
            if not r.is_started:
                new.append(NewSequence(seq_id, r.sampling, tuple(r.blocks), r.num_cached))
                r.is_started = True
            r.blocks = r.blocks + new_blocks
            r.num_sent += len(tokens)
            is_sampled = r.num_sent == len(r.prompt)
            scheduled.append(ScheduledSequence(seq_id, tuple(tokens), tuple(new_blocks), is_sampled))
        result = runner.run_step(StepPlan(step_id, GROUP, EPOCH, tuple(new), tuple(scheduled), tuple(finished)))
        assert result.step_id == step_id and result.execute_seconds > 0
        assert [s for s, _ in result.tokens] == [s.seq_id for s in scheduled if s.is_sampled]
        finished = []
        for seq_id, token_id in result.tokens:
            reqs[seq_id].generated.append(token_id)
            if len(reqs[seq_id].generated) == num_new:
                finished.append(seq_id)
        assert next_block <= NUM_BLOCKS
    return [r.generated for r in reqs]


def _mixed_requests() -> tuple[list[list[int]], list[Req]]:
    """Five prompts and their requests: chunked prefill, a late joiner, a shared prefix."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, SMALL.vocab_size, (n,), generator=g).tolist() for n in (11, 5, 23, 9)]
    # The last request shares the first 8 tokens (2 full blocks) of the first one.
    prompts.append(prompts[0][:8] + torch.randint(0, SMALL.vocab_size, (6,), generator=g).tolist())
    reqs = [
        Req(prompts[0]),
        Req(prompts[1]),
        Req(prompts[2], chunk=16),  # chunked prefill: the first chunk samples nothing
        Req(prompts[3], join_step=3),  # joins while the others decode
        Req(prompts[4], join_step=2, share_prefix_of=0, num_cached=8),
    ]
    return prompts, reqs


def test_greedy_tokens_equal_transformers(runner, hf_small):
    prompts, reqs = _mixed_requests()
    outputs = drive(runner, reqs)
    for prompt, output in zip(prompts, outputs):
        assert output == hf_greedy(hf_small, prompt, NUM_NEW_TOKENS)
    assert runner.seq_ids == []  # every finished sequence was forgotten


def test_a_sequence_whose_cached_prefix_ends_inside_a_copied_block_gets_the_reference_tokens(runner, hf_small):
    """Sequence 1 shares sequence 0's first 9 tokens: blocks 0 and 1 in place, and the first token
    of block 2 through a copy into its own block 5, made before the step that fills the rest of it
    (which also writes sequence 0's decode into block 2)."""
    g = torch.Generator().manual_seed(11)
    first = torch.randint(0, SMALL.vocab_size, (10,), generator=g).tolist()
    second = first[:9] + torch.randint(0, SMALL.vocab_size, (4,), generator=g).tolist()
    runner.run_step(_plan(1, new=[NewSequence(0, GREEDY, (0, 1, 2))], scheduled=[ScheduledSequence(0, tuple(first))]))
    result = runner.run_step(_plan(2, new=[NewSequence(1, GREEDY, (0, 1, 5, 6), num_cached_tokens=9)],
                                   scheduled=[ScheduledSequence(1, tuple(second[9:])), ScheduledSequence(0)],
                                   copies=[(2, 5)]))
    generated = [token for seq_id, token in result.tokens if seq_id == 1]
    for step_id in range(3, 6):
        result = runner.run_step(_plan(step_id, scheduled=[ScheduledSequence(1)]))
        generated += [token for _, token in result.tokens]
    assert generated == hf_greedy(hf_small, second, 4)


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(runner):
    spec = SamplingSpec(temperature=0.9, top_k=50, top_p=0.95, seed=1234)
    prompt = list(range(100, 110))
    alone = drive(runner, [Req(prompt, sampling=spec)])[0]
    runner.reset()
    beside = drive(runner, [Req(list(range(7)), sampling=GREEDY), Req(prompt, sampling=spec)])[1]
    runner.reset()
    other_seed = drive(runner, [Req(prompt, sampling=dataclasses.replace(spec, seed=99))])[0]
    assert alone == beside
    assert alone != other_seed


def _plan(step_id, new=(), scheduled=(), finished=(), epoch=EPOCH, copies=()):
    return StepPlan(step_id, GROUP, epoch, tuple(new), tuple(scheduled), tuple(finished), block_copies=tuple(copies))


def test_idle_step_runs_the_model_with_no_tokens(runner, model):
    before = model.hit_counts_LE.clone()
    result = runner.run_step(_plan(1))
    assert result.tokens == () and runner.num_steps == 1
    assert torch.equal(model.hit_counts_LE, before)


def _launch_counts(histogram: str = "step_launch") -> dict[str, tuple[float, float]]:
    """(seconds, observations) by kind of one of the expert's launch histograms."""
    from services import metrics
    expert = metrics.expert_metrics()
    return {kind: histogram_totals(getattr(expert, histogram), kind) for kind in ("prefill", "decode")}


def test_each_step_with_sequences_adds_its_launch_time_by_kind(runner):
    """moemesh_expert_step_launch_seconds and _launch_cpu_seconds (the launching thread's CPU time):
    steps that bring prompt tokens count as prefill, one-token steps as decode, idle steps not at all;
    each observation is part of the step's own time."""
    before, cpu_before = _launch_counts(), _launch_counts("step_launch_cpu")
    runner.run_step(_plan(1))  # idle
    results = [runner.run_step(_plan(2, new=[NewSequence(0, GREEDY, (0, 1))], scheduled=[ScheduledSequence(0, (5, 6, 7))]))]
    results += [runner.run_step(_plan(step_id, scheduled=[ScheduledSequence(0)])) for step_id in (3, 4)]
    after = _launch_counts()
    assert after["prefill"][1] - before["prefill"][1] == 1
    assert after["decode"][1] - before["decode"][1] == 2
    launch_s = sum(after[k][0] - before[k][0] for k in after)
    assert 0 < launch_s <= sum(r.execute_seconds for r in results)
    cpu_after = _launch_counts("step_launch_cpu")
    assert cpu_after["prefill"][1] - cpu_before["prefill"][1] == 1
    assert cpu_after["decode"][1] - cpu_before["decode"][1] == 2
    assert 0 < sum(cpu_after[k][0] - cpu_before[k][0] for k in after)  # the CPU's forward runs in the launch


class _FakeEvent:
    """A CUDA event's timing contract: elapsed_time(later) in milliseconds."""

    def __init__(self, at_ms: float):
        self.at_ms = at_ms

    def elapsed_time(self, later: "_FakeEvent") -> float:
        return later.at_ms - self.at_ms


def histogram_totals(histogram, kind: str) -> tuple[float, float]:
    values = {s.name.rsplit("_", 1)[-1]: s.value for s in histogram.labels(kind).collect()[0].samples
              if s.name.endswith(("_sum", "_count"))}
    return values["sum"], values["count"]


def test_a_read_step_adds_its_device_time_and_the_gap_before_it_unless_the_rank_was_idle():
    from expert_svc.runner import LaunchedStep, _observe_device_time
    from services import metrics
    expert = metrics.expert_metrics()

    def step(start_ms, end_ms, previous_end_ms, has_prompt):
        return LaunchedStep(1, 0.0, (), None, _FakeEvent(end_ms), device_start=_FakeEvent(start_ms),
                            has_prompt=has_prompt, previous_ready=_FakeEvent(previous_end_ms))

    device, gap = histogram_totals(expert.step_device, "prefill"), histogram_totals(expert.step_device_gap, "prefill")
    _observe_device_time(step(100.0, 130.0, 96.0, True))  # 30 ms on the device, 4 ms idle before
    _observe_device_time(step(5000.0, 5010.0, 130.0, True))  # after an idle rank: no gap counted
    device_after = histogram_totals(expert.step_device, "prefill")
    gap_after = histogram_totals(expert.step_device_gap, "prefill")
    assert device_after[1] - device[1] == 2 and device_after[0] - device[0] == pytest.approx(0.040)
    assert gap_after[1] - gap[1] == 1 and gap_after[0] - gap[0] == pytest.approx(0.004)


@pytest.mark.parametrize(("plan", "message"), [
    (_plan(1, scheduled=[ScheduledSequence(7, (1, 2))]), "scheduled sequence 7 is unknown"),
    (_plan(1, finished=[8]), "finished sequence 8 is unknown"),
    (_plan(1, new=[NewSequence(3, GREEDY, (0,))], scheduled=[ScheduledSequence(3, tuple(range(5)))]),
     "sequence 3 has 1 blocks of 4, too few for 5 tokens"),
    (_plan(1, new=[NewSequence(3, GREEDY, (0,))], scheduled=[ScheduledSequence(3)]),
     "sequence 3 has no token_ids and no sampled token"),
    (_plan(1, new=[NewSequence(3, GREEDY, (NUM_BLOCKS,))]), f"block id {NUM_BLOCKS} outside"),
    (_plan(1, new=[NewSequence(3, GREEDY, (0,))], scheduled=[ScheduledSequence(3, (512,))]),
     "token id 512 outside"),
    (_plan(2), "step_id 2 does not follow step 0"),
    (_plan(1, new=[NewSequence(3, GREEDY, (0,))], copies=[(5, 1)]), "destination 1 is no block of a new sequence"),
    (_plan(1, new=[NewSequence(3, GREEDY, (0,))], copies=[(NUM_BLOCKS, 0)]), f"source {NUM_BLOCKS} is outside"),
    (_plan(1, new=[NewSequence(3, GREEDY, (0, 1))], copies=[(5, 1), (6, 1)]), "block 1 is the destination of two"),
])
def test_bad_plan_raises_naming_the_sequence_and_changes_nothing(runner, plan, message):
    with pytest.raises(ValueError, match=message):
        runner.run_step(plan)
    assert runner.seq_ids == []
    assert runner.num_steps == 1  # the idle step that keeps the group in lockstep
    runner.run_step(_plan(1))  # the rank still accepts the step it was due


def test_plan_of_another_epoch_is_stale(runner):
    with pytest.raises(StalePlanError, match="epoch 4"):
        runner.run_step(_plan(1, epoch=EPOCH + 1))


def test_known_sequence_cannot_be_new_again(runner):
    runner.run_step(_plan(1, new=[NewSequence(3, GREEDY, (0,))], scheduled=[ScheduledSequence(3, (1, 2))]))
    with pytest.raises(ValueError, match="new sequence 3 is already known"):
        runner.run_step(_plan(2, new=[NewSequence(3, GREEDY, (1,))]))
    assert runner.seq_ids == [3]


# ---- launch and finish: the next step launched before the last one's tokens are read -----------


def _pipeline_plans() -> list[StepPlan]:
    """Two prompts, one greedy and one drawn; sequence 1 sits out step 2 and finishes in step 5,
    planned before step 4's tokens (which sampled it) are read."""
    drawn = SamplingSpec(temperature=0.8, top_k=40, top_p=0.9, seed=7)
    decode = lambda *ids: [ScheduledSequence(i) for i in ids]  # noqa: E731
    return [
        _plan(1, new=[NewSequence(0, GREEDY, (0, 1, 2)), NewSequence(1, drawn, (3, 4, 5))],
              scheduled=[ScheduledSequence(0, (5, 17, 300, 42, 7)), ScheduledSequence(1, (100, 200, 300))]),
        _plan(2, scheduled=decode(0)),
        _plan(3, scheduled=decode(0, 1)),  # 1 is fed step 1's token, 0 step 2's: two source steps
        _plan(4, scheduled=decode(1, 0)),
        _plan(5, scheduled=decode(0), finished=[1]),
        _plan(6, scheduled=decode(0)),
    ]


def test_steps_launched_ahead_of_their_reads_give_the_same_tokens(runner, hf_small):
    expected = [runner.run_step(plan).tokens for plan in _pipeline_plans()]
    runner.reset()
    got, launched = [], []
    for plan in _pipeline_plans():  # each step launched before the one before it is read
        launched.append(runner.launch(plan))
        if len(launched) == 2:
            got.append(runner.finish(launched.pop(0)).tokens)
    got.append(runner.finish(launched.pop(0)).tokens)
    assert got == expected
    assert [s for s, _ in got[3]] == [1, 0]  # step 4 sampled 1, finished in plan 5 before this read
    greedy = [t for tokens in expected for s, t in tokens if s == 0]
    assert greedy == hf_greedy(hf_small, [5, 17, 300, 42, 7], len(greedy))
    assert runner.seq_ids == [0]


def test_a_sequence_fed_from_an_older_step_gets_the_reference_tokens(runner, hf_small):
    """Sequence 1 skips step 2: step 3 feeds it its token of step 1 from the device."""
    prompts = {0: [9, 8, 7, 6, 5, 4], 1: [300, 301, 302]}
    steps = [[0, 1], [0], [0, 1], [1, 0], [1]]
    new = [NewSequence(i, GREEDY, tuple(range(4 * i, 4 * i + 4))) for i in prompts]
    generated = {i: [] for i in prompts}
    for step_id, ids in enumerate(steps, start=1):
        scheduled = [ScheduledSequence(i, tuple(prompts[i]) if step_id == 1 else ()) for i in ids]
        result = runner.run_step(_plan(step_id, new=new if step_id == 1 else (), scheduled=scheduled))
        for seq_id, token_id in result.tokens:
            generated[seq_id].append(token_id)
    for seq_id, prompt in prompts.items():
        assert generated[seq_id] == hf_greedy(hf_small, prompt, len(generated[seq_id]))


def test_an_fp8_kv_cache_serves_the_same_protocol_and_nearly_the_same_tokens(model, hf_small):
    """--kv-cache-dtype fp8_e4m3: the runner over a float8 pool (K/V rounded to 3 mantissa bits)
    runs chunked prefill, a joining request and a shared prefix as the fp32 pool does; greedy
    tokens may part from transformers' only where rounding flips a choice."""
    kv = KVPool.for_model(SMALL, NUM_BLOCKS, BLOCK_SIZE, torch.float8_e4m3fn, "cpu")
    runner = StepRunner(model, kv, BLOCK_SIZE, vocab_size=SMALL.vocab_size, group_id=GROUP, placement_epoch=EPOCH)
    prompts, reqs = _mixed_requests()
    outputs = drive(runner, reqs)
    expected = [hf_greedy(hf_small, prompt, NUM_NEW_TOKENS) for prompt in prompts]
    assert all(len(output) == NUM_NEW_TOKENS for output in outputs)
    assert [o[0] for o in outputs] == [e[0] for e in expected]
    assert runner.seq_ids == [] and kv.k_cache.dtype == torch.float8_e4m3fn
    assert kv.k_cache.view(torch.uint8).any()  # the pool was written


def test_the_step_profiler_writes_a_line_per_step_with_prompt_tokens(runner, tmp_path):
    """--profile-prefill-steps: after the skipped steps, each profiled step with prompt tokens is one
    JSON line (host launch and wall time, the host's own ops); decode steps are profiled but not
    counted, and once the count is reached nothing more is profiled."""
    import json

    from expert_svc.step_profile import StepProfiler

    path = tmp_path / "steps.jsonl"
    runner.profiler = StepProfiler(path, count=2, skip_steps=1, device=torch.device("cpu"))
    prompts = {0: (5, 6, 7, 8, 9), 1: (3, 4), 2: (11, 12, 13)}
    runner.run_step(_plan(1, new=[NewSequence(0, GREEDY, (0, 1))], scheduled=[ScheduledSequence(0, prompts[0])]))
    runner.run_step(_plan(2, scheduled=[ScheduledSequence(0)]))  # decode: profiled, not written
    runner.run_step(_plan(3, new=[NewSequence(1, GREEDY, (2,))], scheduled=[ScheduledSequence(1, prompts[1]),
                                                                              ScheduledSequence(0)]))
    runner.run_step(_plan(4, new=[NewSequence(2, GREEDY, (3,))], scheduled=[ScheduledSequence(2, prompts[2])]))
    runner.run_step(_plan(5, new=[NewSequence(3, GREEDY, (4,))], scheduled=[ScheduledSequence(3, (1, 2))]))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(x["step_id"], x["num_tokens"], x["num_seqs"]) for x in lines] == [(3, 3, 2), (4, 3, 1)]
    assert runner.profiler.done
    for line in lines:
        assert 0 < line["launch_ms"] <= line["wall_ms"]
        assert line["host_ops"] and all(us >= 0 for _, _, us in line["host_ops"])
        assert line["kernels"] == [] and line["kernel_ms"] == 0  # no device here


def test_profiling_needs_a_file():
    from expert_svc.config import ExpertConfig

    with pytest.raises(ValueError, match="needs profile_file"):
        ExpertConfig(member_id="e0", model="m", profile_prefill_steps=3)
    with pytest.raises(ValueError, match=">= 0"):
        ExpertConfig(member_id="e0", model="m", profile_skip_steps=-1)

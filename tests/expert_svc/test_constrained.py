"""Constrained sequences on a rank (expert_svc/constrained.py through the StepRunner), on the bundled demo model.

Each step's sampled token stays inside the sequence's constraint, greedy and drawn alike;
an unconstrained neighbour's tokens do not change; a sequence resumed with its output so
far (constraint_output_ids) goes on exactly as it would have; a rank without a compiler
refuses constrained sequences.
"""

import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import services.model
from expert_svc.constrained import ConstraintMasks
from expert_svc.runner import StepRunner
from services.constraints import Compiler
from services.kv_pool import KVPool
from services.model.checkpoint import load_weights
from services.model.config import ModelConfig
from services.model.exchange.comm import ExpertComm
from services.model.qwen3_moe import Qwen3MoeModel
from services.step import NewSequence, SamplingSpec, ScheduledSequence, StepPlan
from services.tokenizer import Tokenizer
from tests.services.constraint_cases import CONSTRAINTS, check_output

DEMO = Path(services.model.__file__).parent / "demo"
BLOCK_SIZE, NUM_BLOCKS = 16, 256
GROUP, EPOCH = "g", 1
MAX_NEW = 160
GREEDY = SamplingSpec(temperature=0.0)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    init_file = tmp_path_factory.mktemp("pg") / "init"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", world_size=1, rank=0)
    config = ModelConfig.from_model_dir(DEMO)
    weights = load_weights(DEMO, config, range(config.num_experts))
    model = Qwen3MoeModel(config, weights, expert_ids=range(config.num_experts), comm=ExpertComm(dist.group.WORLD))
    yield config, model
    dist.destroy_process_group()


@functools.cache
def tokenizer() -> Tokenizer:
    return Tokenizer.from_model_dir(DEMO)


def make_runner(demo, *, with_compiler=True) -> StepRunner:
    config, model = demo
    make = (lambda: Compiler.for_tokenizer(tokenizer(), config.vocab_size)) if with_compiler else None
    kv = KVPool.for_model(config, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu")
    return StepRunner(model, kv, BLOCK_SIZE, vocab_size=config.vocab_size, group_id=GROUP, placement_epoch=EPOCH,
                      constraints=ConstraintMasks(make))


def generate(runner: StepRunner, seqs: dict[int, tuple[list[int], SamplingSpec, object, tuple[int, ...]]],
             max_new: int = MAX_NEW, stop_at_eos: bool = True) -> dict[int, list[int]]:
    """Runs each (prompt, sampling, constraint, output so far) until EOS or max_new tokens; the outputs."""
    eos = set(tokenizer().eos_token_ids)
    outputs = {seq_id: [] for seq_id in seqs}
    live, step_id, next_block = set(seqs), 0, 0
    new, scheduled, finished = [], [], []
    for seq_id, (prompt, sampling, constraint, done) in seqs.items():
        num_blocks = -(-(len(prompt) + max_new + 1) // BLOCK_SIZE)
        blocks = tuple(range(next_block, next_block + num_blocks))
        next_block += num_blocks
        new.append(NewSequence(seq_id, sampling, blocks, constraint=constraint, constraint_output_ids=done))
        scheduled.append(ScheduledSequence(seq_id, tuple(prompt)))
    while live:
        step_id += 1
        result = runner.run_step(StepPlan(step_id, GROUP, EPOCH, tuple(new), tuple(scheduled), tuple(finished)))
        new, finished = [], []
        for seq_id, token_id in result.tokens:
            outputs[seq_id].append(token_id)
            if (stop_at_eos and token_id in eos) or len(outputs[seq_id]) == max_new:
                live.discard(seq_id)
                finished.append(seq_id)
        scheduled = [ScheduledSequence(seq_id) for seq_id in sorted(live)]
    return outputs


def text_of(token_ids: list[int]) -> str:
    eos = set(tokenizer().eos_token_ids)
    assert token_ids and token_ids[-1] in eos, "the constrained output did not finish"
    return tokenizer().decode(token_ids[:-1])


PROMPT = "Reply with the ticket:"


@pytest.mark.parametrize("name", ["ticket", "nested", "regex", "choice"])
@pytest.mark.parametrize("sampling", [GREEDY, SamplingSpec(temperature=1.0, seed=3)], ids=["greedy", "drawn"])
def test_every_sampled_token_stays_inside_the_constraint(demo, name, sampling):
    prompt = tokenizer().encode(PROMPT)
    outputs = generate(make_runner(demo), {0: (prompt, sampling, CONSTRAINTS[name], ())})
    check_output(name, text_of(outputs[0]))


def test_an_unconstrained_neighbour_is_untouched(demo):
    prompts = [tokenizer().encode(PROMPT), tokenizer().encode("Once upon a time")]
    alone = generate(make_runner(demo), {1: (prompts[1], GREEDY, None, ())}, max_new=24, stop_at_eos=False)
    both = generate(make_runner(demo), {0: (prompts[0], GREEDY, CONSTRAINTS["ticket"], ()),
                                        1: (prompts[1], GREEDY, None, ())}, max_new=24, stop_at_eos=False)
    assert both[1] == alone[1]


def test_a_resumed_sequence_goes_on_as_it_would_have(demo):
    """Re-prefilled with its output so far (as after a failover), a greedy constrained sequence
    produces the rest of the same answer."""
    prompt = tokenizer().encode(PROMPT)
    whole = generate(make_runner(demo), {0: (prompt, GREEDY, CONSTRAINTS["ticket"], ())})[0]
    done = tuple(whole[:len(whole) // 2])
    rest = generate(make_runner(demo), {0: (prompt + list(done), GREEDY, CONSTRAINTS["ticket"], done)})[0]
    assert list(done) + rest == whole
    check_output("ticket", text_of(whole))


def test_a_rank_without_a_compiler_refuses_a_constrained_sequence(demo):
    runner = make_runner(demo, with_compiler=False)
    plan = StepPlan(1, GROUP, EPOCH, (NewSequence(0, GREEDY, (0,), constraint=CONSTRAINTS["choice"]),),
                    (ScheduledSequence(0, (5, 6)),))
    with pytest.raises(ValueError, match="no tokenizer"):
        runner.run_step(plan)
    assert runner.seq_ids == []

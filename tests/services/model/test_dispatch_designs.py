"""The two exchange designs (services/model/exchange/cost_model.py) give the same tokens: over two
gloo processes, the gather design in torch (moe_dispatch.dispatch's `everywhere`) against the
deduplicated all-to-all, at a fixed capacity and with host splits, layer by layer bit for bit, and
through the whole model (prefill then greedy decode) with the group's plan forced to each design
and left to "auto"."""

import dataclasses
import datetime

import pytest
import torch
import torch.distributed as dist

from services.kv_pool import KVPool
from services.model.batch import SeqInput, build_forward_batch
from services.model.checkpoint import load_weights
from services.model.config import ModelConfig
from services.model.exchange.comm import ExpertComm
from services.model.exchange.cost_model import LinkCosts, RowShape, Topology
from services.model.exchange.plan import DispatchPlan
from services.model.make_model import make_random_checkpoint
from services.model.moe import MoELayer
from services.model.moe_dispatch import combine, dispatch, gate, local_expert_ids
from services.model.moe_experts import experts
from services.model.qwen3_moe import Qwen3MoeModel
from tests.gloo_ranks import leave_rank

HIDDEN, WIDTH, NUM_EXPERTS, TOP_K = 16, 8, 8, 2
CONFIG = ModelConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, intermediate_size=64, moe_intermediate_size=16,
                     num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=128,
                     dtype=torch.float32)
BLOCK_SIZE, NUM_BLOCKS = 4, 64
# Prompt lengths per rank: rank 1's first prompt is longer than the fixed-capacity limit below.
PROMPTS = {0: [5, 3], 1: [9]}
MAX_FIXED_TOKENS = 4


class _RecordingComm(ExpertComm):
    """Records each all_to_all's input rows."""

    def __init__(self, group):
        super().__init__(group)
        self.rows = []

    def all_to_all(self, out, inp, out_splits=None, in_splits=None) -> None:
        self.rows.append(inp.shape[0])
        super().all_to_all(out, inp, out_splits, in_splits)


def _plan(setting: str, world_size: int, max_fixed: int = MAX_FIXED_TOKENS) -> DispatchPlan:
    hosts = Topology(tuple(f"host{r}" for r in range(world_size)))
    return DispatchPlan(setting, hosts, RowShape(HIDDEN, TOP_K, 4), LinkCosts.for_device("cpu"), max_fixed)


def _check_layer(comm: ExpertComm) -> None:
    """dispatch + combine with everywhere against without, and MoELayer under each plan."""
    g = torch.Generator().manual_seed(0)
    w_gate_ED = torch.randn(NUM_EXPERTS, HIDDEN, generator=g)
    w_gate_up_EGD = torch.randn(NUM_EXPERTS, 2 * WIDTH, HIDDEN, generator=g) * 0.3
    w_down_EDF = torch.randn(NUM_EXPERTS, HIDDEN, WIDTH, generator=g) * 0.3
    local = list(local_expert_ids(NUM_EXPERTS, comm.rank, comm.world_size))
    num_tokens = (7, 3)[comm.rank]  # rank 1's tokens all on rank 0's experts below
    x_TD = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(10 + comm.rank))
    ids_TK, weights_TK, counts_E = gate(x_TD, w_gate_ED, TOP_K, True)
    if comm.rank == 1:
        ids_TK = torch.tensor([[0, 1], [2, 3], [1, 3]])
    outputs = []
    for capacity, everywhere in ((None, False), (7 * TOP_K, False), (7 * TOP_K, True), (8 * TOP_K, True)):
        recording = _RecordingComm(comm.group)
        x_PD, meta = dispatch(x_TD, ids_TK, weights_TK, counts_E, recording, capacity, everywhere=everywhere)
        y_PD = experts(x_PD, meta.offsets_L, w_gate_up_EGD[local], w_down_EDF[local])
        y_PD[int(meta.offsets_L[-1]):] = float("nan")  # rows the GPU's grouped GEMM leaves unset
        outputs.append(combine(y_PD, meta, recording))
        if everywhere:  # every rank got every token's row: the gather's bytes
            assert recording.rows == [comm.world_size * capacity // TOP_K] * 2
    assert all(torch.equal(out, outputs[0]) for out in outputs), "the designs must agree bit for bit"
    with pytest.raises(ValueError, match="needs a fixed capacity"):
        dispatch(x_TD, ids_TK, weights_TK, counts_E, comm, None, everywhere=True)

    layer_outputs = []
    for setting in ("gather", "alltoall", "auto"):
        for capacity in (None, 8 * TOP_K):
            comm.plan = _plan(setting, comm.world_size)
            layer = MoELayer(w_gate_ED, w_gate_up_EGD[local], w_down_EDF[local], top_k=TOP_K, norm_topk_prob=True,
                             comm=comm, hit_counts_E=torch.zeros(NUM_EXPERTS, dtype=torch.int64))
            layer_outputs.append(layer(x_TD, capacity))
    comm.plan = None
    assert all(torch.equal(out, layer_outputs[0]) for out in layer_outputs)


def _greedy(model: Qwen3MoeModel, rank: int, num_steps: int) -> tuple[list[list[int]], torch.Tensor]:
    """Prefill this rank's prompts in one step, then num_steps greedy decode steps (every rank
    runs every step); the tokens and the last step's logits."""
    kv = KVPool.for_model(CONFIG, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu")
    prompts = [torch.randint(CONFIG.vocab_size, (n,), generator=torch.Generator().manual_seed(rank * 10 + i)).tolist()
               for i, n in enumerate(PROMPTS[rank])]
    tables = [list(range(i * 16, (i + 1) * 16)) for i in range(len(prompts))]
    seqs = [SeqInput(i, p, 0, tables[i], True) for i, p in enumerate(prompts)]
    tokens = [[] for _ in prompts]
    computed = [0] * len(prompts)
    for _ in range(num_steps + 1):
        logits_SV = model.forward(build_forward_batch(seqs, BLOCK_SIZE, "cpu"), kv)
        next_ids = logits_SV.argmax(dim=-1).tolist()
        for i, seq in enumerate(seqs):
            computed[i] += len(seq.token_ids)
            tokens[i].append(next_ids[i])
        seqs = [dataclasses.replace(seq, token_ids=[tokens[i][-1]], num_computed=computed[i])
                for i, seq in enumerate(seqs)]
    return tokens, logits_SV


def _check_model(comm: ExpertComm, model_dir: str) -> None:
    expert_ids = local_expert_ids(CONFIG.num_experts, comm.rank, comm.world_size)
    weights = load_weights(model_dir, CONFIG, expert_ids)
    model = Qwen3MoeModel(CONFIG, weights, expert_ids=expert_ids, comm=comm,
                          max_fixed_capacity_tokens=MAX_FIXED_TOKENS)
    results = {}
    for setting in ("alltoall", "gather", "auto"):
        comm.plan = _plan(setting, comm.world_size)
        results[setting] = _greedy(model, comm.rank, num_steps=4)
    tokens, logits = results["alltoall"]
    for setting in ("gather", "auto"):
        assert results[setting][0] == tokens, setting
        assert torch.equal(results[setting][1], logits), setting


def _worker(rank: int, world_size: int, init_file: str, model_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        torch.set_num_threads(1)
        comm = ExpertComm(dist.group.WORLD)
        _check_layer(comm)
        _check_model(comm, model_dir)
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_rank()


def test_gather_and_all_to_all_designs_give_the_same_bits_over_two_gloo_ranks(tmp_path):
    model_dir = tmp_path / "model"
    make_random_checkpoint(model_dir, CONFIG, seed=3, with_tokenizer=False)
    torch.multiprocessing.spawn(_worker, args=(2, str(tmp_path / "rendezvous"), str(model_dir)), nprocs=2)

"""What a rank serves with, built from its config: weights, model, expert exchange, KV pool, step runner.

`ModelBuilder.build` runs on the rank's model thread once the rank has its
place in a group: it reads (or, for benchmarks, draws) the weights of the
rank's experts plus the trunk and gates, then joins the group's process
group (the rendezvous, through the `connect` callable of the lifecycle),
learns which ranks share a host and plans the exchange design per step size
(--ep-dispatch, services/model/exchange/cost_model.py), then builds the model
on it, picks the expert exchange of decode steps and sizes the KV pool.
`runner` wraps the model and the pool in the StepRunner that executes the
gateway's plans, with its CUDA graphs. The lifecycle (expert_svc/server.py)
decides when; this module decides what.
"""

import logging
import time
import zlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from expert_svc import placement
from expert_svc.config import ExpertConfig
from expert_svc.constrained import ConstraintMasks
from expert_svc.graph_runner import make_graph_runner
from expert_svc.prefill_graphs import PrefillGraphRunner, make_prefill_graph_runner
from expert_svc.observability import MeteredExpertComm
from expert_svc.rendezvous import RendezvousError
from expert_svc.runner import StepRunner
from expert_svc.spare_slots import auto_spare_slots
from expert_svc.step_profile import StepProfiler
from services import metrics
from services.cluster import GroupAssignment
from services.constraints import Compiler
from services.kv_pool import KVPool, kv_cache_dtype
from services.model.checkpoint import load_weights
from services.model.config import DTYPES
from services.model.exchange.cost_model import LinkCosts, RowShape, Topology
from services.model.exchange.plan import DispatchPlan
from services.model.qwen3_moe import Qwen3MoeModel
from services.model.random_weights import RandomWeights, serving_model_config
from services.tokenizer import Tokenizer

log = logging.getLogger("expert_svc")


class ModelBuilder:
    """Builds the model, KV pool and step runner of one rank from its ExpertConfig."""

    def __init__(self, config: ExpertConfig):
        self.config = config
        self.model_config = serving_model_config(config.model, config.random_weights)
        self.dtype = DTYPES[config.dtype_name]
        self._ready_kv_pool: KVPool | None = None  # allocated ahead by prepare_kv_pool
        self._prefill_graphs: PrefillGraphRunner | None = None  # the last built model's (prefill_graphs)

    def build(self, expert_ids: range, connect: Callable[[], object]) -> tuple[Qwen3MoeModel, KVPool]:
        """Model thread: the weights of expert_ids, then the rendezvous (`connect()` returns
        the group's process group), then the model and the KV pool."""
        cfg, mc = self.config, self.model_config
        if cfg.quant_gemv_variants:  # process-wide knobs, before any kernel launches or graph capture
            from services.model.kernels.quant_variants import use_gemv_variants  # triton: only with the flag
            log.info("quantized GEMV variants on: %s", ", ".join(use_gemv_variants(cfg.quant_gemv_variants)))
        if cfg.random_weights:  # benchmarks: drawn on the device as the model reads them
            weights = RandomWeights.for_preset(cfg.random_weights, mc, expert_ids, cfg.random_weights_seed,
                                               dtype=self.dtype, device=cfg.device)
        else:
            weights = load_weights(cfg.model, mc, expert_ids, dtype=self.dtype, device=cfg.device)
        comm = MeteredExpertComm(connect(), is_timed=not cfg.is_cuda or cfg.debug_collective_timing,
                                 is_cuda=cfg.is_cuda)
        self.plan_dispatch(comm)
        model = Qwen3MoeModel(mc, weights, expert_ids=expert_ids, comm=comm,
                              dtype=self.dtype, device=cfg.device, attention=cfg.attention_backend,
                              max_fixed_capacity_tokens=cfg.max_fixed_capacity_tokens,
                              num_spare_expert_slots=self.spare_slots(weights, expert_ids, comm),
                              quantized_kernel=cfg.quantized_kernel)
        del weights
        if cfg.is_cuda and cfg.ep_exchange != "nccl" and comm.world_size > 1:
            comm.exchange = self.symmetric_exchange(comm, required=cfg.ep_exchange == "symmetric")
        if comm.world_size > 1:
            exchange = "symmetric_memory" if comm.exchange is not None else "collectives"
            for name in ("collectives", "symmetric_memory"):
                metrics.expert_metrics().exchange.labels(name).set(int(name == exchange))
        kv_pool = self.kv_pool()
        self.warm_prompt_attention(model, kv_pool)
        self.capture_prefill_graphs(model)
        self.warm_logits(model)
        return model, kv_pool

    def warm_prompt_attention(self, model: Qwen3MoeModel, kv_pool: KVPool) -> None:
        """Model thread, on CUDA: the attention of whole prompts of up to warm_prompt_tokens
        prepared at every length it runs at (after the KV pool took its share of the memory)."""
        cfg = self.config
        if not cfg.is_cuda or not cfg.warm_prompt_tokens:
            return
        start = time.perf_counter()
        lengths = model.attention.warm_whole_prompts(kv_pool, self.model_config.num_attention_heads, self.dtype,
                                                     cfg.warm_prompt_tokens)
        if lengths:
            log.info("prompt attention prepared at %d lengths (%d..%d tokens) in %.1f s", len(lengths), lengths[0],
                     lengths[-1], time.perf_counter() - start)

    def warm_logits(self, model: Qwen3MoeModel) -> None:
        """Model thread, on CUDA: the LM head run at every row count up to warm_logit_rows, so
        that no step waits, host and device, for CUDA to load the kernel of its sample count."""
        cfg = self.config
        if not cfg.is_cuda or not cfg.warm_logit_rows:
            return
        start = time.perf_counter()
        model.warm_logits(cfg.warm_logit_rows)
        log.info("LM head run at 1..%d rows in %.1f s", cfg.warm_logit_rows, time.perf_counter() - start)

    def plan_dispatch(self, comm) -> None:
        """Sets comm.plan, the group's exchange design per step size, and logs it: a collective
        (the ranks tell each other their hosts and plan settings), right after each rendezvous
        of the group. ValueError if the ranks' settings differ (they would pick other designs
        and their collectives would not match)."""
        cfg, mc = self.config, self.model_config
        if comm.world_size == 1:
            comm.plan = None
            return
        settings = f"{cfg.ep_dispatch}|{cfg.ep_link_costs}|{cfg.max_fixed_capacity_tokens}"
        try:
            hosts, settings_N = gather_keys(comm.group, (cfg.ep_node or cfg.public_host, settings),
                                            torch.device(cfg.device))
        except RuntimeError as error:  # a peer lost since the rendezvous: as a failed rendezvous
            raise RendezvousError(f"the ranks could not exchange their hosts: {error}") from error
        if len(set(settings_N)) > 1:
            ranks = [r for r, key in enumerate(settings_N) if key != settings_N[comm.rank]]
            raise ValueError(f"--ep-dispatch, --ep-link-costs and --max-fixed-capacity-tokens must be the same on "
                             f"every rank of a group: ranks {ranks} differ from rank {comm.rank}'s "
                             f"{cfg.ep_dispatch!r}, {cfg.ep_link_costs!r}, {cfg.max_fixed_capacity_tokens}")
        shape = RowShape(mc.hidden_size, mc.num_experts_per_tok, torch.empty((), dtype=self.dtype).element_size())
        costs = LinkCosts.for_device("cuda" if cfg.is_cuda else "cpu", cfg.ep_link_costs)
        comm.plan = DispatchPlan(cfg.ep_dispatch, Topology(hosts), shape, costs, cfg.max_fixed_capacity_tokens)
        log.info("expert exchange design: %s", comm.plan.describe())

    def prepare_kv_pool(self) -> None:
        """Model thread, before any assignment: allocates the KV pool now where its size does
        not depend on what the weights leave free (the CPU, or a fixed kv_blocks), so that a
        standby taking a failed rank's place does not allocate (and fault in) it on the
        recovery path; the next build uses it."""
        if self._ready_kv_pool is None and (not self.config.is_cuda or self.config.kv_blocks):
            self._ready_kv_pool = self.kv_pool()

    def kv_pool(self) -> KVPool:
        """The KV pool: the one prepared ahead (once), else kv_blocks blocks, or as many as the KV memory holds."""
        if self._ready_kv_pool is not None:
            pool, self._ready_kv_pool = self._ready_kv_pool, None
            return pool
        cfg, mc = self.config, self.model_config
        cache_dtype = kv_cache_dtype(cfg.kv_cache_dtype, self.dtype)
        num_blocks = cfg.kv_blocks or KVPool.blocks_for_memory(
            mc, cfg.kv_block_size, self.kv_memory_bytes(), cache_dtype)
        if num_blocks <= 0:
            raise ValueError(f"the KV memory ({self.kv_memory_bytes()} bytes) holds no block; "
                             f"raise kv_memory_bytes/kv_memory_fraction or set kv_blocks")
        return KVPool.for_model(mc, num_blocks, cfg.kv_block_size, cache_dtype, cfg.device)

    def symmetric_exchange(self, comm, *, required: bool):
        """kernels/moe_ep.py's buffers in symmetric memory for the steps of up to the decode steps'
        tokens per rank, or None (NCCL) unless every rank set them up: a collective, and the
        ranks agree (one all_reduce), so they all take the same path. Raises if `required`."""
        from services.model.exchange.symmetric import SymmetricExchange  # triton: CUDA only
        from services.model.kernels.moe_ep import row_width

        cfg, mc = self.config, self.model_config
        exchange, error = None, None
        try:
            exchange = SymmetricExchange(
                comm.group, max(cfg.max_fixed_capacity_tokens, cfg.cuda_graph_max_batch),
                row_width(mc.hidden_size, mc.num_experts_per_tok, self.dtype), mc.hidden_size, self.dtype,
                cfg.device, timeout_ms=int(cfg.collective_timeout_s * 1000),
                push=cfg.ep_exchange_push or cfg.ep_exchange_signals, signals=cfg.ep_exchange_signals)
        except Exception as caught:  # noqa: BLE001 (a machine without it: the ranks fall back together)
            error = caught
        everyone = -comm.max_over_ranks(-int(exchange is not None), torch.device(cfg.device)) == 1
        if everyone:
            log.info("expert exchange of decode steps: symmetric memory")
            return exchange
        reason = f"here: {error!r}" if error is not None else "on another rank"
        if required:
            raise RuntimeError(f"--ep-exchange symmetric: symmetric memory could not be set up ({reason})")
        log.warning("expert exchange: NCCL (symmetric memory could not be set up %s)", reason)
        return None

    def spare_slots(self, weights, expert_ids: range, comm) -> int:
        """The spare expert slots per MoE layer: the explicit count, or `auto` sized from the
        KV budget the weights leave (expert_svc/spare_slots.py); on CUDA the minimum over the
        group's ranks (a collective: every rank builds at once there), logged either way."""
        cfg, mc = self.config, self.model_config
        if cfg.fixed_spare_slots is not None:
            return cfg.fixed_spare_slots
        if cfg.is_cuda:  # weights still to be drawn (random ones are drawn as the model reads them)
            pending = weights.num_bytes() if isinstance(weights, RandomWeights) else 0
            free_bytes, _ = torch.cuda.mem_get_info(torch.device(cfg.device))
            budget = int(max(0, free_bytes - pending) * cfg.kv_memory_fraction)
        else:
            budget = cfg.kv_memory_bytes
        chosen = auto_spare_slots(num_experts=mc.num_experts, num_ranks=comm.world_size, kv_budget_bytes=budget,
                                  slot_bytes=self.slot_bytes(weights, expert_ids))
        num_slots = chosen.num_slots
        if cfg.is_cuda and comm.world_size > 1:
            num_slots = -comm.max_over_ranks(-num_slots, torch.device(cfg.device))
        agreed = "" if num_slots == chosen.num_slots else f"; {num_slots}, the least of the group's ranks"
        log.info("--num-spare-expert-slots auto: %d spare slots per MoE layer: %s%s", num_slots, chosen.reason,
                 agreed)
        return num_slots

    def slot_bytes(self, weights, expert_ids: range) -> int:
        """What one spare slot takes: one expert's projections in every MoE layer, as served
        (the compute dtype, or a quantized checkpoint's stored layout)."""
        mc = self.model_config
        prefix = f"model.layers.{mc.moe_layers[0]}.mlp.experts.{expert_ids.start}."
        item = torch.empty((), dtype=self.dtype).element_size()
        total = 0
        for proj in ("gate_proj", "up_proj", "down_proj"):
            w = weights[prefix + proj + ".weight"]
            total += (w.numel() * item if isinstance(w, torch.Tensor)
                      else sum(t.numel() * t.element_size() for t in w.tensors.values()))
        return total * len(mc.moe_layers)

    def kv_memory_bytes(self) -> int:
        """Bytes for the KV pool: kv_memory_bytes on the CPU, a fraction of the free memory on CUDA."""
        if not self.config.is_cuda:
            return self.config.kv_memory_bytes
        free_bytes, _ = torch.cuda.mem_get_info(torch.device(self.config.device))
        return int(free_bytes * self.config.kv_memory_fraction)

    def runner(self, model: Qwen3MoeModel, kv_pool: KVPool, group: GroupAssignment) -> StepRunner:
        """The StepRunner of a built model in `group`'s epoch, with its decode CUDA graphs
        (none when timing collectives: a replayed graph runs no Python to time)."""
        cfg = self.config
        graphs = make_graph_runner(model, kv_pool, cfg.kv_block_size, () if cfg.debug_collective_timing
                                   else cfg.cuda_graph_bucket_sizes, cfg.cuda_graph_max_context,
                                   cfg.cuda_graph_max_seq_tokens)
        runner = StepRunner(model, kv_pool, cfg.kv_block_size, vocab_size=self.model_config.vocab_size,
                            group_id=group.group_id, placement_epoch=group.epoch, device=cfg.device, graphs=graphs,
                            constraints=ConstraintMasks(self.constraint_compiler),
                            prefill_graphs=self.prefill_graphs(model))
        if cfg.profile_prefill_steps:
            runner.profiler = StepProfiler(cfg.profile_file, cfg.profile_prefill_steps, cfg.profile_skip_steps,
                                           torch.device(cfg.device))
            log.info("profiling %d steps with prompt tokens after %d steps into %s", cfg.profile_prefill_steps,
                     cfg.profile_skip_steps, cfg.profile_file)
        return runner

    def capture_prefill_graphs(self, model: Qwen3MoeModel) -> None:
        """Model thread, after the KV pool took its share of the memory: the piecewise graphs of
        steps with prompt tokens (prefill_graph_tokens; none while timing collectives), for
        this model's runners."""
        cfg = self.config
        self._prefill_graphs = None
        if cfg.prefill_graph_tokens and not cfg.debug_collective_timing:
            self._prefill_graphs = make_prefill_graph_runner(model, cfg.prefill_graph_tokens,
                                                             cfg.prefill_graph_lengths_per_octave)

    def prefill_graphs(self, model: Qwen3MoeModel) -> PrefillGraphRunner | None:
        """The prefill graphs captured for `model` by its build, None if none were."""
        graphs = self._prefill_graphs
        return graphs if graphs is not None and graphs.model is model else None

    def constraint_compiler(self) -> Compiler:
        """The compiler of constraints for the served tokenizer and logits width (built on
        the first constrained sequence)."""
        cfg = self.config
        tokenizer = Tokenizer.from_model_dir(cfg.model) if cfg.model else Tokenizer.qwen3()
        return Compiler.for_tokenizer(tokenizer, self.model_config.vocab_size)

    def expert_loader(self) -> placement.LoadExperts:
        """Where replicas of experts are read from: the same source as the primaries."""
        return placement.expert_loader(self.config, self.model_config, self.dtype)


def gather_keys(group, texts: tuple[str, ...], device: torch.device) -> tuple[tuple[str, ...], ...]:
    """Per text of this rank, every rank's key of it in rank order (a CRC-32, as hex): one all_gather."""
    mine = torch.tensor([zlib.crc32(text.encode()) for text in texts], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    keys_NX = torch.stack(every).tolist()
    return tuple(tuple(f"{keys[i]:08x}" for keys in keys_NX) for i in range(len(texts)))

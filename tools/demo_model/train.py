"""Trains moemesh's demo model, a small Qwen3-MoE, within a wall-clock budget.

    python -m tools.demo_model.train --corpus .demo_corpus --out RUN_DIR --minutes 5 [--pack-to DIR]

Reads `CORPUS/prepared` (made by prepare.py, here if missing), trains with
AdamW, a warmup + cosine schedule, bf16 autocast on CUDA and the Switch
load-balancing loss, then writes RUN_DIR/checkpoint (hub layout, see
export.py), RUN_DIR/loss.csv, RUN_DIR/expert_hits.json and RUN_DIR/run.json.
`--minutes` bounds the whole run, start-up and saving included: the number of
steps is fixed after timing the first ones (or given with --steps), and
training also stops at the deadline. `--tiny` is a small shape for CPU smoke tests.
Uses only torch APIs of 2.11 and older.
"""

import argparse
import csv
import json
import math
import pathlib
import sys
import time

import torch
import torch.nn.functional as F

from tools.demo_model import export
from tools.demo_model.data import PREPARED, PROMPTS_FILE, fixed_windows, load_prepared, sample_windows
from tools.demo_model.model import DemoMoE, expert_counts, load_balancing_loss
from services.model.config import ModelConfig

CALIBRATION = (3, 20)  # time steps 3..20 (after the first, slow ones) to fix the step count
CSV_FIELDS = ("step", "tokens", "elapsed_s", "lr", "train_loss", "aux_loss", "val_loss", "hits_max_over_mean")


def demo_config(vocab_size: int, tiny: bool) -> ModelConfig:
    """The demo shape (about 9.8 M parameters, 19.6 MB in bf16) or the tiny smoke-test one."""
    special_eos = (2, 0)  # <|im_end|>, <|endoftext|> of prepare.py's vocabulary
    if tiny:
        return ModelConfig(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                           num_experts=8, num_experts_per_tok=2, rope_theta=10_000.0, max_position_embeddings=128,
                           tie_word_embeddings=True, dtype=torch.float32, eos_token_ids=special_eos)
    return ModelConfig(vocab_size=vocab_size, hidden_size=256, num_hidden_layers=6, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64, intermediate_size=768, moe_intermediate_size=88,
                       num_experts=16, num_experts_per_tok=4, rope_theta=10_000.0, max_position_embeddings=1024,
                       tie_word_embeddings=True, dtype=torch.bfloat16, eos_token_ids=special_eos)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=pathlib.Path, default=pathlib.Path(".demo_corpus"))
    parser.add_argument("--out", type=pathlib.Path, required=True, help="run directory")
    parser.add_argument("--minutes", type=float, required=True, help="wall-clock budget of the whole run")
    parser.add_argument("--tiny", action="store_true", help="tiny shape and batches, for CPU smoke tests")
    parser.add_argument("--steps", type=int, help="fixed number of steps (default: as many as the budget allows)")
    parser.add_argument("--max-epochs", type=float, default=20.0, help="cap on passes over the train tokens")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup-steps", type=int)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--aux-loss-coef", type=float, default=0.01)
    parser.add_argument("--vocab-size", type=int, default=8192, help="only used when preparing the corpus here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--pack-to", type=pathlib.Path, help="also pack the run into <= 8 files here (pack.py)")
    args = parser.parse_args(argv)
    defaults = (8, 64, 5) if args.tiny else (32, 1024, 100)
    for name, value in zip(("batch_size", "seq_len", "warmup_steps"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.minutes <= 0:
        raise ValueError(f"--minutes must be positive, got {args.minutes}")
    return args


def lr_at(step: int, total_steps: int | None, args: argparse.Namespace) -> float:
    """Linear warmup, then cosine down to a tenth of the peak at total_steps."""
    if step < args.warmup_steps or total_steps is None:
        return args.lr * min(1.0, (step + 1) / args.warmup_steps)
    progress = min(1.0, (step - args.warmup_steps) / max(1, total_steps - args.warmup_steps))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: DemoMoE, args: argparse.Namespace) -> torch.optim.AdamW:
    """AdamW; no weight decay on the norms."""
    decay = [p for n, p in model.named_parameters() if not n.endswith("norm.weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def losses(model: DemoMoE, ids_BT, targets_BT, device_type: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cross-entropy, mean load-balancing loss over layers, and the layers' expert counts [L, E]."""
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=device_type == "cuda"):
        logits_BTV, probs, ids = model(ids_BT)
    ce = F.cross_entropy(logits_BTV.float().flatten(0, 1), targets_BT.flatten())
    aux = torch.stack([load_balancing_loss(p, i) for p, i in zip(probs, ids)]).mean()
    counts_LE = torch.stack([expert_counts(i, model.config.num_experts) for i in ids])
    return ce, aux, counts_LE


@torch.no_grad()
def validation_loss(model: DemoMoE, windows, device_type: str) -> float:
    model.eval()
    ids_BT = torch.stack([w[0] for w in windows])
    targets_BT = torch.stack([w[1] for w in windows])
    ce, _, _ = losses(model, ids_BT, targets_BT, device_type)
    model.train()
    return float(ce)


class Budget:
    """The run's deadline, the time kept for everything after training, and the step count
    that fits: fixed once steps CALIBRATION[0]..CALIBRATION[1] have been timed."""

    def __init__(self, minutes: float, start: float, device: torch.device):
        self.total_s = minutes * 60
        self.reserve_s = min(45.0, max(5.0, 0.12 * self.total_s))
        self.deadline = start + self.total_s
        self.train_deadline = self.deadline - self.reserve_s
        self.device, self._calibration_start = device, 0.0

    def is_spent(self) -> bool:
        return time.monotonic() > self.train_deadline

    def steps_that_fit(self, done: int) -> int | None:
        """After step `done`: the total number of steps once calibrated, else None."""
        if done not in CALIBRATION:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        now = time.monotonic()
        if done == CALIBRATION[0]:
            self._calibration_start = now
            return None
        step_s = (now - self._calibration_start) / (CALIBRATION[1] - CALIBRATION[0])
        total = done + max(0, int((self.train_deadline - now) / step_s * 0.95))  # evals and logging
        print(f"{step_s * 1e3:.1f} ms/step: {total} steps fit the budget", flush=True)
        return total


class LossLog:
    """loss.csv: every 10 steps, the mean losses and routing skew since the last row."""

    def __init__(self, path: pathlib.Path, config: ModelConfig, tokens_per_step: int, device: torch.device):
        self._file = path.open("w", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=CSV_FIELDS)
        self._writer.writeheader()
        self.tokens_per_step, self.start = tokens_per_step, time.monotonic()
        self._sums = torch.zeros(2, device=device)
        self._counts_LE = torch.zeros(config.num_hidden_layers, config.num_experts, device=device, dtype=torch.int64)
        self._num_steps = 0

    def add(self, ce: torch.Tensor, aux: torch.Tensor, counts_LE: torch.Tensor) -> None:
        """One step's values, kept on the device (no sync)."""
        self._sums += torch.stack([ce.detach(), aux.detach()])
        self._counts_LE += counts_LE
        self._num_steps += 1

    def write(self, step: int, lr: float, val_loss: float | None) -> dict:
        counts = self._counts_LE.float()
        ce, aux = (self._sums / self._num_steps).tolist()
        row = {"step": step, "tokens": step * self.tokens_per_step,
               "elapsed_s": round(time.monotonic() - self.start, 2), "lr": f"{lr:.3e}",
               "train_loss": round(ce, 4), "aux_loss": round(aux, 4),
               "val_loss": "" if val_loss is None else round(val_loss, 4),
               "hits_max_over_mean": round(float((counts.max(dim=1).values / counts.mean(dim=1)).mean()), 3)}
        self._writer.writerow(row)
        self._file.flush()
        self._sums.zero_()
        self._counts_LE.zero_()
        self._num_steps = 0
        return row

    def close(self) -> None:
        self._file.close()


def train(args: argparse.Namespace) -> dict:
    """Runs training; returns the run summary (with the model) for finish()."""
    device = torch.device(args.device)
    budget = Budget(args.minutes, time.monotonic(), device)
    torch.manual_seed(args.seed)
    if device.type == "cpu":
        torch.set_num_threads(1)  # the CPU runs are smoke tests: small ops, where threads only cost
    prepared = args.corpus / PREPARED
    if not (prepared / PROMPTS_FILE).is_file():
        from tools.demo_model.prepare import prepare  # needs the tokenizers library

        prepare(args.corpus, args.vocab_size)
    meta, train_N, val_N = load_prepared(prepared, device)
    config = demo_config(meta["vocab_size"], args.tiny)
    model = DemoMoE(config)
    model.init_weights(torch.Generator().manual_seed(args.seed))
    model.to(device).train()
    num_params = sum(p.numel() for p in model.parameters())
    print(f"model {num_params / 1e6:.2f} M parameters, {train_N.numel():,} train tokens, device {device}", flush=True)
    optimizer = make_optimizer(model, args)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    val_windows = fixed_windows(val_N, 4 if args.tiny else 32, args.seq_len)
    tokens_per_step = args.batch_size * args.seq_len
    max_steps = max(1, int(args.max_epochs * train_N.numel() / tokens_per_step))
    total_steps = min(args.steps, max_steps) if args.steps else None
    eval_every = 50 if args.tiny else 250
    args.out.mkdir(parents=True, exist_ok=True)
    log = LossLog(args.out / "loss.csv", config, tokens_per_step, device)
    step = 0
    while total_steps is None or step < total_steps:
        if budget.is_spent():
            print(f"stopping at step {step}: the time budget is spent", flush=True)
            break
        lr = lr_at(step, total_steps, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        ce, aux, counts_LE = losses(model, *sample_windows(train_N, args.batch_size, args.seq_len, generator),
                                    device.type)
        optimizer.zero_grad(set_to_none=True)
        (ce + args.aux_loss_coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        log.add(ce, aux, counts_LE)
        step += 1
        if total_steps is None and (fit := budget.steps_that_fit(step)) is not None:
            total_steps = min(max_steps, fit)
            print(f"training {total_steps} steps ({total_steps * tokens_per_step / train_N.numel():.1f} epochs)",
                  flush=True)
        is_last = total_steps is not None and step >= total_steps
        if step % 10 == 0 or is_last:
            val = validation_loss(model, val_windows, device.type) if step % eval_every == 0 or is_last else None
            row = log.write(step, lr, val)
            if step % 100 == 0 or is_last:
                print(" ".join(f"{k}={v}" for k, v in row.items() if v != ""), flush=True)
    log.close()
    return {"steps": step, "total_steps": total_steps, "tokens_per_step": tokens_per_step,
            "train_seconds": round(time.monotonic() - log.start, 1), "num_parameters": num_params,
            "final_val_loss": validation_loss(model, val_windows, device.type), "model": model,
            "config": config, "meta": meta, "deadline": budget.deadline}


def finish(args: argparse.Namespace, result: dict) -> None:
    """Saves the checkpoint, then measures hits and samples on the saved weights."""
    model, config, deadline = result.pop("model"), result.pop("config"), result.pop("deadline")
    prepared = args.corpus / PREPARED
    ckpt = args.out / "checkpoint"
    export.save_checkpoint(model, ckpt, prepared / "tokenizer.json", args.aux_loss_coef)
    saved = export.load_checkpoint_fp32(ckpt, args.device)
    prompts = json.loads((prepared / PROMPTS_FILE).read_text())
    hits = export.expert_hits(saved, prompts)
    (args.out / "expert_hits.json").write_text(json.dumps(hits, indent=1) + "\n")
    samples = export.greedy_samples(saved, prompts, config.eos_token_ids, 8 if args.tiny else 48,
                                    deadline=deadline - 5)  # 5 s for run.json and packing
    export.decode_samples(samples, prepared / "tokenizer.json")
    run = {"args": {k: str(v) for k, v in vars(args).items()}, **result,
           "config": config.to_hub_dict(), "torch": torch.__version__,
           "max_over_mean_per_layer": [layer["max_over_mean"] for layer in hits["layers"]], "samples": samples}
    (args.out / "run.json").write_text(json.dumps(run, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    result = train(args)
    try:
        finish(args, result)
    finally:
        if args.pack_to and (args.out / "checkpoint" / "config.json").is_file():
            from tools.demo_model.pack import pack

            pack(args.out, args.pack_to)
    print(f"done in {time.monotonic() - started:.1f} s of a {args.minutes * 60:.0f} s budget; "
          f"final validation loss {result['final_val_loss']:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Host time of constrained rows per step, on the CPU: where a masked decode step's time goes.

    PYTHONPATH=$PWD:$PWD/protos python -m bench.constraints.host_profile [--rows 1 64] [--repeats 3]

The real Qwen3 tokenizer (services.tokenizer) and the ticket schema of issue 26
(bench/constraints/engines.py), `--rows` matchers in lockstep over its valid answer then EOS,
each step timed part by part as the rank runs them (expert_svc/constrained.py and
StepRunner.finish): the accepts of the tokens sampled last step, forced_token_ids, the parallel
mask fill, the matcher copies, then the finish's work per copy (accept, forced tokens). Then the
whole ConstraintMasks.mask call's host work (the apply left out) for sequences with jump-forward
on and off, and apart, the bitmask's apply to [rows, vocab] float32 logits on the CPU (on a GPU
an upload and a few queued kernels). Milliseconds per step, the median of --repeats walks.
"""

import argparse
import statistics
import time

import numpy as np
import torch

from bench.constraints.engines import CASES, VOCAB
from expert_svc import constrained
from expert_svc.constrained import ConstraintMasks
from services.constraints import Compiler, fill_masks
from services.model.constraint_mask import apply_token_bitmask_
from services.step import Constraint, NewSequence, SamplingSpec
from services.tokenizer import Tokenizer

PARTS = ("accept", "forced_token_ids", "fill_masks", "copy", "finish: accept+forced")


def _walk_parts(compiler: Compiler, constraint: Constraint, token_ids: list[int], num_rows: int) -> dict:
    """Milliseconds per step of each part, over one walk."""
    matchers = [compiler.matcher(constraint) for _ in range(num_rows)]
    totals = dict.fromkeys(PARTS, 0.0)
    for i, token_id in enumerate(token_ids):
        marks = [time.perf_counter()]
        if i:
            assert all(m.accept(token_ids[i - 1]) for m in matchers)
        marks.append(time.perf_counter())
        _ = [m.forced_token_ids() for m in matchers]
        marks.append(time.perf_counter())
        bitmask_CW = np.zeros((num_rows, compiler.mask_words), dtype=np.int32)
        fill_masks(bitmask_CW, matchers)
        marks.append(time.perf_counter())
        copies = [m.copy() for m in matchers]
        marks.append(time.perf_counter())
        for copy in copies:
            if copy.accept(token_id):
                copy.forced_token_ids()
        marks.append(time.perf_counter())
        for part, start, end in zip(PARTS, marks, marks[1:]):
            totals[part] += end - start
    return {part: 1e3 * total / len(token_ids) for part, total in totals.items()}


def _apply_ms(compiler: Compiler, num_rows: int, repeats: int = 5) -> float:
    """Milliseconds of one apply_token_bitmask_ to [rows, vocab] float32 logits on the CPU."""
    logits_CV, bitmask_CW = torch.zeros(num_rows, VOCAB), np.zeros((num_rows, compiler.mask_words), dtype=np.int32)
    start = time.perf_counter()
    for _ in range(repeats):
        apply_token_bitmask_(logits_CV, bitmask_CW, range(num_rows))
    return 1e3 * (time.perf_counter() - start) / repeats


def _walk_mask(masks: ConstraintMasks, new: NewSequence, token_ids: list[int], num_rows: int) -> float:
    """Milliseconds per step of ConstraintMasks.mask's host work (accepts, forced tokens, masks,
    copies; the apply left out: on a GPU it is an upload and kernels, queued), over one walk."""
    matchers = [masks.matcher(new) for _ in range(num_rows)]
    logits_CV = torch.zeros(num_rows, VOCAB)
    constrained.apply_token_bitmask_ = lambda logits_SV, bitmask_CW, rows: logits_SV
    total = 0.0
    for i in range(len(token_ids)):
        unaccepted = [None] * num_rows if not i else [(torch.tensor([token_ids[i - 1]]), 0, None)] * num_rows
        start = time.perf_counter()
        masks.mask(logits_CV, None, range(num_rows), matchers, unaccepted,
                   is_jump_forward=[new.is_jump_forward] * num_rows)
        total += time.perf_counter() - start
    return 1e3 * total / len(token_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tok = Tokenizer.qwen3()
    compiler = Compiler.for_tokenizer(tok, VOCAB)
    _, kind, text, answer = CASES[0]
    constraint = Constraint(kind, text)
    token_ids = tok.encode(answer) + [tok.eos_token_ids[0]]
    masks = ConstraintMasks(lambda: compiler)
    print(f"ticket schema, {len(token_ids)} steps a walk; ms per step, median of {args.repeats} walks")
    print("| rows | " + " | ".join(PARTS) + " | mask() host, jump-forward on | mask() host, off | CPU apply |")
    print("|---" * (len(PARTS) + 4) + "|")
    for num_rows in args.rows:
        walks = [_walk_parts(compiler, constraint, token_ids, num_rows) for _ in range(args.repeats)]
        cells = [statistics.median(w[part] for w in walks) for part in PARTS]
        for is_jump_forward in (True, False):
            new = NewSequence(0, SamplingSpec(), (), constraint=constraint, is_jump_forward=is_jump_forward)
            cells.append(statistics.median(_walk_mask(masks, new, token_ids, num_rows) for _ in range(args.repeats)))
        cells.append(_apply_ms(compiler, num_rows))
        print(f"| {num_rows} | " + " | ".join(f"{cell:.3f}" for cell in cells) + " |")


if __name__ == "__main__":
    main()

"""Log-probabilities on a rank: which rows of a step's logits are scored, on the device, and
what they report once read back with the step's tokens.

A sequence that asked (NewSequence.logprobs) is scored from the logits the step produces
anyway, before sampling touches them: each scored row is log-softmaxed in fp32 (a copy, so
the constraint mask that follows does not reach it; services/model/logprobs.py), then, once
the tokens are sampled, gathered at the scored token and its top-k taken. Steps in which no
scheduled sequence asked do none of this: the runner keeps no `StepScores` for them.

Sampled tokens: the row that samples the sequence, scored at the token drawn. Prompt
tokens (prompt_logprobs): the forward returns a row for every token of the sequence's
prompt chunk (SeqInput.is_scored); row j scores chunk token j + 1. The chunk's last row
predicts the first token of the next chunk, which the rank does not know yet: that row's
log-softmax is kept on the sequence (`SeqScoring.pending`) and scores the next chunk's
first token, or, after the prompt's last chunk, is the sampled token's row. Legend: S
logit rows, X rows log-softmaxed this step, M those and the kept rows of earlier chunks,
N scored tokens, V vocab, K most likely tokens listed.
"""

import dataclasses

import torch
from torch import Tensor

from services.model.batch import to_device
from services.model.logprobs import log_softmax_rows, token_logprobs
from services.step import LogprobSpec, ScheduledSequence, TokenLogprob


@dataclasses.dataclass(slots=True)
class SeqScoring:
    """What a sequence reports and, between its prompt chunks, the row kept for the next one."""

    spec: LogprobSpec
    # (position it predicts, the log-softmax [V] of the previous chunk's last row).
    pending: tuple[int, Tensor] | None = None


def is_scored_chunk(sched: ScheduledSequence, scoring: SeqScoring | None) -> bool:
    """True if every row of the sequence's input this step is scored (a prompt chunk with prompt_logprobs)."""
    return scoring is not None and scoring.spec.prompt_logprobs and bool(sched.token_ids)


class StepScores:
    """One step's scored tokens: `prepare`d before sampling, `launch`ed after it, read by `results`.

    `sample_rows`: the logit row of each sampled sequence (plan order), when the eager
    forward returned prompt rows besides them (`sampling_logits`); None when logits_SV's
    rows are those already.
    """

    def __init__(self) -> None:
        self.sample_rows: list[int] | None = None
        # (seq_id, position, K of the sequence) of each scored token, in result order.
        self._entries: list[tuple[int, int, int]] = []
        self._rows_N: list[int] = []          # row of M of each entry
        self._targets_N: list[int] = []       # the scored token, or -1: the one sampled in row
        self._sampled: list[tuple[int, int]] = []  # (entry, row of the step's token_ids_S)
        self._logprobs_MV: Tensor | None = None

    @classmethod
    def prepare(cls, logits_SV: Tensor, scheduled, seqs, is_graph: bool) -> "StepScores | None":
        """Log-softmaxes the step's scored rows (seqs[i]: the runner's state of scheduled[i], with
        `scoring` and `num_computed` before this step); None if no scheduled sequence asked."""
        if not any(seq.scoring is not None for seq in seqs):
            return None
        scores, rows_X, kept, sample_rows, row = cls(), [], [], [], 0
        pending_rows: list[Tensor] = []
        for i, (sched, seq) in enumerate(zip(scheduled, seqs)):
            n, scoring = len(sched.token_ids) or 1, seq.scoring
            is_all = is_scored_chunk(sched, scoring)
            first, num_rows = (i, 1) if is_graph else (row, n if is_all else int(sched.is_sampled))
            row += num_rows
            last = first + num_rows - 1
            token_row = None
            if sched.is_sampled:
                sample_rows.append(last)
                token_row = i if is_graph else len(sample_rows) - 1
            if scoring is None:
                continue
            top, p0 = scoring.spec.top_logprobs, seq.num_computed
            if is_all:
                if scoring.pending is not None and scoring.pending[0] == p0:
                    scores._add(sched.seq_id, p0, top, -1 - len(pending_rows), sched.token_ids[0])
                    pending_rows.append(scoring.pending[1])
                scoring.pending = None
                for j in range(n - 1):
                    scores._add(sched.seq_id, p0 + j + 1, top, len(rows_X), sched.token_ids[j + 1])
                    rows_X.append(first + j)
            if sched.is_sampled and scoring.spec.logprobs:
                scores._sampled.append((len(scores._entries), token_row))
                scores._add(sched.seq_id, p0 + n, top, len(rows_X), -1)
                rows_X.append(last)
            elif is_all and not sched.is_sampled:
                kept.append((scoring, p0 + n, len(rows_X)))
                rows_X.append(last)
        if not is_graph and len(sample_rows) != logits_SV.shape[0]:
            scores.sample_rows = sample_rows
        parts = [torch.stack(pending_rows)] if pending_rows else []
        if rows_X:
            logprobs_XV = log_softmax_rows(logits_SV, _upload(rows_X, logits_SV.device))
            for scoring, position, x in kept:  # a copy: the step's rows are not kept alive for one
                scoring.pending = (position, logprobs_XV[x].clone())
            parts.insert(0, logprobs_XV)
        if parts:  # the kept rows of earlier chunks after this step's
            scores._rows_N = [r if r >= 0 else len(rows_X) - 1 - r for r in scores._rows_N]
            scores._logprobs_MV = torch.cat(parts) if len(parts) > 1 else parts[0]
        return scores

    def sampling_logits(self, logits_SV: Tensor) -> Tensor:
        """The rows of logits_SV that the step samples from: without the prompt rows of scored chunks."""
        if self.sample_rows is None:
            return logits_SV
        return logits_SV.index_select(0, _upload(self.sample_rows, logits_SV.device))

    def _add(self, seq_id: int, position: int, top: int, row: int, target: int) -> None:
        self._entries.append((seq_id, position, top))
        self._rows_N.append(row)
        self._targets_N.append(target)

    def launch(self, token_ids_S: Tensor | None) -> list[Tensor]:
        """Gathers the scored tokens' log-probabilities and the top-k (the sampled ones' from
        token_ids_S, on the device): the tensors to read back with the step's tokens."""
        if not self._entries:
            return []
        device = self._logprobs_MV.device
        targets_N = _upload([max(t, 0) for t in self._targets_N], device)
        if self._sampled:
            entries, token_rows = zip(*self._sampled)
            targets_N = targets_N.index_copy(0, _upload(list(entries), device),
                                             token_ids_S.index_select(0, _upload(list(token_rows), device)))
        logprobs_NV = self._logprobs_MV
        if self._rows_N != list(range(logprobs_NV.shape[0])):
            logprobs_NV = logprobs_NV.index_select(0, _upload(self._rows_N, device))
        self._logprobs_MV = None
        num_top = max(top for _, _, top in self._entries)
        return list(token_logprobs(logprobs_NV, targets_N, num_top))

    def results(self, host: list[list], token_ids: list[int]) -> tuple[tuple[int, int, TokenLogprob], ...]:
        """(seq_id, position, TokenLogprob) of each scored token, from `launch`'s tensors read back
        as lists, and the step's sampled tokens (token_ids_S read back)."""
        if not self._entries:
            return ()
        logprob_N, top_logprobs_NK, top_ids_NK = host
        ids_N = list(self._targets_N)
        for entry, token_row in self._sampled:
            ids_N[entry] = token_ids[token_row]
        return tuple(
            (seq_id, position, TokenLogprob(ids_N[i], logprob_N[i],
                                            tuple(zip(top_ids_NK[i][:top], top_logprobs_NK[i][:top]))))
            for i, (seq_id, position, top) in enumerate(self._entries))


def _upload(values: list[int], device: torch.device) -> Tensor:
    return to_device(torch.tensor(values, dtype=torch.int64), device)

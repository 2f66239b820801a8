"""Log-probabilities of tokens from the raw logits: the scored token's and the most likely ones.

What clients are told a token's log-probability is (gateway.proto's SamplingParams.logprobs):
the log-softmax of the model's raw logits in fp32, before temperature, top-p, top-k and any
constraint's mask, as vLLM and OpenAI report them by default. Nothing here reads the device
back: the caller copies the results to the host with the step's sampled tokens.
Legend: N scored rows, V vocab, K most likely tokens listed.
"""

import torch
from torch import Tensor


def token_logprobs(logprobs_NV: Tensor, token_ids_N: Tensor, num_top: int) -> tuple[Tensor, Tensor, Tensor]:
    """(logprob_N of token_ids_N[i] in row i, top_logprobs_NK, top_ids_NK) of log-softmaxed rows,
    the top K per row ordered by log-probability, descending (K = num_top, may be 0)."""
    if token_ids_N.shape != logprobs_NV.shape[:1]:
        raise ValueError(f"{logprobs_NV.shape[0]} rows and {tuple(token_ids_N.shape)} token ids")
    logprob_N = logprobs_NV.gather(1, token_ids_N[:, None].to(torch.int64))[:, 0]
    if not num_top:
        empty_N0 = logprobs_NV.new_empty((logprobs_NV.shape[0], 0))
        return logprob_N, empty_N0, empty_N0.to(torch.int64)
    top_logprobs_NK, top_ids_NK = logprobs_NV.topk(num_top, dim=-1, sorted=True)
    return logprob_N, top_logprobs_NK, top_ids_NK


def log_softmax_rows(logits_SV: Tensor, rows_N: Tensor) -> Tensor:
    """The fp32 log-softmax of logits_SV's rows rows_N: a new tensor, so a mask applied to
    logits_SV afterwards (a constrained sequence's) does not reach it."""
    return torch.log_softmax(logits_SV.index_select(0, rows_N).float(), dim=-1)

"""Fixtures of the expert service tests: a small-vocabulary tiny model and its
transformers twin; step plans as a stream."""

import dataclasses

import pytest
import torch

from services.model.make_model import PRESETS, make_random_checkpoint

# The tiny preset with a 512-token vocabulary: the runner works on token ids only.
SMALL = dataclasses.replace(PRESETS["tiny"], vocab_size=512, eos_token_ids=())


async def plan_stream(*plans):
    """The plans as an async iterator, as StepExecutor.run reads them."""
    for plan in plans:
        yield plan


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("small-vocab")
    make_random_checkpoint(path, SMALL, seed=11, with_tokenizer=False)
    return path


@pytest.fixture(scope="session")
def hf_small(small_model_dir):
    from transformers import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM.from_pretrained(small_model_dir, dtype=torch.float32, attn_implementation="eager",
                                               experts_implementation="eager").eval()

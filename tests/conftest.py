"""Shared fixtures: a private cache dir, the tiny test model, one running mesh.

The mesh is started once per test session and shared by every end-to-end
test that can share it (starting one costs several seconds on 2 cores).
"""

import os
import pathlib
import tempfile

# Before anything imports moemesh.launcher: keep the tests' built tokenizer,
# models and mesh state out of the user's ~/.cache.
os.environ.setdefault("MOEMESH_CACHE_DIR", tempfile.mkdtemp(prefix="moemesh-test-cache-"))
# Role processes the tests start themselves bind a free metrics port, not 9090.
os.environ.setdefault("MOEMESH_METRICS_PORT", "0")
# ... and a free port for the gateway's OpenAI-compatible endpoint, not 8000.
os.environ.setdefault("MOEMESH_HTTP_PORT", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

# One intra-op thread, as the expert services run on the CPU: the test
# machines have 2 cores, and torch's default thread pool makes small ops slower.
torch.set_num_threads(1)

TEST_MODEL_SEED = 1234


@pytest.fixture(scope="session")
def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ["MOEMESH_CACHE_DIR"])


@pytest.fixture(scope="session")
def tiny_model_dir(cache_dir) -> pathlib.Path:
    """The tiny preset with the real Qwen vocabulary and tokenizer files."""
    from services.model import make_model

    path = cache_dir / "models" / f"tiny-seed{TEST_MODEL_SEED}"
    if not (path / "config.json").is_file():
        make_model.make_random_checkpoint(path, make_model.PRESETS["tiny"], seed=TEST_MODEL_SEED)
    return path


@pytest.fixture(scope="session")
def mesh(tiny_model_dir):
    """One running mesh (1 rank, CPU) on the tiny model, shared by the session."""
    from moemesh import launcher

    # Jump-forward on (the gateway's default is off): tests/e2e/test_constraints_e2e.py checks its chunks.
    spec = launcher.MeshSpec(model_dir=str(tiny_model_dir), num_ranks=1, device="cpu",
                             extra_args={"gateway": ["--jump-forward", "--jump-forward-min-tokens", "1"]})
    with launcher.Mesh(spec) as running:
        yield running


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir):
    """transformers' Qwen3-MoE on the same weights: the correctness oracle."""
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    )
    return model.eval()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The reference: greedy decoding with transformers' own forward and KV
    cache, EOS ignored (generate() would mask EOS under min_new_tokens)."""
    with torch.no_grad():
        out = model(torch.tensor([prompt_ids]), use_cache=True)
        new_ids = []
        for _ in range(max_new_tokens):
            token = int(out.logits[0, -1].argmax())
            new_ids.append(token)
            out = model(torch.tensor([[token]]), cache=out.cache, use_cache=True)
    return new_ids


def hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """The reference log-probabilities: transformers' fp32 log-softmax of the logits at
    every position of token_ids, row i predicting token i + 1 ([len, V])."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([token_ids])).logits[0].float(), dim=-1)

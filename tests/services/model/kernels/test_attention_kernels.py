"""The Triton paged attention (services/model/kernels/attention.py) against the torch reference,
on the CPU through Triton's interpreter.

TRITON_INTERPRET=1 must be set before the kernels are defined (the module's
import), so this file sets it first. The interpreter runs fp32 only here: its
bf16 tl.dot gives garbage on the CPU (a GPU benchmark checks bf16). Also covered
without triton: the padded decode batch, the reference skipping slot -1, and
the backend registry.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import dataclasses  # noqa: E402
import random  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from services.kv_pool import KVPool  # noqa: E402
from services.model.attention import (ATTENTION_BACKEND_NAMES, TorchReferenceAttention,  # noqa: E402
                                      make_attention_backend)
from services.model.batch import SeqInput, build_decode_batch, build_forward_batch, copy_batch_  # noqa: E402
from services.model.config import ModelConfig  # noqa: E402
from services.model.make_model import random_weights  # noqa: E402
from services.model.qwen3_moe import Qwen3MoeModel  # noqa: E402
from tests.triton_interpreter import interpreted  # noqa: E402

BLOCK_SIZE = 4
NUM_BLOCKS = 40


@pytest.fixture(scope="module")
def triton_attention():
    """services.model.kernels.attention, or a skip where triton is not installed."""
    with interpreted("kernels.attention") as module:
        yield module



def _pools(num_kv_heads, head_dim, seed=0) -> tuple[KVPool, KVPool]:
    """Two identical pools filled with noise (stale KV the kernels must not read)."""
    pools = [KVPool(1, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim, torch.float32, "cpu") for _ in range(2)]
    generator = torch.Generator().manual_seed(seed)
    noise_k, noise_v = (torch.randn(pools[0].k_cache.shape, generator=generator) for _ in range(2))
    for pool in pools:
        pool.k_cache.copy_(noise_k)
        pool.v_cache.copy_(noise_v)
    return pools[0], pools[1]


def _compare(backend, batch, num_heads, num_kv_heads, head_dim, seed=0):
    """Runs the reference and `backend` on the same inputs; asserts outputs and pools agree."""
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch.num_tokens, h, head_dim, generator=generator)
               for h in (num_heads, num_kv_heads, num_kv_heads))
    ref_pool, pool = _pools(num_kv_heads, head_dim, seed)
    expected = TorchReferenceAttention().forward(0, q, k, v, batch, ref_pool, head_dim ** -0.5)
    out = backend.forward(0, q, k, v, batch, pool, head_dim ** -0.5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(pool.k_cache, ref_pool.k_cache) and torch.equal(pool.v_cache, ref_pool.v_cache)
    return out


def _tables(sizes, seed=0) -> list[list[int]]:
    """Disjoint block tables of the given sizes, scattered over the pool, out of order."""
    blocks = random.Random(seed).sample(range(NUM_BLOCKS), sum(sizes))
    starts = np.cumsum([0, *sizes])
    return [blocks[a:b] for a, b in zip(starts[:-1], starts[1:])]


# (query heads, KV heads, head_dim): GQA groups of 4 and 3 (not a power of two), MHA, odd head_dim.
SHAPES = [(8, 2, 32), (12, 4, 16), (4, 4, 24)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("splits", [1, 4, None])
def test_decode_matches_reference(triton_attention, shape, splits):
    tables = _tables([3, 9, 1, 5])
    seqs = [SeqInput(0, [1], 9, tables[0], True), SeqInput(1, [2], 33, tables[1], True),
            SeqInput(2, [3], 0, tables[2], True), SeqInput(3, [4], 19, tables[3], True)]
    _compare(triton_attention.TritonPagedAttention(splits, block_n=16), build_forward_batch(seqs, BLOCK_SIZE, "cpu"),
             *shape)


@pytest.mark.parametrize("splits", [1, 4])
def test_decode_sequences_first_grid(triton_attention, monkeypatch, splits):
    """The grid with the sequences as its first axis (DECODE_HEADS_FIRST off) computes the same."""
    monkeypatch.setattr(triton_attention, "DECODE_HEADS_FIRST", False)
    tables = _tables([3, 9, 5])
    seqs = [SeqInput(0, [1], 9, tables[0], True), SeqInput(1, [2], 33, tables[1], True),
            SeqInput(2, [4], 19, tables[2], True)]
    _compare(triton_attention.TritonPagedAttention(splits, block_n=16), build_forward_batch(seqs, BLOCK_SIZE, "cpu"),
             12, 4, 16)


@pytest.mark.parametrize("decode", [True, False])
def test_float8_cache_dots_in_half_precision(triton_attention, decode):
    """A float8 cache: the dots take fp16 operands (FP8_DOTS_IN_FP16), against the reference
    reading the same float8 cache (inputs exactly representable in float8, so the interpreter's
    float8 stores round nothing; fp16 q and probabilities: a looser tolerance)."""
    generator = torch.Generator().manual_seed(5)
    tables = _tables([3, 9, 7])
    seqs = [SeqInput(0, [1], 9, tables[0], True), SeqInput(1, [2], 33, tables[1], True),
            SeqInput(2, list(range(6)) if not decode else [4], 19, tables[2], True)]
    batch = build_forward_batch(seqs, BLOCK_SIZE, "cpu")
    q, k, v = (torch.randn(batch.num_tokens, h, 16, generator=generator).to(torch.float8_e4m3fn).float()
               for h in (12, 4, 4))
    pools = [KVPool(1, NUM_BLOCKS, BLOCK_SIZE, 4, 16, torch.float8_e4m3fn, "cpu") for _ in range(2)]
    noise_k, noise_v = (torch.randn(pools[0].k_cache.shape, generator=generator).to(torch.float8_e4m3fn)
                        for _ in range(2))
    for pool in pools:
        pool.k_cache.copy_(noise_k)
        pool.v_cache.copy_(noise_v)
    expected = TorchReferenceAttention().forward(0, q, k, v, batch, pools[0], 0.25)
    out = triton_attention.TritonPagedAttention(1, block_n=16).forward(0, q, k, v, batch, pools[1], 0.25)
    torch.testing.assert_close(out, expected, atol=3e-3, rtol=3e-3)
    assert torch.equal(pools[1].k_cache.float(), pools[0].k_cache.float())


def test_decode_steps_one_after_another(triton_attention):
    """Each decode step writes its token's K/V (the split holding it) before reading: the same
    backend and pools step after step, the token landing in every split in turn."""
    backend = triton_attention.TritonPagedAttention(4, block_n=4)
    tables = _tables([9, 5])
    for context in (20, 33, 7, 1):
        seqs = [SeqInput(0, [1], context, tables[0], True), SeqInput(1, [2], 15, tables[1], True)]
        _compare(backend, build_forward_batch(seqs, BLOCK_SIZE, "cpu"), 8, 2, 32, seed=context)


@pytest.mark.parametrize("shape", SHAPES)
def test_prefill_chunks_mid_sequence_and_mixed_batch(triton_attention, shape):
    tables = _tables([3, 9, 4, 6])
    seqs = [
        SeqInput(0, list(range(7)), 5, tables[0], True),  # a chunk starting mid-block
        SeqInput(1, [2], 33, tables[1], True),  # a decode token in the same batch
        SeqInput(2, list(range(13)), 0, tables[2], True),  # a whole prompt
        SeqInput(3, list(range(20)), 3, tables[3], True),  # several query tiles
    ]
    batch = build_forward_batch(seqs, BLOCK_SIZE, "cpu")
    assert not batch.is_decode
    _compare(triton_attention.TritonPagedAttention(block_n=16, prefill_rows=16), batch, *shape)


def test_prefill_launches_one_program_per_query_tile_and_head(triton_attention):
    """A mixed batch's grid lists its tiles (a decode row is one), not sequences x the longest chunk's tiles."""
    tables = _tables([3, 9, 4, 6])
    seqs = [SeqInput(0, list(range(7)), 5, tables[0], True), SeqInput(1, [2], 33, tables[1], True),
            SeqInput(2, list(range(13)), 0, tables[2], True), SeqInput(3, list(range(20)), 3, tables[3], True)]
    batch = build_forward_batch(seqs, BLOCK_SIZE, "cpu")
    backend = triton_attention.TritonPagedAttention(block_n=16, prefill_rows=16)  # group 4: 4 tokens a tile
    tiles, decodes, whole = backend._prefill_tiles(batch, 4, torch.device("cpu"))
    assert whole == []
    assert tiles.tolist() == [[0, 0, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3], [0, 1, 0, 0, 1, 2, 3, 0, 1, 2, 3, 4]]
    assert decodes is None
    assert backend._prefill_tiles(batch, 4, torch.device("cpu"))[0] is tiles  # once per step, not per layer
    launched = _launch_grids(triton_attention, ["_prefill_kernel"], lambda: _compare(backend, batch, 8, 2, 32))
    assert launched == {"_prefill_kernel": [(12, 2)]}  # 12 tiles x 2 KV heads (was 4 x 2 x 5)


def _launch_grids(module, names, run) -> dict[str, list[tuple]]:
    """The grid of each launch of the named kernels of `module` while run() runs."""
    launched = {name: [] for name in names}

    class Recording:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            launched[self.name].append(grid)
            return self.kernel[grid]

    with pytest.MonkeyPatch.context() as patch:
        for name in names:
            patch.setattr(module, name, Recording(name, getattr(module, name)))
        run()
    return launched


def _mixed_batch():
    """Decodes first, between chunks and last, and a one-token prompt (also a single-token sequence)."""
    tables = _tables([9, 3, 5, 4, 2, 1, 6])
    seqs = [SeqInput(0, [2], 33, tables[0], True),
            SeqInput(1, list(range(7)), 5, tables[1], True),
            SeqInput(2, [3], 17, tables[2], True),
            SeqInput(3, list(range(13)), 0, tables[3], True),
            SeqInput(4, [4], 6, tables[4], True),
            SeqInput(5, [5], 0, tables[5], True),
            SeqInput(6, list(range(20)), 3, tables[6], True)]
    return build_forward_batch(seqs, BLOCK_SIZE, "cpu")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("splits", [1, 4, None])
def test_mixed_batch_decodes_through_the_decode_kernel(triton_attention, shape, splits):
    batch = _mixed_batch()
    backend = triton_attention.TritonPagedAttention(splits, block_n=16, prefill_rows=16, mixed_decode=True)
    _compare(backend, batch, *shape)
    group_pad = triton_attention.triton.next_power_of_2(shape[0] // shape[1])
    tiles, decodes, _ = backend._prefill_tiles(batch, max(1, 16 // group_pad), torch.device("cpu"))
    assert decodes.tolist() == [0, 2, 4, 5] and 0 not in tiles[0].tolist() and 2 not in tiles[0].tolist()


def test_mixed_decode_launches(triton_attention):
    """With mixed_decode the prefill grid lists the chunks' tiles only, the decode grid the four decodes."""
    batch = _mixed_batch()
    backend = triton_attention.TritonPagedAttention(4, block_n=16, prefill_rows=16, mixed_decode=True)
    launched = _launch_grids(triton_attention, ["_prefill_kernel", "_decode_kernel", "_decode_reduce_kernel"],
                             lambda: _compare(backend, batch, 8, 2, 32))
    # group 4: 4 tokens a tile; chunks of 7, 13 and 20 tokens: 2 + 4 + 5 tiles; the decode grid
    # KV heads x decodes x splits (DECODE_HEADS_FIRST).
    assert launched == {"_prefill_kernel": [(11, 2)], "_decode_kernel": [(2, 4, 4)], "_decode_reduce_kernel": [(4, 8)]}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("knobs", [{}, {"sdpa_flash_first": True, "sdpa_expand_kv": True}])
def test_whole_prompts_go_to_fused_attention(triton_attention, shape, knobs):
    """Prompts with nothing cached, at least sdpa_min_tokens long, attend through torch's fused
    attention (grouped query heads, or K/V copied out to every head); the chunks after a cached
    prefix, the decodes and the shorter prompts stay in the kernels, and the batch matches the reference."""
    batch = _mixed_batch()  # whole prompts of 13 and 1 tokens (sequences 3 and 5), chunks of 7 and 20 after a prefix
    backend = triton_attention.TritonPagedAttention(4, block_n=16, prefill_rows=16, sdpa_min_tokens=8, **knobs)
    _compare(backend, batch, *shape)
    group_pad = triton_attention.triton.next_power_of_2(shape[0] // shape[1])
    tiles, _, whole = backend._prefill_tiles(batch, max(1, 16 // group_pad), torch.device("cpu"), True)
    start = batch.cu_q_lens[3]
    assert whole == [(start, 13)] and 3 not in tiles[0].tolist() and 6 in tiles[0].tolist()


def test_sdpa_lengths_are_few_and_cover_every_prompt(triton_attention):
    """A prompt attends at a bucket at least its length and at most 1/8 longer; the buckets are
    their own lengths, and 25 serve every prompt of 1,024-8,192 tokens (cuDNN: a graph each)."""
    length_of, lengths = triton_attention.sdpa_length, triton_attention.sdpa_lengths(1024, 8192)
    for n in range(1024, 8193):
        assert n <= length_of(n) <= n * 9 / 8 and length_of(n) in lengths
    assert all(length_of(b) == b for b in lengths) and lengths == sorted(set(lengths))
    assert len(lengths) == 25 and lengths[:3] == [1024, 1152, 1280] and lengths[-1] == 8192
    assert length_of(4097) == 4608 and length_of(4096) == 4096 and length_of(1) == 64


def _recorded_sdpa(module, monkeypatch, heads: list | None = None) -> list[int]:
    """The query lengths torch's fused attention is called with, from now on (and into `heads`,
    the query and KV heads of each call, with enable_gqa)."""
    lengths, sdpa = [], module.F.scaled_dot_product_attention

    def recorded(q, k, v, **kwargs):
        lengths.append(q.shape[2])
        assert k.shape[2] == v.shape[2] == q.shape[2]
        if heads is not None:
            heads.append((q.shape[1], k.shape[1], kwargs["enable_gqa"]))
        return sdpa(q, k, v, **kwargs)
    monkeypatch.setattr(module.F, "scaled_dot_product_attention", recorded)
    return lengths


@pytest.mark.parametrize("start,after", [(3, 40), (5, 2)])
def test_whole_prompt_attends_at_its_bucket_with_the_same_rows(triton_attention, monkeypatch, start, after):
    """A prompt of 37 tokens runs at 48 rows (the step's next rows where they are, else zero
    rows); its own rows are causal attention over its tokens alone, and no other row is written."""
    monkeypatch.setattr(triton_attention, "SDPA_MIN_LENGTH_STEP", 4)  # 37 -> 48 (64 / 16 = 4 a step: 40)
    monkeypatch.setattr(triton_attention, "SDPA_LENGTHS_PER_OCTAVE", 4)  # 64 / 4 = 16 a step: 48
    generator = torch.Generator().manual_seed(1)
    length, num_tokens = 37, start + 37 + after
    q, k, v = (torch.randn(num_tokens, h, 16, generator=generator) * 10 for h in (8, 2, 2))
    out = torch.full_like(q, 7.0)
    calls = _recorded_sdpa(triton_attention, monkeypatch)
    triton_attention._attend_whole_prompt(q, k, v, out, start, length, 0.25)
    assert calls == [48]
    rows = slice(start, start + length)
    expected = torch.nn.functional.scaled_dot_product_attention(
        *(x[rows].transpose(0, 1).unsqueeze(0) for x in (q, k, v)), is_causal=True, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(out[rows], expected[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    assert (out[:start] == 7.0).all() and (out[start + length:] == 7.0).all()


def test_expanded_kv_gives_the_grouped_heads_attention(triton_attention, monkeypatch):
    """sdpa_expand_kv: K/V copied out to every query head, without grouping; the same output rows."""
    generator = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(40, h, 16, generator=generator) for h in (8, 2, 2))
    grouped, expanded = torch.zeros_like(q), torch.zeros_like(q)
    heads = []
    _recorded_sdpa(triton_attention, monkeypatch, heads)
    triton_attention._attend_whole_prompt(q, k, v, grouped, 2, 30, 0.25)
    triton_attention._attend_whole_prompt(q, k, v, expanded, 2, 30, 0.25, expand_kv=True)
    assert heads == [(8, 2, True), (8, 8, False)]
    torch.testing.assert_close(expanded, grouped, atol=1e-5, rtol=1e-5)
    assert expanded[2:32].abs().sum() > 0


def test_warm_whole_prompts_runs_each_length_once(triton_attention, monkeypatch):
    """Warming runs the fused attention once at every bucket from sdpa_min_tokens up to the one
    of max_tokens, each at its own length, with the pool's heads; nothing without prompts for it,
    nor over a float8 cache (whose prompts stay in the kernel)."""
    calls = _recorded_sdpa(triton_attention, monkeypatch)
    backend = triton_attention.TritonPagedAttention(4, sdpa_min_tokens=8)
    pool = KVPool(1, 4, BLOCK_SIZE, 2, 16, torch.float32, "cpu")
    assert backend.warm_whole_prompts(pool, 8, torch.float32, 200) == [64, 128, 192, 256]
    assert calls == [64, 128, 192, 256]
    assert triton_attention.TritonPagedAttention(4, sdpa_min_tokens=0).warm_whole_prompts(
        pool, 8, torch.float32, 200) == []
    assert backend.warm_whole_prompts(pool, 8, torch.float32, 7) == []
    float8 = KVPool(1, 4, BLOCK_SIZE, 2, 16, torch.float8_e4m3fn, "cpu")
    assert backend.warm_whole_prompts(float8, 8, torch.float32, 200) == [] and len(calls) == 4


def test_whole_prompts_stay_in_the_kernel_over_a_float8_cache(triton_attention):
    """A float8 cache: the prefill kernel reads back the rounded K/V it stored, so no prompt goes
    to the fused attention (which would attend to the unrounded K/V in hand)."""
    batch = _mixed_batch()
    backend = triton_attention.TritonPagedAttention(4, block_n=16, prefill_rows=16, sdpa_min_tokens=8)
    pools = [KVPool(1, NUM_BLOCKS, BLOCK_SIZE, 2, 32, torch.float8_e4m3fn, "cpu")]
    q, k, v = (torch.randn(batch.num_tokens, h, 32) for h in (8, 2, 2))
    launched = _launch_grids(triton_attention, ["_prefill_kernel"],
                             lambda: backend.forward(0, q, k, v, batch, pools[0], 32 ** -0.5))
    assert backend._tiles[-1] == [] and launched["_prefill_kernel"]


def test_padded_decode_rows_write_nothing_and_return_zeros(triton_attention):
    tables = _tables([3, 9])
    seqs = [SeqInput(0, [1], 9, tables[0], True), SeqInput(1, [2], 33, tables[1], True)]
    batch = build_decode_batch(seqs, BLOCK_SIZE, "cpu", num_rows=5, max_blocks=12)
    untouched_k, _ = _pools(2, 32)
    out = _compare(triton_attention.TritonPagedAttention(4, block_n=16), batch, 8, 2, 32)
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))
    # Slot -1 must not wrap around to the pool's last slot.
    written = set(batch.slot_mapping_T[:2].tolist())
    _, pool = _pools(2, 32)
    backend = triton_attention.TritonPagedAttention(4, block_n=16)
    backend.forward(0, torch.randn(5, 8, 32), torch.randn(5, 2, 32), torch.randn(5, 2, 32), batch, pool, 0.1)
    changed = (pool.k_cache != untouched_k.k_cache).view(-1, 2 * 32).any(dim=1).nonzero().flatten().tolist()
    assert set(changed) == written


@pytest.mark.parametrize("splits", [1, 4])
def test_expanded_decode_rows_give_the_chunks_attention(triton_attention, splits):
    """An expanded decode batch (a decode row per new token, rows of one sequence reading each
    other's K/V) gives the chunked batch's outputs and KV: with the torch reference, and with the
    Triton decode kernel, every row's K/V stored before any row attends."""
    tables = _tables([3, 9, 2, 5])
    seqs = [SeqInput(0, [1, 2, 3], 9, tables[0], True), SeqInput(1, [4], 33, tables[1], True),
            SeqInput(2, list(range(5, 13)), 0, tables[2], True), SeqInput(3, [13, 14], 17, tables[3], True)]
    chunked = build_forward_batch(seqs, BLOCK_SIZE, "cpu")
    expanded = build_decode_batch(seqs, BLOCK_SIZE, "cpu", num_rows=16, max_blocks=9, max_seq_tokens=8)
    assert expanded.is_expanded and expanded.is_decode and chunked.num_tokens == 14
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(16, h, 32, generator=generator) for h in (8, 2, 2))
    (chunk_pool, ref_pool), (pool, _) = _pools(2, 32), _pools(2, 32)
    expected = TorchReferenceAttention().forward(0, q[:14], k[:14], v[:14], chunked, chunk_pool, 0.2)
    for backend, kv in ((TorchReferenceAttention(), ref_pool),
                        (triton_attention.TritonPagedAttention(splits, block_n=16), pool)):
        out = backend.forward(0, q, k, v, expanded, kv, 0.2)
        torch.testing.assert_close(out[:14], expected, atol=1e-5, rtol=1e-5)
        assert torch.equal(out[14:], torch.zeros_like(out[14:]))  # the padding rows
        assert torch.equal(kv.k_cache, chunk_pool.k_cache) and torch.equal(kv.v_cache, chunk_pool.v_cache)


def test_expanded_decode_stores_kv_before_the_decode_kernel_which_writes_none(triton_attention, monkeypatch):
    """The rows of one sequence must not write K/V inside the decode kernel (row j + 1 reads row
    j's, written by another program: a race on a GPU, which the interpreter's serial programs
    would hide): the KV-write kernel runs first, the decode kernel with STORE_KV off; a plain
    decode batch keeps the decode kernel's own write."""
    launches = []

    class Recording:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((self.name, kwargs.get("STORE_KV")))
                return self.kernel[grid](*args, **kwargs)
            return launch

    for name in ("_store_kv_kernel", "_decode_kernel"):
        monkeypatch.setattr(triton_attention, name, Recording(name, getattr(triton_attention, name)))
    tables = _tables([3, 2])
    backend = triton_attention.TritonPagedAttention(1, block_n=16)
    for token_ids, expected in (([1, 2, 3], [("_store_kv_kernel", None), ("_decode_kernel", False)]),
                                ([1], [("_decode_kernel", True)])):
        seqs = [SeqInput(0, token_ids, 5, tables[0], True), SeqInput(1, [4], 2, tables[1], True)]
        batch = build_decode_batch(seqs, BLOCK_SIZE, "cpu", num_rows=4, max_blocks=3, max_seq_tokens=3)
        launches.clear()
        _compare(backend, batch, 8, 2, 32)
        assert launches == expected


def test_decode_reads_only_device_tensors(triton_attention):
    """The decode path ignores the host tuples (stale in a CUDA graph replay)."""
    tables = _tables([3, 9])
    seqs = [SeqInput(0, [1], 9, tables[0], True), SeqInput(1, [2], 33, tables[1], True)]
    batch = build_decode_batch(seqs, BLOCK_SIZE, "cpu", num_rows=3, max_blocks=12)
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(3, h, 32, generator=generator) for h in (8, 2, 2))
    backend = triton_attention.TritonPagedAttention()
    expected = backend.forward(0, q, k, v, batch, _pools(2, 32)[0], 0.2)
    stale = dataclasses.replace(batch, q_lens=(7, 7, 7), context_lens=(1, 2, 3))
    assert torch.equal(backend.forward(0, q, k, v, stale, _pools(2, 32)[0], 0.2), expected)


def test_decode_num_splits_from_shapes(triton_attention):
    splits = triton_attention.decode_num_splits
    assert splits(1, 4, 8192, 132) == 64  # one long sequence fills the GPU
    assert splits(1, 4, 1024, 132) == 16  # at least 64 tokens per split
    assert splits(1, 4, 100, 132) == 2
    assert splits(64, 4, 4096, 132) == 2
    assert splits(256, 4, 4096, 132) == 1
    assert splits(3, 4, 0, 132) == 1
    with pytest.raises(ValueError, match="power of two"):
        triton_attention.TritonPagedAttention(3)


def test_model_with_triton_matches_torch(triton_attention):
    """Chunked prefill then decode through the whole model, both backends."""
    config = ModelConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, intermediate_size=96, moe_intermediate_size=32,
                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=128,
                         dtype=torch.float32)
    weights = random_weights(config, seed=5)
    models = [Qwen3MoeModel(config, weights, expert_ids=range(4), attention=name) for name in ("torch", "triton")]
    pools = [KVPool.for_model(config, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu") for _ in models]
    tokens = torch.randint(128, (11,), generator=torch.Generator().manual_seed(1)).tolist()
    table = _tables([3])[0]
    for start, end in [(0, 6), (6, 9), (9, 10), (10, 11)]:
        batch = build_forward_batch([SeqInput(0, tokens[start:end], start, table, True)], BLOCK_SIZE, "cpu")
        expected, logits = (model.forward(batch, pool) for model, pool in zip(models, pools))
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_build_decode_batch_pads_rows_and_table():
    seqs = [SeqInput(5, [7], 5, [9, 2], True), SeqInput(6, [8], 0, [3], False)]
    batch = build_decode_batch(seqs, BLOCK_SIZE, "cpu", num_rows=4, max_blocks=3)
    assert batch.is_decode and batch.max_q_len == 1
    assert batch.input_ids_T.tolist() == [7, 8, 0, 0]
    assert batch.positions_T.tolist() == [5, 0, 0, 0]
    assert batch.slot_mapping_T.tolist() == [2 * 4 + 1, 3 * 4, -1, -1]
    assert batch.block_tables_BM.tolist() == [[9, 2, 0], [3, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert batch.context_lens_B.tolist() == [6, 1, 0, 0] and batch.context_lens == (6, 1, 0, 0)
    assert batch.cu_q_lens_B1.tolist() == [0, 1, 2, 3, 4] and batch.q_lens == (1, 1, 1, 1)
    assert batch.sample_indices_S.tolist() == [0, 1, 2, 3]
    static = build_decode_batch([], BLOCK_SIZE, "cpu", num_rows=4, max_blocks=3)
    copy_batch_(static, batch)
    assert static.slot_mapping_T.tolist() == [9, 12, -1, -1] and static.context_lens_B.tolist() == [6, 1, 0, 0]
    with pytest.raises(ValueError, match="shape"):
        copy_batch_(static, build_decode_batch(seqs, BLOCK_SIZE, "cpu", num_rows=4, max_blocks=2))
    with pytest.raises(ValueError, match="do not fit"):
        build_decode_batch(seqs, BLOCK_SIZE, "cpu", num_rows=1, max_blocks=3)
    with pytest.raises(ValueError, match="max_blocks 1"):
        build_decode_batch(seqs, BLOCK_SIZE, "cpu", num_rows=4, max_blocks=1)
    with pytest.raises(ValueError, match="2 new tokens"):
        build_decode_batch([SeqInput(1, [1, 2], 0, [0], True)], BLOCK_SIZE, "cpu", num_rows=4, max_blocks=3)


def test_forward_batch_device_lengths():
    seqs = [SeqInput(5, [1, 2, 3], 3, [9, 2], True), SeqInput(6, [4], 0, [7], False)]
    batch = build_forward_batch(seqs, BLOCK_SIZE, "cpu")
    assert batch.context_lens_B.dtype == torch.int32 and batch.context_lens_B.tolist() == [6, 1]
    assert batch.cu_q_lens_B1.tolist() == [0, 3, 4] and batch.max_q_len == 3 and not batch.is_decode
    empty = build_forward_batch([], BLOCK_SIZE, "cpu")
    assert empty.max_q_len == 0 and empty.cu_q_lens_B1.tolist() == [0]


def test_backend_registry():
    assert set(ATTENTION_BACKEND_NAMES) == {"auto", "torch", "triton"}
    with pytest.raises(ValueError, match="'flash'"):
        make_attention_backend("flash")
    # auto on CPU tensors is the reference, padded rows included.
    seqs = [SeqInput(0, [1], 9, _tables([3])[0], True)]
    batch = build_decode_batch(seqs, BLOCK_SIZE, "cpu", num_rows=2, max_blocks=3)
    q, k, v = torch.randn(2, 4, 16), torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    ref_pool, pool = _pools(2, 16)
    expected = TorchReferenceAttention().forward(0, q, k, v, batch, ref_pool, 0.25)
    assert torch.equal(make_attention_backend("auto").forward(0, q, k, v, batch, pool, 0.25), expected)
    assert torch.equal(expected[1], torch.zeros_like(expected[1]))
    # Warming: the reference has nothing to prepare, and auto warms the backend of the device.
    assert make_attention_backend("auto").warm_whole_prompts(ref_pool, 4, torch.float32, 4096) == []


def test_expert_config_attention_backend():
    from expert_svc.config import _ATTENTION_BACKENDS, ExpertConfig

    assert _ATTENTION_BACKENDS == ATTENTION_BACKEND_NAMES  # kept apart so the config imports no torch
    assert ExpertConfig(member_id="e", model="m").attention_backend == "auto"
    assert ExpertConfig(member_id="e", model="m", device="cuda:1", attention_backend="triton").is_cuda
    with pytest.raises(ValueError, match="'flash'"):
        ExpertConfig(member_id="e", model="m", attention_backend="flash")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        ExpertConfig(member_id="e", model="m", attention_backend="triton")
    assert ExpertConfig(member_id="e", model="m").warm_prompt_tokens == 8192
    with pytest.raises(ValueError, match="warm_prompt_tokens and warm_logit_rows must be >= 0"):
        ExpertConfig(member_id="e", model="m", warm_prompt_tokens=-1)

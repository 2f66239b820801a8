"""The serving benchmark's workloads: seeded lists of (prompt ids, max new tokens).

Prompts are random token ids (requests are sent as input_ids with ignore_eos,
so every length is exact); the same seed gives the same requests. `scale`
multiplies prompt lengths and `output_scale` the generated lengths, so the
CPU smoke run uses the same shapes in miniature (each length is at least 1).

- `mix`, the production mix: 60% 4K-token prompts with 32 new tokens, 30% 2K
  prompts with 128 new tokens, 10% 8K prompts with 16 new tokens.
- `1k1k`: 1K-token prompts, 1K new tokens.
- `shared-prefix`, chat behind one system prompt: a 2K-token system prompt
  shared by every request, a 256-token user turn of its own, 128 new tokens.
- `system-prompts`, several applications behind one gateway: each request
  takes one of 8 1K-token system prompts at random, then a 256-token user turn
  of its own, 64 new tokens. With several data-parallel ranks, the prefix
  cache hits only where a request lands on a rank that holds its system
  prompt: the gateway's placement decides the hit rate (`ideal_hit_rate`
  says what one cache shared by every rank would reach).
"""

import dataclasses
import random

# Random ids are drawn from [ID_LOW, ID_HIGH): ordinary tokens of the Qwen
# vocabulary, clear of the special ones (151643 and above).
ID_LOW = 1_000
ID_HIGH = 100_000


@dataclasses.dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of a workload."""

    kind: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    # Greedy by default; a temperature samples (top_p 1: no nucleus cut), from the seed.
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Shape:
    """A request class: prompt and output lengths at scale 1, and its share of the requests."""

    kind: str
    num_prompt_tokens: int
    max_new_tokens: int
    weight: float = 1.0


MIX = (Shape("4k/32", 4096, 32, 0.6), Shape("2k/128", 2048, 128, 0.3), Shape("8k/16", 8192, 16, 0.1))
ONE_K_ONE_K = (Shape("1k/1k", 1024, 1024),)
SHARED_PREFIX_SYSTEM_TOKENS = 2048
SHARED_PREFIX_USER = Shape("2k+256/128", 256, 128)
NUM_SYSTEM_PROMPTS = 8
SYSTEM_PROMPT_TOKENS = 1024
SYSTEM_PROMPTS_USER = Shape("1k+256/64", 256, 64)

WORKLOADS = ("mix", "1k1k", "shared-prefix", "system-prompts")


def _scaled(length: int, scale: float) -> int:
    return max(1, round(length * scale))


def _random_ids(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(ID_LOW, ID_HIGH) for _ in range(n))


def make_workload(name: str, num_requests: int, *, scale: float = 1.0, output_scale: float = 1.0,
                  seed: int = 0) -> list[RequestSpec]:
    """num_requests requests of the workload, in arrival order; ValueError for a bad argument."""
    if name not in WORKLOADS:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {name!r}")
    if num_requests <= 0 or scale <= 0 or output_scale <= 0:
        raise ValueError(f"num_requests ({num_requests}), scale ({scale}) and output_scale "
                         f"({output_scale}) must be positive")
    rng = random.Random(seed)
    if name == "shared-prefix":
        system = _random_ids(rng, _scaled(SHARED_PREFIX_SYSTEM_TOKENS, scale))
        user = SHARED_PREFIX_USER
        return [RequestSpec(user.kind, system + _random_ids(rng, _scaled(user.num_prompt_tokens, scale)),
                            _scaled(user.max_new_tokens, output_scale))
                for _ in range(num_requests)]
    if name == "system-prompts":
        systems = [_random_ids(rng, _scaled(SYSTEM_PROMPT_TOKENS, scale)) for _ in range(NUM_SYSTEM_PROMPTS)]
        user = SYSTEM_PROMPTS_USER
        return [RequestSpec(user.kind, rng.choice(systems) + _random_ids(rng, _scaled(user.num_prompt_tokens, scale)),
                            _scaled(user.max_new_tokens, output_scale))
                for _ in range(num_requests)]
    shapes = MIX if name == "mix" else ONE_K_ONE_K
    specs = []
    for _ in range(num_requests):
        shape = rng.choices(shapes, weights=[s.weight for s in shapes])[0]
        specs.append(RequestSpec(shape.kind, _random_ids(rng, _scaled(shape.num_prompt_tokens, scale)),
                                 _scaled(shape.max_new_tokens, output_scale)))
    return specs


def ideal_hit_rate(specs: list[RequestSpec], block_size: int = 16) -> float:
    """The prefix-cache hit rate of one unbounded cache shared by every rank, in whole blocks of
    `block_size` tokens: each prompt hits the longest prefix it shares with an earlier prompt
    (what a perfect placement over data-parallel ranks could reach; each rank's cache holds its
    own blocks, so a request placed away from its prefix recomputes it)."""
    seen: set[tuple[int, ...]] = set()
    hits = total = 0
    for spec in specs:
        ids = spec.prompt_ids
        # A cache match always leaves the last prompt token to compute.
        full = (len(ids) - 1) // block_size
        shared = 0
        while shared < full and ids[:(shared + 1) * block_size] in seen:
            shared += 1
        hits += shared * block_size
        total += len(ids)
        seen.update(ids[:(b + 1) * block_size] for b in range(full))
    return hits / total if total else 0.0


def longest_request(specs: list[RequestSpec]) -> int:
    """The most tokens (prompt plus output) one request of the list needs."""
    return max(len(s.prompt_ids) + s.max_new_tokens for s in specs)

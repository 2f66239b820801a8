"""services/constraints.py on the real Qwen3 tokenizer: bad constraints name their field, the compile
cache, random walks through the allowed tokens that always end inside the constraint, jump-forward,
resume, rollback and batch masks."""

import json
import string
import subprocess
import sys
import threading

import numpy as np
import pytest

from services.constraints import Compiler, fill_masks
from services.step import Constraint, ConstraintError
from services.step import SpecError
from tests.services.constraint_cases import (
    CONSTRAINTS, QWEN3_MODEL_VOCAB, TICKET, check_output, demo_tokenizer, qwen3, qwen3_compiler,
)


BAD = [
    ("json_schema", "{not json"),
    ("json_schema", "[1, 2]"),
    ("json_schema", '{"type": "object", "not": {"type": "integer"}}'),   # unsupported keyword
    ("json_schema", '{"type": "array", "uniqueItems": true}'),
    ("json_schema", '{"type": "strin"}'),
    ("json_schema", '{"$ref": "#/$defs/missing"}'),
    ("json_schema", '{"type": "string", "pattern": "a(("}'),
    ("json_schema", '{"type": "object", "x-guidance": {"whitespace_flexible": true}}'),
    ("regex", "a(b"),
    ("regex", "[z-a]"),
    ("grammar", ""),
    ("grammar", "start: undefined_rule"),
    ("grammar", "start: /a(/"),
    ("choice", ()),
    ("choice", ("yes", "")),
    # What llguidance refuses with a ValueError of its own rather than a compile error.
    ("json_schema", '{"type": "array", "minItems": 100000000000000000000}'),
    ("json_schema", '{"type": "string", "pattern": "\\ud800"}'),
    ("regex", "\ud800"),
    # Nested past Python's recursion limit (the parser's or a walker's), past llguidance's, or past both.
    ("json_schema", "[" * 5000 + "]" * 5000),
    ("json_schema", '{"items": ' * 900 + "{}" + "}" * 900),
    ("json_schema", '{"type": "object", "properties": {"a": ' * 200 + "{}" + "}}" * 200),
    ("regex", "(" * 5000 + "a" + ")" * 5000),
    ("grammar", "start: " + "(" * 5000 + '"a"' + ")" * 5000),
]


@pytest.fixture(scope="module")
def compiler() -> Compiler:
    return qwen3_compiler()


@pytest.mark.parametrize("kind, text", BAD)
def test_a_bad_constraint_names_its_field(compiler, kind, text):
    with pytest.raises(ConstraintError) as caught:
        compiler.compile(Constraint(kind, text))
    assert caught.value.field == f"sampling.{kind}"
    assert isinstance(caught.value, SpecError) and str(caught.value).startswith(f"sampling.{kind} ")
    assert caught.value.reason


def test_a_refusal_of_a_lone_surrogate_is_itself_text(compiler):
    # The message goes back as a gRPC status's details and in an HTTP error's JSON: UTF-8.
    with pytest.raises(ConstraintError) as caught:
        compiler.compile(Constraint("json_schema", '{"enum": ["\\udc00"]}'))
    assert "does not compile" in str(caught.value)
    str(caught.value).encode("utf-8")


def test_unsupported_keyword_and_bad_regex_say_why(compiler):
    with pytest.raises(ConstraintError, match="not"):
        compiler.compile(Constraint("json_schema", '{"not": {}}'))
    with pytest.raises(ConstraintError, match="unclosed group"):
        compiler.compile(Constraint("regex", "a(b"))


@pytest.mark.parametrize("kind, text", [("bogus", "x"), ("regex", ("a",)), ("choice", "a"), ("json_object", "{}")])
def test_a_malformed_constraint_is_a_programming_error(kind, text):
    with pytest.raises(ValueError) as caught:
        Constraint(kind, text)
    assert not isinstance(caught.value, ConstraintError)


def test_compile_is_cached_by_content(compiler):
    first = compiler.compile(Constraint("regex", "[0-9]{3}"))
    assert compiler.compile(Constraint("regex", "[0-9]{3}")) is first
    assert compiler.compile(Constraint("grammar", 'start: /[0-9]{3}/')) is not first


def test_the_cache_is_bounded_and_thread_safe():
    small = Compiler.for_tokenizer(qwen3(), QWEN3_MODEL_VOCAB, cache_size=2)
    a, b, c = (Constraint("choice", (x,)) for x in "abc")
    first_a = small.compile(a)
    small.compile(b), small.compile(c)            # a is the least recently used: evicted
    assert small.compile(a) is not first_a
    results, constraint = [], Constraint("regex", "[a-z]{2}")
    threads = [threading.Thread(target=lambda: results.append(small.compile(constraint))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4 and all(r is results[0] for r in results)


_ROW_WORDS = (QWEN3_MODEL_VOCAB + 31) // 32


def _allowed(matcher) -> np.ndarray:
    vocab = matcher.compiled.vocab_size
    row = np.zeros((vocab + 31) // 32, dtype=np.int32)
    matcher.fill_mask(row)
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab])


def _token_sets(tok):
    punctuation = {ids[0] for c in string.punctuation + " " if len(ids := tok.encode(c)) == 1}
    finishers = {tok.encode(c)[0] for c in '"}].'} | set(tok.eos_token_ids)
    return np.array(sorted(finishers)), np.array(sorted(punctuation))


def random_walk(matcher, seed: int, tok=None, max_tokens: int = 400) -> list[int]:
    """A random ALLOWED token at each step until EOS, leaning more and more on punctuation and
    closing tokens (a uniform pick over ~150k tokens would rarely close a free string)."""
    tok = tok or qwen3()
    rng, pools, eos = np.random.default_rng(seed), _token_sets(tok), set(tok.eos_token_ids)
    # Control tokens (and ids past the tokenizer's) are never allowed, but for EOS when the output is complete.
    specials = np.array([i for i, t in tok.backend.get_added_tokens_decoder().items() if t.special])
    tokens: list[int] = []
    while len(tokens) < max_tokens and not matcher.is_terminated():
        allowed = _allowed(matcher)
        allowed_specials = set(allowed[np.isin(allowed, specials) | (allowed >= tok.vocab_size)].tolist())
        assert allowed_specials <= eos and bool(allowed_specials) == matcher.is_accepting(), (allowed_specials, tokens)
        bias = min(0.9, 0.3 + len(tokens) / 100)
        for pool in pools:
            picks = allowed[np.isin(allowed, pool)]
            if len(picks) and rng.random() < bias:
                token = int(rng.choice(picks))
                break
        else:
            token = int(rng.choice(allowed))
        assert matcher.accept(token), (token, tokens)
        tokens.append(token)
    assert matcher.is_terminated(), tok.decode(tokens)
    return tokens


@pytest.mark.parametrize("name", list(CONSTRAINTS))
@pytest.mark.parametrize("seed", range(6))
def test_a_random_walk_ends_inside_the_constraint(compiler, name, seed):
    tokens = random_walk(compiler.matcher(CONSTRAINTS[name]), seed)
    assert tokens[-1] in qwen3().eos_token_ids
    check_output(name, qwen3().decode(tokens[:-1]))


@pytest.mark.parametrize("name", list(CONSTRAINTS))
def test_a_random_walk_on_the_demo_models_tokenizer_ends_inside_the_constraint(name):
    """The bundled demo model has its own 8,192-token vocabulary."""
    demo = demo_tokenizer()
    demo_compiler = Compiler.for_tokenizer(demo, demo.vocab_size)
    for seed in range(3):
        tokens = random_walk(demo_compiler.matcher(CONSTRAINTS[name]), seed, tok=demo)
        check_output(name, demo.decode(tokens[:-1]))


def test_a_refused_token_changes_nothing(compiler):
    matcher = compiler.matcher(TICKET)
    before = _allowed(matcher)
    assert not matcher.accept(qwen3().encode("[")[0])
    assert not matcher.accept(qwen3().eos_token_ids[0])
    assert np.array_equal(_allowed(matcher), before)


def test_jump_forward_tokens_are_what_decoding_them_one_by_one_gives(compiler):
    tok, matcher = qwen3(), compiler.matcher(TICKET)
    assert matcher.forced_bytes() == b'{"is_dispute": '
    forced = matcher.forced_token_ids()
    assert forced and b'{"is_dispute": '.startswith(tok.decode(forced).encode())
    # The tokenizer's own encoding of the forced text starts with them.
    assert tok.encode('{"is_dispute": ')[:len(forced)] == forced
    for token in forced:   # each one is allowed by the mask a normal decode would see
        assert token in _allowed(matcher) and matcher.accept(token)
    for token in tok.encode(' true, "amount": 12'):
        assert matcher.accept(token)
    assert matcher.forced_bytes() == b""         # more digits, '.', 'e' or ', "date_range": ' may follow
    assert matcher.accept(tok.encode(",")[0])
    assert matcher.forced_bytes() == b' "date_range": ["'


def test_a_choice_forces_the_rest_of_its_option(compiler):
    tok = qwen3()
    matcher = compiler.matcher(Constraint("choice", ("refund", "escalate to a human")), tok.encode("escalate"))
    assert tok.decode(matcher.forced_token_ids()) == " to a human"


def test_a_resumed_matcher_continues_where_the_output_stopped(compiler):
    tokens = random_walk(compiler.matcher(CONSTRAINTS["nested"]), seed=11)
    walker = compiler.matcher(CONSTRAINTS["nested"])
    for k, token in enumerate(tokens[:-1]):
        if k % 7 == 0:
            assert np.array_equal(_allowed(compiler.matcher(CONSTRAINTS["nested"], tokens[:k])), _allowed(walker))
        walker.accept(token)
    assert compiler.matcher(CONSTRAINTS["nested"], tokens).is_terminated()   # the EOS replayed too
    with pytest.raises(ValueError, match="token 0"):
        compiler.matcher(TICKET, qwen3().encode("[1]"))


def test_rollback_copy_and_reset(compiler):
    tokens = random_walk(compiler.matcher(TICKET), seed=3)
    matcher = compiler.matcher(TICKET)
    start = _allowed(matcher)
    for token in tokens[:5]:
        matcher.accept(token)
    after_five = _allowed(matcher)
    copy = matcher.copy()
    for token in tokens[5:]:
        assert matcher.accept(token)
    assert matcher.is_terminated() and np.array_equal(_allowed(copy), after_five)
    matcher.rollback(len(tokens) - 5)            # the EOS included
    assert not matcher.is_terminated() and np.array_equal(_allowed(matcher), after_five)
    matcher.reset()
    assert np.array_equal(_allowed(matcher), start)


def test_fill_masks_fills_each_row_as_its_matcher_would(compiler):
    tok = qwen3()
    matchers = [compiler.matcher(CONSTRAINTS[name]) for name in CONSTRAINTS]
    matchers[0].accept(tok.encode("{")[0])
    bitmask = np.zeros((len(matchers), _ROW_WORDS), dtype=np.int32)
    fill_masks(bitmask, matchers)
    for row, matcher in zip(bitmask, matchers):
        expected = np.zeros(_ROW_WORDS, dtype=np.int32)
        matcher.fill_mask(expected)
        assert np.array_equal(row, expected)
    with pytest.raises(ValueError, match="int32"):
        fill_masks(np.zeros((1, _ROW_WORDS), dtype=np.int64), matchers[:1])


def test_json_object_starts_with_a_brace_and_allows_no_free_whitespace(compiler):
    tok, matcher = qwen3(), compiler.matcher(CONSTRAINTS["json_object"])
    assert matcher.forced_bytes() == b"{"
    for token in tok.encode('{"a"'):
        assert matcher.accept(token)
    assert matcher.forced_bytes() == b": "
    for token in tok.encode(": "):
        assert matcher.accept(token)
    for whitespace in (" ", "\n", "\t"):
        assert not matcher.accept(tok.encode(whitespace)[0])


def test_the_module_loads_no_torch():
    """The gateway compiles and validates constraints, and it runs without torch."""
    script = "import sys, services.constraints; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def _accepts(compiler, schema: dict, text: str) -> bool:
    """The whole text (then EOS) is an answer of the schema."""
    matcher = compiler.matcher(Constraint("json_schema", json.dumps(schema)))
    return all(matcher.accept(t) for t in qwen3().encode(text)) and matcher.accept(next(iter(compiler.eos_token_ids)))


def test_unbounded_numbers_get_digit_bounds_and_bounded_ones_keep_theirs(compiler):
    number, integer = {"type": "number"}, {"type": "integer"}
    for text in ("129.99", "-0.000001", "1000000000000000", "-42"):
        assert _accepts(compiler, number, text), text
    for text in ("10000000000000001", "0.1234567", "1e5"):   # past 10^15, a 7th fraction digit, an exponent
        assert not _accepts(compiler, number, text), text
    assert _accepts(compiler, integer, "-1000000000000000") and not _accepts(compiler, integer, "1000000000000001")
    # The schema's own bounds and multipleOf win; enum/const and values inside data keywords are left alone.
    assert _accepts(compiler, {"type": "integer", "minimum": 0, "maximum": 10**18}, str(10**17))
    assert _accepts(compiler, {"type": "number", "multipleOf": 0.5}, "2.5")
    assert _accepts(compiler, {"type": "integer", "enum": [10**17]}, str(10**17))
    nested = {"type": "object", "properties": {"const": {"type": "array", "items": number}},
              "required": ["const"], "additionalProperties": False}
    assert _accepts(compiler, nested, '{"const": [1.5, 2]}')
    assert not _accepts(compiler, nested, '{"const": [1.1234567]}')


def test_a_model_that_only_writes_digits_still_ends_a_number(compiler):
    """The tiny random model's argmax after a digit is a digit: 16 integer digits, '.', then 6 more at most."""
    matcher, tok = compiler.matcher(Constraint("json_schema", '{"type": "number"}')), qwen3()
    digits = [tok.encode(d)[0] for d in "123456789.0"]
    for step in range(40):
        allowed = set(_allowed(matcher).tolist())
        pick = next((t for t in digits if t in allowed), None)
        if pick is None:
            break
        assert matcher.accept(pick)
    assert step <= 24 and matcher.is_accepting() and set(_allowed(matcher).tolist()) <= compiler.eos_token_ids

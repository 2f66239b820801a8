"""Constrained decoding: a request's constraint compiled for one tokenizer, and one matcher per sequence.

A `Constraint` is what a request asks for (JSON Schema, any JSON object, a regular
expression, a grammar, or one of a few strings); a `Compiler` turns it, once per distinct
content, into a `CompiledConstraint` for one tokenizer; a `Matcher` follows one sequence: it
writes the next token's allowed set into a bitmask row (one bit per token of the model's
vocabulary, int32 words, bit i of word w is token 32 w + i), accepts each sampled token,
and says when the output is complete. services/model/constraint_mask.py applies the bitmasks
to the logits on the device.

The engine is llguidance (why: docs/internals.md, "Constraints"): it needs no torch, so the
gateway compiles and validates constraints before admission, and it refuses the JSON Schema
keywords it cannot enforce, so a finished answer always validates. Grammars are in llguidance's
Lark dialect; a regex must match the whole output (Rust `regex` syntax); a choice is an
alternation of the options' literal texts.

Bounded whitespace: JSON (json_schema and json_object) is compiled in one fixed form, the
default of Python's json.dumps: no whitespace between tokens but one space after each item
comma and each key colon (`{"a": [1, 2], "b": "x"}`), in the schema's property order. A
weak or random model cannot spend its budget on whitespace, and the text between the values
is forced, which jump-forward uses (`forced_token_ids`, `forced_bytes`). A schema's own
"x-guidance" options are refused: they could turn free whitespace back on.

Bounded numbers: a JSON Schema number or integer with no bound of its own gets one, so that a
weak model cannot write digits forever either: |x| <= 10^15 (NUMBER_LIMIT, the integers a float64
holds exactly) where the schema sets no minimum (resp. maximum), and for a number with no
multipleOf, at most 6 fraction digits (multipleOf 10^-6), without an exponent. Every output is
still valid for the schema (a subset of its numbers); json_object's values stay unbounded.

What is cached: the compiled constraint (llguidance's parsed grammar and its lexer, kept in a
matcher that has computed its first mask) by the Constraint's content, in a bounded LRU; each
new matcher is a copy of it (tens of microseconds). Compile errors are not cached.
A Compiler is thread-safe; a Matcher is not (one sequence, one thread at a time).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
from collections.abc import Sequence

import llguidance
import numpy as np

from services.step import Constraint, ConstraintError

# JSON in json.dumps' default form (module docstring).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": False}
# The bounds a schema's unbounded numbers get (module docstring).
NUMBER_LIMIT = 10**15
NUMBER_FRACTION_DIGITS = 6
# Keywords whose values are JSON data, not subschemas: bounded_numbers does not look inside;
# and those whose values map names to subschemas.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
# Distinct constraints a Compiler keeps compiled.
DEFAULT_CACHE_SIZE = 512
# Longest engine error message quoted back to a client.
MAX_REASON_CHARS = 300


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class CompiledConstraint:
    """A constraint compiled for one tokenizer; shared by every sequence that uses it."""

    constraint: Constraint
    # A matcher at the start of the output, its first mask computed; matchers copy it.
    template: llguidance.LLMatcher
    eos_token_ids: frozenset[int]
    vocab_size: int


class Compiler:
    """Compiles constraints for one tokenizer, once per distinct content (a bounded LRU); thread-safe."""

    def __init__(self, tokenizer_json: str, eos_token_ids: Sequence[int], vocab_size: int,
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        """`tokenizer_json`: a Hugging Face tokenizer.json; `vocab_size`: the model's logits width
        (at least the tokenizer's; the tokens beyond it are never allowed)."""
        if not eos_token_ids:
            raise ValueError("constrained decoding needs at least one EOS token id")
        if cache_size < 1:
            raise ValueError(f"cache_size must be at least 1, got {cache_size}")
        self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size
        self._cache: collections.OrderedDict[Constraint, CompiledConstraint] = collections.OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int | None = None, **kwargs) -> Compiler:
        """A Compiler for a services.tokenizer.Tokenizer; vocab_size defaults to the tokenizer's."""
        return cls(tokenizer.backend.to_str(), tokenizer.eos_token_ids,
                   vocab_size or tokenizer.vocab_size, **kwargs)

    @property
    def mask_words(self) -> int:
        """int32 words in one bitmask row."""
        return (self.vocab_size + 31) // 32

    def compile(self, constraint: Constraint) -> CompiledConstraint:
        """The compiled form of `constraint`, from the cache if the same content was compiled.

        Raises ConstraintError naming the field for a constraint that cannot be compiled.
        """
        with self._lock:
            compiled = self._cache.get(constraint)
            if compiled is not None:
                self._cache.move_to_end(constraint)
                return compiled
        # Outside the lock: llguidance drops the GIL while it builds, so other threads go on.
        compiled = self._build(constraint)
        with self._lock:
            compiled = self._cache.setdefault(constraint, compiled)   # a racing thread's copy wins
            self._cache.move_to_end(constraint)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, constraint: Constraint, token_ids: Sequence[int] = ()) -> Matcher:
        """A matcher for a new sequence, advanced over `token_ids` (a resumed sequence's output so far).

        Raises ConstraintError if the constraint does not compile, ValueError if it refuses the tokens.
        """
        matcher = Matcher(self.compile(constraint))
        for i, token_id in enumerate(token_ids):
            if not matcher.accept(token_id):
                raise ValueError(f"token {i} ({token_id}) of the output breaks the {constraint.kind} constraint")
        return matcher

    def _build(self, constraint: Constraint) -> CompiledConstraint:
        try:
            grammar = _grammar(constraint)
        except ConstraintError:
            raise
        except ValueError as error:
            # llguidance's own refusals of what it cannot read: a JSON Schema value past its
            # JSON (an integer over 64 bits, an escaped lone surrogate), text UTF-8 cannot encode.
            raise ConstraintError(constraint.field, f"does not compile: {error}") from None
        except RecursionError:
            # A JSON Schema nested deeper than Python's parser and walkers go (llguidance refuses
            # shallower ones itself, at about 200 levels).
            raise ConstraintError(constraint.field, "is nested too deeply") from None
        template = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if not template.is_error():
            # The first mask builds the lexer's initial states; every copy starts from them.
            template.compute_bitmask()
        if template.is_error():
            raise ConstraintError(constraint.field, "does not compile: " + _reason(template.get_error()))
        return CompiledConstraint(constraint, template, self.eos_token_ids, self.vocab_size)


def _grammar(constraint: Constraint) -> str:
    """llguidance's grammar text of a constraint; raises ConstraintError for what it would not refuse itself."""
    kind, text = constraint.kind, constraint.text
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except ValueError as error:
            raise ConstraintError(constraint.field, f"is not valid JSON: {error}") from None
        if not isinstance(schema, dict):
            raise ConstraintError(constraint.field, f"must be a JSON object, got {type(schema).__name__}")
        if "x-guidance" in schema:
            raise ConstraintError(constraint.field, "must not set x-guidance (the server fixes the JSON form)")
        return llguidance.LLMatcher.grammar_from_json_schema(bounded_numbers(schema), overrides=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "grammar":
        if not text.strip():
            raise ConstraintError(constraint.field, "is empty")
        return llguidance.LLMatcher.grammar_from_lark(text)
    return llguidance.LLMatcher.grammar_from_regex("|".join(_literal_regex(option) for option in text))


def bounded_numbers(schema):
    """A copy of a JSON Schema (or a part of one) whose numbers and integers without bounds get
    NUMBER_LIMIT and, numbers, NUMBER_FRACTION_DIGITS (module docstring)."""
    if isinstance(schema, list):
        return [bounded_numbers(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: value if key in _DATA_KEYWORDS
           else {name: bounded_numbers(sub) for name, sub in value.items()}
           if key in _SCHEMA_MAPS and isinstance(value, dict) else bounded_numbers(value)
           for key, value in schema.items()}
    types = out.get("type")
    types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else set()
    if not types & {"number", "integer"} or "enum" in out or "const" in out:
        return out
    if "minimum" not in out and "exclusiveMinimum" not in out:
        out["minimum"] = -NUMBER_LIMIT
    if "maximum" not in out and "exclusiveMaximum" not in out:
        out["maximum"] = NUMBER_LIMIT
    if "number" in types and "multipleOf" not in out:
        out["multipleOf"] = 10.0 ** -NUMBER_FRACTION_DIGITS
    return out


def _literal_regex(text: str) -> str:
    """A regex that matches exactly `text`: every character but ASCII letters and digits escaped."""
    return "(" + "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text) + ")"


def _reason(error: str) -> str:
    """The engine's message, shortened for a client."""
    error = " ".join(error.split())
    return error if len(error) <= MAX_REASON_CHARS else error[:MAX_REASON_CHARS - 3] + "..."


class Matcher:
    """Where one sequence stands in its constraint. Not thread-safe.

    Per step: `fill_mask` (or `fill_masks` for a batch) before sampling, `accept` the sampled
    token after. An EOS token is allowed exactly when the output so far satisfies the
    constraint; once the constraint admits nothing more, EOS is the only token allowed.
    """

    def __init__(self, compiled: CompiledConstraint) -> None:
        self.compiled = compiled
        self._matcher = compiled.template.deep_copy()
        self._is_terminated = False
        self._is_eos_counted = False

    def fill_mask(self, bitmask_row: np.ndarray) -> None:
        """Write the next token's allowed set into a C-contiguous int32 row of Compiler.mask_words words."""
        _check_rows(bitmask_row, self.compiled.vocab_size)
        self._matcher.unsafe_compute_mask_ptr(bitmask_row.ctypes.data, bitmask_row.nbytes)

    def allowed_token_ids(self) -> list[int]:
        """The next token's allowed ids, ascending (tests and debugging; fill_mask is the fast path)."""
        row = np.zeros((self.compiled.vocab_size + 31) // 32, dtype=np.int32)
        self.fill_mask(row)
        bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:self.compiled.vocab_size]
        return bits.nonzero()[0].tolist()

    def accept(self, token_id: int) -> bool:
        """Advance over a sampled token; False (and no change) if the constraint does not allow it."""
        if self._is_terminated:
            return False
        if token_id in self.compiled.eos_token_ids:
            # try_consume_tokens refuses EOS; consume_token takes it, allowed exactly when accepting.
            # A matcher that had stopped already does not count the EOS (for rollback).
            is_counted = not self._matcher.is_stopped()
            self._is_terminated = self._matcher.is_accepting() and self._matcher.consume_token(token_id)
            self._is_eos_counted = is_counted
            return self._is_terminated
        return self._matcher.try_consume_tokens([token_id]) == 1

    def is_accepting(self) -> bool:
        """True if the output so far satisfies the constraint (an EOS may follow)."""
        return self._matcher.is_accepting()

    def is_terminated(self) -> bool:
        """True once an EOS token has been accepted: the output is complete and valid."""
        return self._is_terminated

    def forced_bytes(self) -> bytes:
        """The bytes the constraint forces next, whatever the model says (empty if none)."""
        return b"" if self._is_terminated else self._matcher.compute_ff_bytes()

    def forced_token_ids(self) -> list[int]:
        """The tokens the constraint forces next (jump-forward), as the tokenizer would encode them.

        A prefix of `forced_bytes`' tokenization: llguidance leaves out a last token that the
        text after it could merge with, so appending these gives the tokens a normal decode would.
        """
        return [] if self._is_terminated else self._matcher.compute_ff_tokens()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (an EOS included)."""
        num_engine_tokens = num_tokens - (self._is_terminated and not self._is_eos_counted and num_tokens > 0)
        if num_engine_tokens and not self._matcher.rollback(num_engine_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._matcher.get_error()}")
        self._is_terminated = self._is_terminated and not num_tokens

    def reset(self) -> None:
        """Back to the start of the output."""
        self._matcher.reset()
        self._is_terminated = False

    def copy(self) -> Matcher:
        """An independent matcher in the same state (e.g. to plan a step ahead)."""
        clone = Matcher.__new__(Matcher)
        clone.compiled, clone._matcher = self.compiled, self._matcher.deep_copy()
        clone._is_terminated, clone._is_eos_counted = self._is_terminated, self._is_eos_counted
        return clone


_EXECUTOR: llguidance.LLExecutor | None = None
_EXECUTOR_LOCK = threading.Lock()


def fill_masks(bitmask_CW: np.ndarray, matchers: Sequence[Matcher]) -> None:
    """Fill row c of a C-contiguous int32 [C, W] bitmask for matchers[c], in parallel threads."""
    global _EXECUTOR
    if bitmask_CW.ndim != 2 or bitmask_CW.shape[0] != len(matchers):
        raise ValueError(f"{len(matchers)} matchers for a bitmask of shape {bitmask_CW.shape}")
    if not matchers:
        return
    _check_rows(bitmask_CW, matchers[0].compiled.vocab_size)
    if any(m.compiled.vocab_size != matchers[0].compiled.vocab_size for m in matchers):
        raise ValueError("matchers of different vocabularies in one bitmask")
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = llguidance.LLExecutor()
    _EXECUTOR.unsafe_compute_mask_ptr([(m._matcher, c) for c, m in enumerate(matchers)],
                                      bitmask_CW.ctypes.data, bitmask_CW.shape[1] * 4, bitmask_CW.shape[0])


def _check_rows(bitmask: np.ndarray, vocab_size: int) -> None:
    words = (vocab_size + 31) // 32
    if bitmask.dtype != np.int32 or bitmask.shape[-1] != words or not bitmask.flags.c_contiguous:
        raise ValueError(f"bitmask rows must be C-contiguous int32 of {words} words, "
                         f"got {bitmask.dtype} {bitmask.shape}")

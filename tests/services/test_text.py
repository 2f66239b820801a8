"""IncrementalDetokenizer against whole-sequence decoding, StopStringMatcher
against a brute-force search, both over random streams and chunkings."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.text import IncrementalDetokenizer, StopStringMatcher
from services.tokenizer import QWEN3_VOCAB_SIZE, Tokenizer


@pytest.fixture(scope="module")
def tokenizer(cache_dir) -> Tokenizer:
    return Tokenizer.qwen3(cache_dir)


def chunked(items, sizes):
    """Split `items` into consecutive chunks of the given sizes (cycled), empty ones included."""
    if not any(sizes):
        sizes = [1]
    chunks, i, k = [], 0, 0
    while i < len(items):
        size = sizes[k % len(sizes)]
        chunks.append(items[i:i + size])
        i, k = i + size, k + 1
    return chunks


def stream(detokenizer, chunks) -> list[str]:
    return [detokenizer.push(chunk) for chunk in chunks] + [detokenizer.flush()]


# Ids in the first 256 are single bytes (mostly partial UTF-8), then the
# whole vocabulary with the added tokens.
token_ids = st.one_of(st.integers(0, 255), st.integers(0, QWEN3_VOCAB_SIZE - 1))
chunk_sizes = st.lists(st.integers(0, 4), max_size=8)


@settings(max_examples=300, deadline=None)
@given(st.lists(token_ids, max_size=40), chunk_sizes, st.booleans())
def test_random_ids_stream_to_the_whole_decode(tokenizer, ids, sizes, skip_special_tokens):
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    pieces = stream(detokenizer, chunked(ids, sizes))
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40), chunk_sizes)
def test_encoded_text_streams_back_without_partial_characters(tokenizer, text, sizes):
    ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = stream(detokenizer, chunked(ids, sizes))
    assert "".join(pieces) == tokenizer.decode(ids)
    # Valid text: no piece, the final flush included, ever holds U+FFFD.
    assert all("\ufffd" not in piece for piece in pieces) or "\ufffd" in text


def test_multibyte_character_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("a𠀀b")      # 𠀀 is three byte-level tokens
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert [detokenizer.push([i]) for i in ids] == ["a", "", "", "𠀀", "b"]
    assert detokenizer.flush() == ""


def test_flush_releases_an_incomplete_character_as_replacement(tokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer)
    x, partial = tokenizer.encode("x"), tokenizer.encode("𠀀")[:2]
    assert detokenizer.push(x) == "x"
    assert detokenizer.push(partial) == ""
    assert detokenizer.flush() == "\ufffd"
    # Pushed together, "x" waits with the incomplete character.
    together = IncrementalDetokenizer(tokenizer)
    assert together.push(x + partial) == ""
    assert together.flush() == "x\ufffd"


def test_special_tokens_in_the_stream(tokenizer):
    ids = [*tokenizer.encode("hi"), 151645, *tokenizer.encode(" there")]
    assert "".join(stream(IncrementalDetokenizer(tokenizer), [[i] for i in ids])) == "hi<|im_end|> there"
    skipping = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    assert "".join(stream(skipping, [[i] for i in ids])) == "hi there"


def test_pushing_after_flush_continues(tokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.push(tokenizer.encode("one")) == "one"
    assert detokenizer.flush() == ""
    assert detokenizer.push(tokenizer.encode(" two")) == " two"


# --- StopStringMatcher ---------------------------------------------------------

def run_matcher(stops, increments):
    """(released pieces, matched stop) after pushing increments until a match, then flush."""
    matcher = StopStringMatcher(stops)
    pieces = []
    for text in increments:
        released, matched = matcher.push(text)
        pieces.append(released)
        if matched is not None:
            return pieces, matched
    return pieces + [matcher.flush()], None


def reference(stops, text):
    """The stop completed first (smallest end, then longest) and the text before it."""
    ends = [(text.find(s) + len(s), -len(s), s) for s in stops if s in text]
    if not ends:
        return text, None
    end, _, stop = min(ends)
    return text[:end - len(stop)], stop


def test_stop_in_one_increment():
    assert run_matcher(["STOP"], ["abc STOP def"]) == (["abc "], "STOP")


def test_stop_split_across_many_increments():
    pieces, matched = run_matcher(["</answer>"], ["The answer", " is 4<", "/", "ans", "w", "er", ">tail"])
    assert matched == "</answer>"
    assert pieces == ["The answer", " is 4", "", "", "", "", ""]


def test_stop_one_character_at_a_time():
    text = "xx<|end|>yy"
    pieces, matched = run_matcher(["<|end|>"], list(text))
    assert "".join(pieces) == "xx" and matched == "<|end|>"


def test_held_prefix_is_released_when_it_diverges():
    matcher = StopStringMatcher(["stop"])
    assert matcher.push("a st") == ("a ", None)
    assert matcher.push("o") == ("", None)
    assert matcher.push("p") == ("", "stop")
    matcher = StopStringMatcher(["stop"])
    assert matcher.push("a sto") == ("a ", None)
    assert matcher.push("ck") == ("stock", None)


def test_false_start_inside_a_partial_match():
    # "aab": the held "aa" is not a prefix of "ab", but its suffix "a" is.
    matcher = StopStringMatcher(["ab"])
    assert matcher.push("a") == ("", None)
    assert matcher.push("a") == ("a", None)
    assert matcher.push("b") == ("", "ab")


def test_overlapping_candidates_first_completed_wins():
    # "bc" completes (at 'c') before "abcd" does.
    assert run_matcher(["abcd", "bc"], ["xab", "cd"]) == (["x", "a"], "bc")
    assert run_matcher(["abcd", "bc"], ["xabcd"]) == (["xa"], "bc")
    # Both complete at the same character: the longer one, releasing less.
    assert run_matcher(["b", "ab"], ["xab"]) == (["x"], "ab")
    assert run_matcher(["ab", "b"], ["xa", "b"]) == (["x", ""], "ab")


def test_candidates_sharing_an_end():
    # After "c", the held "aa" starts "aab"; both stops then end at the "b".
    pieces, matched = run_matcher(["aab", "ab"], ["a", "a", "c", "aa", "b"])
    assert "".join(pieces) == "aac" and matched == "aab"


def test_text_before_a_match_and_flush_without_match():
    assert run_matcher(["\n\n"], ["line one\n", "line two\n"]) == (["line one", "\nline two", "\n"], None)


def test_no_stops_passes_everything_through():
    matcher = StopStringMatcher([])
    assert matcher.push("anything") == ("anything", None)
    assert matcher.flush() == ""


def test_push_after_a_match_is_an_error():
    matcher = StopStringMatcher(["x"])
    assert matcher.push("x") == ("", "x")
    assert matcher.matched_stop == "x"
    with pytest.raises(RuntimeError, match="after the stop string 'x' matched"):
        matcher.push("more")


def test_empty_stop_string_is_rejected():
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(["ok", ""])


@settings(max_examples=500, deadline=None)
@given(stops=st.lists(st.text("abc", min_size=1, max_size=4), max_size=3),
       text=st.text("abcd", max_size=30), sizes=chunk_sizes)
def test_matcher_equals_brute_force(stops, text, sizes):
    chunks = chunked(text, sizes)
    pieces, matched = run_matcher(stops, chunks)
    assert ("".join(pieces), matched) == reference(stops, text)


@settings(max_examples=300, deadline=None)
@given(stops=st.lists(st.text("ab", min_size=1, max_size=4), min_size=1, max_size=3),
       text=st.text("abc", max_size=20), sizes=chunk_sizes)
def test_matcher_holds_back_only_possible_stop_starts(stops, text, sizes):
    matcher, seen, released = StopStringMatcher(stops), "", ""
    for chunk in chunked(text, sizes):
        piece, matched = matcher.push(chunk)
        if matched is not None:
            return
        seen, released = seen + chunk, released + piece
        held = seen[len(released):]
        assert seen.startswith(released)
        # The held text is the longest suffix that some stop begins with.
        longest = max((n for n in range(len(seen) + 1)
                       if any(s.startswith(seen[len(seen) - n:]) for s in stops)), default=0)
        assert len(held) == longest

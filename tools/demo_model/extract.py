"""Plain English out of the Debian packages the demo corpus is built from.

Each extractor takes the root of an unpacked package and returns `Extracted`:
plain-text documents (paragraphs joined by blank lines) and question/answer
pairs that become ChatML conversations. Code blocks, navigation and tables of
numbers are dropped: the demo model should learn prose.
"""

import dataclasses
import gzip
import html.parser
import pathlib
import re

# Elements whose text is one paragraph of the output.
_BLOCKS = {"p", "li", "dd", "dt", "h1", "h2", "h3", "h4", "h5", "h6", "blockquote", "caption", "title"}
_HEADINGS = {"h1", "h2", "h3", "h4", "h5", "h6"}
# Elements whose whole subtree is dropped (code, scripts).
_SKIP_TAGS = {"pre", "script", "style", "textarea", "svg", "table"}
# Containers (by class or role) that hold navigation, not content.
_SKIP_CLASSES = re.compile(
    r"\b(sphinxsidebar|related|footer|navheader|navfooter|nav|menu|toc|breadcrumb|headerlink|indexterm)\b")
_SECTION_NUMBER = re.compile(r"^(\d+(\.\d+)*\.?|[A-Z]\.(\d+\.)*)\s+")


@dataclasses.dataclass
class Extracted:
    """What one source yields: documents, and (question, answer) pairs for chat."""

    documents: list[str] = dataclasses.field(default_factory=list)
    qa_pairs: list[tuple[str, str]] = dataclasses.field(default_factory=list)


def clean_space(text: str) -> str:
    """Collapses runs of whitespace into one space."""
    return " ".join(text.replace("\u00b6", " ").split())


def is_prose(text: str, min_words: int = 6) -> bool:
    """True for a sentence-like paragraph: enough words, mostly letters, some lower case."""
    words = text.split()
    if len(words) < min_words:
        return False
    chars = [c for c in text if not c.isspace()]
    letters = sum(c.isalpha() for c in chars)
    return letters >= 0.75 * len(chars) and any(c.islower() for c in text)


class _PageParser(html.parser.HTMLParser):
    """Collects (tag, text) blocks of a page, skipping code and navigation."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.blocks: list[tuple[str, str]] = []
        self._open: list[tuple[str, bool]] = []  # (tag, skipped) of open containers
        self._skip_depth = 0
        self._block: str | None = None
        self._parts: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        skipped = tag in _SKIP_TAGS or bool(_SKIP_CLASSES.search(f"{attrs.get('class', '')} {attrs.get('role', '')}"))
        if tag in ("div", "span", "a", "nav", "section", *_SKIP_TAGS):
            self._open.append((tag, skipped))
            self._skip_depth += skipped
        if tag in _BLOCKS:
            self._flush()
            self._block = tag
        elif tag == "br":
            self._parts.append(" ")

    def handle_endtag(self, tag):
        if tag in _BLOCKS:
            self._flush()
        # Pop up to the matching open container; sloppy HTML may leave some unclosed.
        for i in range(len(self._open) - 1, -1, -1):
            if self._open[i][0] == tag:
                self._skip_depth -= sum(skipped for _, skipped in self._open[i:])
                del self._open[i:]
                break

    def handle_data(self, data):
        if not self._skip_depth:
            self._parts.append(data)

    def _flush(self):
        text = clean_space("".join(self._parts))
        if text and self._block:
            self.blocks.append((self._block, text))
        self._block, self._parts = None, []

    def close(self):
        super().close()
        self._flush()


def html_page(path: pathlib.Path) -> tuple[list[str], list[tuple[str, str]]]:
    """The prose paragraphs of one HTML page, and (heading, first paragraph) pairs."""
    parser = _PageParser()
    parser.feed(path.read_text(encoding="utf-8", errors="replace"))
    parser.close()
    paragraphs, pairs, heading = [], [], None
    for tag, text in parser.blocks:
        if tag == "title":
            continue
        if tag in _HEADINGS:
            heading = _SECTION_NUMBER.sub("", text).strip()
            if sum(c.isalpha() for c in heading) >= 3:
                paragraphs.append(heading)
            continue
        if is_prose(text):
            paragraphs.append(text)
            if heading and len(text) >= 80:
                pairs.append((heading, text))
                heading = None
    return paragraphs, pairs


def html_docs(root: pathlib.Path, exclude: re.Pattern | None = None) -> Extracted:
    """Every HTML page under `root` (sorted), one document per page; `exclude` matches relative paths."""
    out = Extracted()
    for path in sorted(root.rglob("*.html")):
        if exclude and exclude.search(path.relative_to(root).as_posix()):
            continue
        paragraphs, pairs = html_page(path)
        if sum(len(p) for p in paragraphs) >= 300:
            out.documents.append("\n\n".join(paragraphs))
            out.qa_pairs += [(f"Tell me about {h}.", text) for h, text in pairs]
    return out


_POS_NAMES = {"n": "a noun", "v": "a verb", "a": "an adjective", "s": "an adjective", "r": "an adverb"}


def wordnet(root: pathlib.Path) -> Extracted:
    """WordNet 3.0 glosses as questions about word meanings (no plain documents)."""
    out = Extracted()
    for pos in ("noun", "verb", "adj", "adv"):
        path = next(root.rglob(f"data.{pos}"))
        for line in path.read_text(encoding="latin-1").splitlines():
            if line.startswith("  ") or "|" not in line:
                continue  # the licence header
            fields, gloss = line.split("|", 1)
            parts = fields.split()
            num_words = int(parts[3], 16)
            words = [re.sub(r"\(.*\)$", "", w).replace("_", " ") for w in parts[4:4 + 2 * num_words:2]]
            definition, *examples = [g.strip() for g in gloss.strip().split(";")]
            examples = [e.strip('"') for e in examples if e.startswith('"') and e.endswith('"')]
            word, kind = words[0], _POS_NAMES[parts[2]]
            if not definition or not word.islower():
                continue  # proper names read badly in these templates
            answer = f'As {kind}, "{word}" means {definition}.'
            if examples:
                example = examples[0] if examples[0][-1:] in ".!?" else examples[0] + "."
                answer += f' For example: "{example}"'
            out.qa_pairs.append((f'What does "{word}" mean?', answer))
            if len(words) > 1:
                others = ", ".join(f'"{w}"' for w in words[1:4])
                out.qa_pairs.append((f'Give me a synonym of "{word}".', f'"{word}" can also be said as {others}.'))
    return out


def fortunes(root: pathlib.Path, files: tuple[str, ...]) -> Extracted:
    """Fortune cookies from the named files: each one a document and an answer."""
    out = Extracted()
    prompts = ("Tell me a fortune.", "Say something wise.", "Give me a quote.", "Tell me something funny.")
    for i, name in enumerate(files):
        text = (root / "usr/share/games/fortunes" / name).read_text(encoding="utf-8", errors="replace")
        cookies = [c.strip("\n") for c in text.split("\n%\n")]
        for j, cookie in enumerate(c for c in cookies if 20 <= len(c) <= 700):
            out.documents.append(cookie)
            out.qa_pairs.append((prompts[(i + j) % len(prompts)], cookie))
    return out


def devils_dictionary(root: pathlib.Path) -> Extracted:
    """Ambrose Bierce's entries ("WORD, n.  Definition...") from the dictd file."""
    text = gzip.decompress(next(root.rglob("devil.dict.dz")).read_bytes()).decode("latin-1")
    entries = re.split(r"\n(?=[A-Z][A-Z' -]+, [a-z]+\.)", text[text.index("\nABASEMENT"):])
    out = Extracted()
    for entry in entries:
        head = re.match(r"([A-Z][A-Z' -]+), [a-z.]+\s+", entry.strip())
        body = _rewrap(entry.strip())
        if head and len(body) > 40:
            out.documents.append(body)
            definition = clean_space(body[head.end():])
            out.qa_pairs.append((f'What does the Devil\'s Dictionary say about "{head.group(1).lower()}"?',
                                 definition))
    return out


def _rewrap(text: str) -> str:
    """Joins the hard-wrapped lines of each paragraph; indented lines (verse) stay lines."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.splitlines()
        if any(line.startswith("    ") for line in lines[1:]):
            paragraphs.append("\n".join(line.strip() for line in lines))
        else:
            paragraphs.append(clean_space(block))
    return "\n\n".join(paragraphs)


def jargon_file(root: pathlib.Path) -> Extracted:
    """The Jargon File's entries (":term: pos" then paragraphs), from the text edition."""
    text = gzip.decompress(next(root.rglob("jargon.txt.gz")).read_bytes()).decode("utf-8")
    out = Extracted()
    for entry in re.split(r"\n(?=   :[^\n:]+:)", text)[1:]:
        head = re.match(r"\s*:([^:\n]+):", entry)
        # {term} marks a cross-reference: keep the word, drop the braces.
        paragraphs = [clean_space(re.sub(r"\{([^}]*)\}", r"\1", p)) for p in entry[head.end():].split("\n\n")]
        paragraphs = [p for p in paragraphs if is_prose(p, min_words=4)]
        if head and paragraphs:
            term = head.group(1)
            out.documents.append(f"{term}\n\n" + "\n\n".join(paragraphs))
            out.qa_pairs.append((f'What does "{term}" mean in hacker slang?', paragraphs[0]))
    return out

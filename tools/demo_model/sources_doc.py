"""SOURCES.md of the demo model: its training data, their licences and sizes.

Rendered by fetch_corpus.py from the corpus manifest; the notices below are the
ones the sources' licences ask to keep with copies and derived works.
"""

NOTICES = """\
## Notices

**WordNet 3.0** (wordnet-base). WordNet 3.0 Copyright 2006 by Princeton University. All rights reserved.
THIS SOFTWARE AND DATABASE IS PROVIDED "AS IS" AND PRINCETON UNIVERSITY MAKES NO REPRESENTATIONS OR
WARRANTIES, EXPRESS OR IMPLIED. BY WAY OF EXAMPLE, BUT NOT LIMITATION, PRINCETON UNIVERSITY MAKES NO
REPRESENTATIONS OR WARRANTIES OF MERCHANT-ABILITY OR FITNESS FOR ANY PARTICULAR PURPOSE OR THAT THE USE OF THE
LICENSED SOFTWARE, DATABASE OR DOCUMENTATION WILL NOT INFRINGE ANY THIRD PARTY PATENTS, COPYRIGHTS, TRADEMARKS
OR OTHER RIGHTS. The name of Princeton University or Princeton may not be used in advertising or publicity
pertaining to distribution of the software and/or database. Title to copyright in this software, database and
any associated documentation shall at all times remain with Princeton University and LICENSEE agrees to
preserve same.

**Python documentation** (python3.11-doc). Copyright (c) 2001-2023 Python Software Foundation. All rights
Reserved (as the Python 3.11 documentation states it). Used under the PSF License Agreement.

**Django documentation** (python-django-doc). Copyright (c) Django Software Foundation and individual
contributors. All rights reserved. Used under the BSD-3-Clause licence.

**PostgreSQL documentation** (postgresql-doc-15). Portions Copyright (c) 1996-2026, PostgreSQL Global
Development Group; Portions Copyright (c) 1994, The Regents of the University of California. Used under the
PostgreSQL Licence.

**fortune-mod** (fortunes, fortunes-min). Copyright (c) 1991 The Regents of the University of California. All
rights reserved. Used under the BSD licence in the package's copyright file; the quotations are by their
named authors.

The full licence texts are in each package's `/usr/share/doc/<package>/copyright`.
"""


def render(manifest: dict) -> str:
    """The SOURCES.md text of a corpus manifest (see fetch_corpus.py)."""
    rows = [
        "| package (Debian 12) | version | licence | what is used | .deb | text | chat |",
        "|---|---|---|---|---:|---:|---:|",
    ]
    for s in manifest["sources"]:
        rows.append(
            f"| {s['package']} | {s['version']} | {s['licence']} | {s['content']} | "
            f"{s['deb_bytes'] / 1e6:.1f} MB | {s['text_chars'] / 1e6:.2f} MB ({s['text_records']} docs) | "
            f"{s['chat_chars'] / 1e6:.2f} MB ({s['chat_records']} conversations) |"
        )
    total = sum(s["text_chars"] + s["chat_chars"] for s in manifest["sources"])
    compressed = sum(shard["bytes"] for shard in manifest["shards"])
    return "\n".join([
        "# Training data of the demo model",
        "",
        "Every source is a Debian 12 package fetched with `apt-get download` by",
        "`tools/demo_model/fetch_corpus.py`; licences as stated in each package's copyright file.",
        "Sizes are characters of extracted plain text after removing repeated paragraphs;",
        "\"chat\" counts the question/answer pairs built from the source, rendered as ChatML.",
        "",
        *rows,
        "",
        f"Total: {total / 1e6:.1f} MB of text, {compressed / 1e6:.1f} MB as gzip shards (seed {manifest['seed']}).",
        "",
        NOTICES,
    ])

#!/usr/bin/env python3
"""Writes tests/fixtures/text/jargon-4.4.7.txt: 172 KB of English prose for
long-context perplexity (37,661 Gemma 3 tokens with BOS, 39,818 SmolLM2 tokens).

Source: The Jargon File, version 4.4.7 (Eric S. Raymond et al., 29 Dec 2003),
as Debian's `jargon-text` package ships it (4.4.7-4.1,
/usr/share/doc/jargon-text/jargon.txt.gz; decompressed, sha256
40dfb4b98191a670a09a183d5798d50f243d23fdbd1495dcc0aca2ce5895ba97). Its
copyright file says: "This document (the Jargon File) is in the public
domain, to be freely used, shared, and modified." The file keeps chapters
1-12 ("Hacker Slang and Hacker Culture" to "Format for New Entries") and
appendices A-C
("Hacker Folklore", "A Portrait of J. Random Hacker", "Helping Hacker Culture
Grow"); it leaves out the glossary (a list of entries) and the bibliography.
Paragraphs are re-flowed: each line of a paragraph stripped of its
indentation and joined with single spaces, runs of spaces inside a line (the
alignment of a few tables, meaningless once re-flowed) cut to one space,
paragraphs separated by one blank line; other characters are kept as they
are (no-break spaces, typographic quotes and box-drawing characters
included). Cutting the space runs also keeps the text clear of a tokenizer
difference: runs of more than 31 spaces, which Gemma's vocabulary has no
single token for, are split differently by transformers' GGUF tokenizer
(e.g. 51 spaces: 3 tokens) and by llama.cpp and kvant (2 tokens).

    apt-get download jargon-text && dpkg-deb -x jargon-text_*.deb x
    python3 tools/reference/make_long_text.py x/usr/share/doc/jargon-text/jargon.txt.gz

Output sha256 dcdd56e909a32daea628685611ccc05bc7445f36243a8456bda90b39c3e98745.
"""

from __future__ import annotations

import gzip
import hashlib
import re
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "text" / "jargon-4.4.7.txt"

def section(lines: list[str], first: str, until: str) -> list[str]:
    """Lines from the one equal to `first` up to (not including) the one equal to `until`."""
    a = lines.index(first)
    b = lines.index(until, a)
    return lines[a:b]


def flow(lines: list[str]) -> str:
    """One paragraph: its lines joined by single spaces, runs of spaces inside
    a line (table alignment) cut to one."""
    return re.sub(" {2,}", " ", " ".join(lines))


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    src = Path(sys.argv[1])
    raw = gzip.decompress(src.read_bytes()) if src.suffix == ".gz" else src.read_bytes()
    print(f"source sha256 {hashlib.sha256(raw).hexdigest()}")
    lines = raw.decode("utf-8").split("\n")
    nb = "\u00a0"  # the headings' spaces are no-break spaces
    parts = section(lines, f"Chapter{nb}1.{nb}Hacker Slang and Hacker Culture", "Glossary")
    parts += [""] + section(lines, f"Appendix{nb}A.{nb}Hacker Folklore", "Bibliography")
    paras, cur = [], []
    for line in parts:
        s = line.strip()
        if s:
            cur.append(s)
        elif cur:
            paras.append(flow(cur))
            cur = []
    if cur:
        paras.append(flow(cur))
    text = "\n\n".join(paras) + "\n"
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT} ({len(text.encode())} bytes, {len(paras)} paragraphs, "
          f"sha256 {hashlib.sha256(text.encode()).hexdigest()})")


if __name__ == "__main__":
    main()

"""Maintainer tool: write a corpus diff from a (file, old, new) replacement list.

    python tools/make_patch.py OUT.diff impl/block_pool.py 'old text' 'new text' [FILE OLD NEW ...]

Every OLD must occur exactly once; the diff is in `git diff` format, paths relative
to the repository root given."""
from __future__ import annotations

import difflib
import sys
from pathlib import Path


def make(root: Path, edits: list[tuple[str, str, str]]) -> str:
    texts: dict[str, tuple[str, str]] = {}
    for rel, old, new in edits:
        orig, cur = texts.get(rel, (None, None))
        if orig is None:
            orig = cur = (root / rel).read_text()
        if cur.count(old) != 1:
            raise SystemExit(f"{rel}: expected exactly one occurrence of {old!r}, found {cur.count(old)}")
        texts[rel] = (orig, cur.replace(old, new))
    out = []
    for rel, (orig, cur) in texts.items():
        out += difflib.unified_diff(orig.splitlines(True), cur.splitlines(True), f"a/{rel}", f"b/{rel}", n=3)
    return "".join(out)


if __name__ == "__main__":
    out, rest = sys.argv[1], sys.argv[2:]
    edits = [(rest[i], rest[i + 1], rest[i + 2]) for i in range(0, len(rest), 3)]
    Path(out).write_text(make(Path("."), edits))

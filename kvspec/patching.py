"""Apply upstream-style unified diffs (``git diff`` format) to copies of source files.

kvspec never writes a target's installed files. A patch is applied in memory to the
text of the files it names, and the patched text is imported from a temporary
directory in the original module's place (see ``kvspec.targets.loading``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


from kvspec.errors import PatchError  # noqa: F401  (re-exported: raised here)


@dataclass
class _Hunk:
    old_start: int
    header: str
    lines: list[str] = field(default_factory=list)  # each starts with ' ', '-' or '+'


@dataclass
class FilePatch:
    path: str  # relative to the repository root, a/ and b/ prefixes removed
    hunks: list[_Hunk]
    new_file: bool = False


def _strip_prefix(name: str) -> str:
    name = name.split("\t", 1)[0].strip()
    if name.startswith(("a/", "b/")):
        name = name[2:]
    return name


def parse_unified_diff(text: str) -> list[FilePatch]:
    """Parse a unified diff into per-file hunks. Raises PatchError on malformed input."""
    patches: list[FilePatch] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            old, new = _strip_prefix(line[4:]), _strip_prefix(lines[i + 1][4:])
            fp = FilePatch(path=new if new != "/dev/null" else old, hunks=[], new_file=old == "/dev/null")
            patches.append(fp)
            i += 2
            continue
        m = _HUNK.match(line)
        if m:
            if not patches:
                raise PatchError(f"hunk '{line.strip()}' appears before any '---/+++' file header")
            hunk = _Hunk(old_start=int(m.group(1)), header=line.strip())
            old_len = int(m.group(2)) if m.group(2) is not None else 1
            new_len = int(m.group(4)) if m.group(4) is not None else 1
            i += 1
            seen_old = seen_new = 0
            while i < len(lines) and (seen_old < old_len or seen_new < new_len):
                body = lines[i]
                if body.startswith("\\"):  # "\ No newline at end of file"
                    i += 1
                    continue
                tag = body[:1] or " "
                if tag not in " -+":
                    break
                hunk.lines.append(tag + body[1:])
                seen_old += tag != "+"
                seen_new += tag != "-"
                i += 1
            if seen_old != old_len or seen_new != new_len:
                raise PatchError(f"{patches[-1].path}: hunk '{hunk.header}' is truncated or miscounted")
            patches[-1].hunks.append(hunk)
            continue
        i += 1
    if not patches:
        raise PatchError("no file headers ('--- a/...', '+++ b/...') found: not a unified diff")
    return patches


def _apply_file(fp: FilePatch, original: str) -> str:
    src = original.splitlines()
    trailing_nl = original.endswith("\n") or not original
    out: list[str] = []
    pos = 0  # next unconsumed line of src
    for hunk in fp.hunks:
        old = [ln[1:] for ln in hunk.lines if ln[0] != "+"]
        new = [ln[1:] for ln in hunk.lines if ln[0] != "-"]
        want = max(hunk.old_start - 1, 0)
        # Search outward from the stated line, as `patch` does, so small offsets apply.
        at = None
        for delta in range(0, len(src) + 1):
            for cand in (want + delta, want - delta):
                if pos <= cand <= len(src) - len(old) and src[cand:cand + len(old)] == old:
                    at = cand
                    break
            if at is not None:
                break
        if at is None:
            raise PatchError(f"{fp.path}: hunk '{hunk.header}' does not apply")
        out.extend(src[pos:at])
        out.extend(new)
        pos = at + len(old)
    out.extend(src[pos:])
    return "\n".join(out) + ("\n" if trailing_nl and out else "")


def apply_unified_diff(diff_text: str, read_file: Callable[[str], str]) -> dict[str, str]:
    """Return ``{relative_path: patched_text}`` for every file the diff touches.

    ``read_file(path)`` supplies the original text of a repository-relative path
    (raise FileNotFoundError for a file the target does not have).
    """
    result: dict[str, str] = {}
    for fp in parse_unified_diff(diff_text):
        if fp.new_file:
            original = ""
        else:
            try:
                original = result.get(fp.path) if fp.path in result else read_file(fp.path)
            except FileNotFoundError:
                raise PatchError(f"{fp.path}: the patched file does not exist in the target") from None
        result[fp.path] = _apply_file(fp, original)
    return result

"""Apply upstream-style unified diffs (``git diff`` format) to copies of source files.

kvspec never writes a target's installed files. A patch is applied in memory to the
text of the files it names, and the patched text is imported from a temporary
directory in the original module's place (see ``kvspec.targets.loading``).

A diff is untrusted input (a pull request checked in CI), so this module is the one
place that decides whether a diff is safe to apply, for every target and command:
``parse_unified_diff`` refuses, before anything is written, every path that is
absolute or has a ``..`` component, binary patches, symbolic links and other file
types, and renames or copies (which kvspec does not apply); ``read_inside`` and
``write_inside`` refuse to read or write through a symbolic link that leads out of
the tree. Each refusal is one line (a ``PatchError``: exit code 2).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_BINARY = re.compile(r"^Binary files (.*) and (.*) differ$")
# Git's modes for a regular file; 120000 is a symbolic link, 160000 a submodule.
REGULAR_MODES = frozenset({"100644", "100755", "100664"})
_MODE_NAMES = {"120000": "a symbolic link", "160000": "a submodule (gitlink)", "040000": "a directory"}


from kvspec.errors import PatchError  # noqa: E402  (re-exported: raised here)


@dataclass
class _Hunk:
    old_start: int
    header: str
    lines: list[str] = field(default_factory=list)  # each starts with ' ', '-' or '+'


@dataclass
class FilePatch:
    path: str  # relative to the repository root, a/ and b/ prefixes removed, validated
    hunks: list[_Hunk]
    new_file: bool = False


_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
            "\\": "\\", '"': '"'}


def _unquote(name: str) -> str:
    """Git writes a path with special characters C-quoted: ``"a/caf\\303\\251.py"``."""
    if not (len(name) >= 2 and name[0] == '"' and name[-1] == '"'):
        return name
    out = bytearray()
    body, i = name[1:-1], 0
    while i < len(body):
        c = body[i]
        if c == "\\" and i + 1 < len(body):
            nxt = body[i + 1]
            if nxt in "01234567" and re.match(r"[0-7]{3}", body[i + 1:i + 4]):
                out.append(int(body[i + 1:i + 4], 8) & 0xFF)
                i += 4
                continue
            out += _ESCAPES.get(nxt, nxt).encode()
            i += 2
            continue
        out += c.encode()
        i += 1
    return out.decode("utf-8", "replace")


def _header_name(raw: str) -> str:
    """The file name of a ``---``/``+++`` line: a timestamp after a tab removed, git's
    quoting undone, and the ``a/``/``b/`` prefix stripped."""
    raw = raw.rstrip("\r\n")
    if raw.startswith('"'):
        end = raw.find('"', 1)
        while end > 0 and raw[end - 1] == "\\":
            end = raw.find('"', end + 1)
        raw = raw[:end + 1] if end > 0 else raw
    else:
        raw = raw.split("\t", 1)[0].rstrip()
    name = _unquote(raw)
    if name.startswith(("a/", "b/")):
        name = name[2:]
    return name


def safe_path(name: str) -> str:
    """``name`` as a normalized relative path (``/``-separated, no ``.`` or empty
    components), or a one-line PatchError when it could leave the tree it is relative to:
    an absolute path, a ``..`` component, a drive letter, a backslash or a NUL byte."""
    shown = name if len(name) < 200 else name[:200] + "..."
    if not name:
        raise PatchError("a file name in the diff is empty")
    if "\0" in name:
        raise PatchError(f"{shown!r}: a file name with a NUL byte is refused")
    if name.startswith(("/", "\\", "~")) or re.match(r"^[A-Za-z]:", name):
        raise PatchError(f"{shown}: an absolute path is refused (diff paths are relative to the repository root)")
    if "\\" in name:
        raise PatchError(f"{shown}: a path with a backslash is refused")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise PatchError(f"{shown}: a path with a '..' component is refused")
    if not parts:
        raise PatchError(f"{shown}: not a file path")
    return "/".join(parts)


def _git_pair(rest: str) -> list[str]:
    """The two names of a ``diff --git A B`` line (quoted, or split where they agree)."""
    rest = rest.strip()
    names: list[str] = []
    while rest:
        if rest.startswith('"'):
            end = 1
            while end < len(rest) and not (rest[end] == '"' and rest[end - 1] != "\\"):
                end += 1
            names.append(rest[:end + 1])
            rest = rest[end + 1:].strip()
        else:
            if not names and rest.count(" ") and not rest.endswith('"'):
                # "a/x y b/x y": the halves agree for a plain change; else split at " b/".
                half = len(rest) // 2
                if rest[half] == " " and rest[:half][2:] == rest[half + 1:][2:]:
                    names += [rest[:half], rest[half + 1:]]
                    break
                cut = rest.rfind(" b/")
                if cut > 0:
                    names += [rest[:cut], rest[cut + 1:]]
                    break
            first, _, rest = rest.partition(" ")
            names.append(first)
            rest = rest.strip()
    out = []
    for n in names:
        n = _unquote(n)
        out.append(n[2:] if n.startswith(("a/", "b/")) else n)
    return out


def _check_mode(what: str, mode: str, path: str) -> None:
    if mode not in REGULAR_MODES:
        kind = _MODE_NAMES.get(mode, f"file mode {mode}")
        raise PatchError(f"{path}: '{what} {mode}' ({kind}) is refused: kvspec applies text changes "
                         f"to regular files only")


def _extended_header(line: str, current: str) -> None:
    """Refuse what kvspec cannot apply safely in a git extended header line."""
    for what in ("new file mode", "deleted file mode", "old mode", "new mode"):
        if line.startswith(what + " "):
            _check_mode(what, line[len(what) + 1:].strip(), current)
            return
    for what in ("rename from", "rename to", "copy from", "copy to"):
        if line.startswith(what + " "):
            target = safe_path(_unquote(line[len(what) + 1:].strip()))
            raise PatchError(f"{target}: '{what}' is refused: kvspec applies changes to a file's text in place, "
                             f"never renames or copies")
    if line.startswith("GIT binary patch") or _BINARY.match(line.rstrip()):
        raise PatchError(f"{current}: a binary patch is refused: kvspec applies text diffs only")


def parse_unified_diff(text: str) -> list[FilePatch]:
    """Parse a unified diff into per-file hunks. Raises PatchError on malformed input."""
    patches: list[FilePatch] = []
    lines = text.splitlines()
    i = 0
    current = "the diff"  # the file the extended header lines are about, for messages
    while i < len(lines):
        line = lines[i]
        if line.startswith("diff --git "):
            names = [safe_path(n) for n in _git_pair(line[len("diff --git "):])]
            current = names[-1] if names else current
            i += 1
            continue
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            old, new = _header_name(line[4:]), _header_name(lines[i + 1][4:])
            if old == "/dev/null" and new == "/dev/null":
                raise PatchError("a file header names /dev/null twice")
            old = old if old == "/dev/null" else safe_path(old)
            new = new if new == "/dev/null" else safe_path(new)
            # The old name is only checked (a plain ``diff -u x.py.orig x.py`` names two):
            # the new one is what is read and written.
            fp = FilePatch(path=new if new != "/dev/null" else old, hunks=[], new_file=old == "/dev/null")
            patches.append(fp)
            current = fp.path
            i += 2
            continue
        _extended_header(line, current)
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


def require_under(patches: Iterable[FilePatch], prefix: str, where: str) -> None:
    """Refuse (one line) any file of the diff outside the tree at ``prefix`` (a
    repository-relative directory such as ``vllm/``): the target's tree."""
    top = [p for p in prefix.strip("/").split("/") if p]
    one_file = bool(prefix) and not prefix.endswith("/")  # "mod.py": that file only
    for fp in patches:
        parts = fp.path.split("/")
        if (parts != top) if one_file else (parts[:len(top)] != top or len(parts) <= len(top)):
            raise PatchError(f"{fp.path}: not under {prefix} (diff paths are relative to {where})")


def _inside(path: Path, tree: Path) -> bool:
    try:
        path.relative_to(tree)
        return True
    except ValueError:
        return False


def _escaping_link(tree: Path, rel: str) -> Optional[str]:
    """The first component of ``tree/rel`` that is a symbolic link resolving outside
    ``tree``, or None."""
    real_tree = tree.resolve()
    at = tree
    for part in rel.split("/"):
        at = at / part
        if at.is_symlink() and not _inside(at.resolve(), real_tree):
            return str(at.relative_to(tree))
    return None


def read_inside(tree: Path, rel: str) -> str:
    """The text of ``tree/rel``; FileNotFoundError when it is not a file, a PatchError
    when a symbolic link on the way leads out of ``tree``."""
    rel = safe_path(rel)
    link = _escaping_link(tree, rel)
    if link is not None:
        raise PatchError(f"{rel}: {link} is a symbolic link leading out of the target's tree: refused")
    f = tree / rel
    if not f.is_file():
        raise FileNotFoundError(rel)
    return f.read_text()


def write_inside(tree: Path, rel: str, text: str) -> Path:
    """Write ``text`` to ``tree/rel`` (``tree``: kvspec's private copy), creating its
    directories; refuse (PatchError) to write through any symbolic link, so nothing
    lands outside the copy whatever the copy holds."""
    rel = safe_path(rel)
    at = tree
    for part in rel.split("/"):
        at = at / part
        if at.is_symlink():
            raise PatchError(f"{rel}: {at.relative_to(tree)} is a symbolic link in the copy: kvspec writes "
                             f"no file through a link")
    out = tree / rel
    out.parent.mkdir(parents=True, exist_ok=True)
    # O_NOFOLLOW: a link that appeared since the check is still never followed.
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return out


def apply_unified_diff(diff_text: str, read_file: Callable[[str], str], under: Optional[str] = None,
                       where: str = "the repository root") -> dict[str, str]:
    """Return ``{relative_path: patched_text}`` for every file the diff touches, all in
    memory (nothing is written here).

    ``read_file(path)`` supplies the original text of a repository-relative path
    (raise FileNotFoundError for a file the target does not have). ``under``: every
    path must lie in that repository directory (the target's tree), checked before any
    file is read.
    """
    result: dict[str, str] = {}
    patches = parse_unified_diff(diff_text)
    if under is not None:
        require_under(patches, under, where)
    for fp in patches:
        if fp.new_file:
            original = ""
        else:
            try:
                original = result.get(fp.path) if fp.path in result else read_file(fp.path)
            except FileNotFoundError:
                raise PatchError(f"{fp.path}: the patched file does not exist in the target") from None
        result[fp.path] = _apply_file(fp, original)
    return result

"""Import a patched *copy* of a package, leaving the installed files untouched.

The package directory is copied to a temporary directory, the diff is applied to
the copy, and the copy is imported under a fresh alias so that it can live beside
the original in one process (relative imports inside the package follow the alias).
"""
from __future__ import annotations

import atexit
import hashlib
import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path
from types import ModuleType

from kvspec.patching import PatchError, apply_unified_diff, parse_unified_diff, read_inside, write_inside

_tmp: Path | None = None


def _tmp_dir() -> Path:
    """One temporary directory per process, created on first use, removed at exit."""
    global _tmp
    if _tmp is None:
        _tmp = Path(tempfile.mkdtemp(prefix="kvspec-patched-"))
        atexit.register(shutil.rmtree, _tmp, True)
    return _tmp


def use_own_tmp_dir() -> None:
    """In a forked worker: make the next patched copy go to a directory of this
    process's own (under ``tempfile.tempdir``) instead of the parent's. Forked workers
    leave through ``os._exit``, which runs no atexit handler, so the worker removes it
    with ``remove_tmp_dir`` (and its parent removes ``tempfile.tempdir`` in case the
    worker was killed)."""
    global _tmp
    _tmp = None


def remove_tmp_dir() -> None:
    """Remove this process's directory of patched copies now (it is recreated on demand)."""
    global _tmp
    if _tmp is not None:
        shutil.rmtree(_tmp, True)
        _tmp = None


def read_patch(path: str) -> str:
    """The text of a diff file, validated (``kvspec.patching``: no absolute or ``..``
    path, no binary patch, link or mode kvspec cannot honour); anything that is not a
    readable UTF-8 text file (a directory, a binary file, a missing one) or a safe diff
    is a one-line PatchError, raised before anything is written."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise PatchError(f"cannot read patch {path}: {e.strerror or e}") from None
    if b"\0" in data:
        raise PatchError(f"patch {path} is a binary file, not a unified diff")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PatchError(f"patch {path} is not UTF-8 text (byte {e.start}): not a unified diff") from None
    parse_unified_diff(text)
    return text


def import_patched_copy(package_dir: Path, repo_prefix: str, diff_text: str, alias_stem: str) -> ModuleType:
    """Copy ``package_dir`` (which lives at ``repo_prefix`` in its repository), apply
    ``diff_text`` to the copy and import it as a new top-level package.

    The diff is validated and applied in memory first (every path under
    ``repo_prefix``, no link out of the package read), then the copy is made in
    kvspec's private temporary directory and written only through ``write_inside``;
    a refusal removes the copy again."""
    prefix = repo_prefix.rstrip("/") + "/"
    alias = f"_kvspec_{alias_stem}_{hashlib.sha1(diff_text.encode()).hexdigest()[:10]}"
    if alias in sys.modules:
        return sys.modules[alias]
    texts = apply_unified_diff(diff_text, lambda rel: read_inside(package_dir, rel[len(prefix):]), under=prefix)
    dest = _tmp_dir() / alias
    if not dest.exists():
        try:
            # Links are copied as links, so that write_inside sees (and refuses) them.
            shutil.copytree(package_dir, dest, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
            for rel, text in texts.items():
                write_inside(dest, rel[len(prefix):], text)
        except BaseException:
            shutil.rmtree(dest, True)
            raise
    spec = importlib.util.spec_from_file_location(alias, dest / "__init__.py", submodule_search_locations=[str(dest)])
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[alias] = module
    try:
        spec.loader.exec_module(module)
    except Exception:
        del sys.modules[alias]
        raise
    return module

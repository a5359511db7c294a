"""Replay a step list on a fresh allocator: what every repro file calls.

Where the target comes from (``kvspec.check.repro``'s "Run from anywhere"): a string
target is ``KVSPEC_TARGET`` when that is set (relative to the current directory);
otherwise, given ``origin=(repro file, RAN_IN)``, a ``FILE.py:NAME`` target is loaded
with the directory ``kvspec check`` ran in as the current directory (found from the
repro file's own location first, then by its absolute path), so that the file, and a
patch's paths, mean what they meant there. Without either it is loaded as given.
"""
from __future__ import annotations

import hashlib
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

from kvspec.spec.config import Config
from kvspec.spec.invariants import title
from kvspec.spec.ops import Op
from kvspec.check.session import Outcome, run_steps
from kvspec.targets.base import Target, TargetError
from kvspec.targets.registry import load_target

TARGET_ENV = "KVSPEC_TARGET"
_KEEP = object()  # replay's op_timeout when not given: the one in force (watchdog.default())


def _file_of(spec: str) -> Optional[str]:
    """The FILE of a ``FILE.py:NAME`` spec, else None."""
    where, sep, name = spec.rpartition(":")
    return where if sep and where.endswith(".py") and name else None


def load_dir(spec: str, origin: Optional[tuple]) -> Optional[Path]:
    """The directory to load ``spec`` from: ``origin`` is ``(repro file, (relative, absolute))``,
    ``RAN_IN`` as the repro file records it. None: the current directory."""
    where = _file_of(spec)
    if origin is None or where is None or Path(where).is_absolute():
        return None
    repro_file, (rel, absolute) = origin
    bases = ([Path(repro_file).resolve().parent / rel] if rel else []) + ([Path(absolute)] if absolute else [])
    for base in bases:
        if (base / where).is_file():
            return base.resolve()
    return None


@contextmanager
def _cwd(path: Optional[Path]) -> Iterator[None]:
    if path is None:
        yield
        return
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def _target(target: Union[str, Target], patch: Optional[str], patch_text: Optional[str],
            origin: Optional[tuple] = None) -> Target:
    if isinstance(target, Target):
        return target
    override = os.environ.get(TARGET_ENV, "").strip()
    if patch_text and patch is None:
        from kvspec.targets.patched import _tmp_dir

        # the per-process directory removed at exit, so repeated replays leave nothing behind
        path = _tmp_dir() / f"repro-{hashlib.sha1(patch_text.encode()).hexdigest()[:12]}.diff"
        path.write_text(patch_text)
        patch = str(path)
    elif patch and Path(patch).exists():
        patch = str(Path(patch).resolve())  # a KVSPEC_PATCH named from the current directory stays found
    spec = override or target
    base = None if override else load_dir(spec, origin)
    try:
        with _cwd(base):
            return load_target(spec, patch=patch)
    except TargetError as e:
        if override or origin is None or _file_of(spec) is None:
            raise
        raise TargetError(f"{e} (not found from the directory kvspec check ran in, {origin[1][1]}, either; "
                          f"set {TARGET_ENV}=FILE.py:NAME to name the target)") from None


def replay_outcome(target: Union[str, Target], config: Union[dict, Config], steps: Sequence[Op],
                   patch: Optional[str] = None, patch_text: Optional[str] = None,
                   assume: Optional[dict] = None, op_timeout: Any = _KEEP,
                   origin: Optional[tuple] = None) -> Outcome:
    """Where ``steps`` fails (kvspec.check.session.Outcome). ``op_timeout``: seconds per
    target call (None: no limit; not given: the one in force). ``origin``: see the module doc."""
    from kvspec.targets import watchdog

    cfg = config if isinstance(config, Config) else Config(**config)
    saved = watchdog.default()
    if op_timeout is not _KEEP:
        watchdog.set_default(op_timeout)
    try:
        t = _target(target, patch, patch_text, origin)
        if assume:  # a repro found under a policy hint's assumption (kvspec.check.hints) replays under it
            from kvspec.check.hints import assuming
            t = assuming(t, assume)
        return run_steps(t, cfg, steps)
    finally:
        watchdog.set_default(saved)


def replay(target: Union[str, Target], config: Union[dict, Config], steps: Sequence[Op],
           patch: Optional[str] = None, patch_text: Optional[str] = None, assume: Optional[dict] = None,
           op_timeout: Any = _KEEP, origin: Optional[tuple] = None) -> None:
    """Run ``steps``, checking every invariant after each; raise AssertionError at the first violation.
    ``assume``: policies assumed on a hint's word (never the target's declaration). ``op_timeout``
    and ``origin``: see ``replay_outcome``."""
    out = replay_outcome(target, config, steps, patch, patch_text, assume, op_timeout, origin)
    if out.failed:
        v = out.violations[0]
        where = "at construction" if out.index == -1 else f"at step {out.index + 1} ({steps[out.index]!r})"
        printed = f"\n  the target printed (last {len(v.target_output)} characters):\n" + \
            "\n".join("    " + line for line in v.target_output.splitlines()) if v.target_output else ""
        raise AssertionError(f"{title(v.invariant)} {where}: "
                             f"{v.message}\n  state: {v.excerpt}{printed}")

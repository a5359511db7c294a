"""Write a failing step list as a standalone pytest file a maintainer could commit.

The file needs nothing but kvspec and the target. It embeds the step list, the
configuration and, when there was one, the patch text, so it replays anywhere.
``KVSPEC_PATCH=none`` replays it on the unpatched target, ``KVSPEC_PATCH=x.diff``
on another patch (a fix, say).

Run from anywhere. ``TARGET`` is written as it was given (``FILE.py:NAME`` relative to
the directory ``kvspec check`` ran in), and ``RAN_IN`` records that directory twice:
relative to the repro file and absolute. ``replay`` loads the target from there (the
relative form first, so a checkout moved or cloned elsewhere with its repros still
works), whatever the current directory; ``KVSPEC_TARGET=FILE.py:NAME`` names another
target instead (relative to the current directory). ``OP_TIMEOUT`` is the op timeout
the finding was made under, so a ``NO_HANG`` repro hangs, and fails, as it did.
"""
from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Optional, Sequence

from kvspec.atomic_write import write_atomic
from kvspec.spec.config import Config
from kvspec.spec.invariants import title
from kvspec.spec.model import model_for
from kvspec.spec.ops import Op
from kvspec.targets.base import Target


def _annotations(target: Target, config: Config, steps: Sequence[Op]) -> list[str]:
    """What the reference model says each step should do, as a trailing comment (none
    at the engine level: the engine decides what each event does)."""
    if config.level == "engine":
        return [""] * len(steps)
    model = model_for(config, target.traits)
    notes = []
    for op in steps:
        why = model.misuse_reason(op)
        if why is not None:
            notes.append(f"misuse: {why}")
            continue
        r = model.apply(op)
        notes.append("" if r is None else f"-> {list(r) if isinstance(r, tuple) else r}")
    return notes


def ran_in(repro_dir: Path) -> tuple[Optional[str], str]:
    """The current directory (where ``kvspec check`` runs), relative to ``repro_dir`` and absolute."""
    here = Path.cwd().resolve()
    try:
        rel: Optional[str] = Path(os.path.relpath(here, repro_dir.resolve())).as_posix()
    except ValueError:  # another drive (Windows): only the absolute path
        rel = None
    return rel, str(here)


# Written beside the repros: a plain ``pytest`` of the project skips them (a finding is
# not a test of the project's own), and naming a file or this directory runs them.
CONFTEST = '''"""Written by kvspec. The repro files here run only when named, e.g.
``python -m pytest reports/repros/test_x.py`` or ``python -m pytest reports/repros``;
a plain ``pytest`` of the project does not collect them. Delete this file to collect them always."""
from pathlib import Path


def pytest_ignore_collect(collection_path, config):
    here = Path(__file__).resolve().parent
    path = Path(collection_path).resolve()
    if path.parent != here or not path.name.startswith("test_") or path.suffix != ".py":
        return None
    named = {Path(str(a).split("::")[0]).resolve() for a in config.args}
    return None if (path in named or here in named) else True
'''


def keep_out_of_collection(directory: Path) -> None:
    """Write ``CONFTEST`` into a repro directory that has no conftest.py (never replaced:
    one of the user's own is left alone)."""
    conftest = directory / "conftest.py"
    if not conftest.exists():
        try:
            conftest.write_text(CONFTEST)
        except OSError:  # the repro itself is what matters; its write reports the problem
            pass


def minimal_note(minimal: Optional[bool], level: str, kind: str = "violation", invariant: str = "") -> str:
    """Whether the steps are proven minimal, and why (not): every repro says which."""
    if minimal:
        return "minimal: true (a breadth-first search over every shorter sequence found none that fails)"
    why = ("at the engine level the engine decides what each event does, and the search that proves a "
           "length minimal enumerates pool and cache operations only" if level == "engine" else
           "misuse operations are outside the search that proves a length minimal" if kind != "violation" else
           "a hang is cut down by ddmin alone: every try costs the op timeout" if invariant == "NO_HANG" else
           "the search that proves a length minimal stopped at its bound before it could, or the "
           "finding did not replay on its own")
    return f"minimal: not proven ({why}; ddmin cut it down)"


def write_repro(directory: str | Path, target_spec: str, target: Target, config: Config, steps: Sequence[Op],
                invariant: str, message: str, *, patch_text: Optional[str] = None, patch_name: Optional[str] = None,
                command: str = "", minimal: Optional[bool] = None, kind: str = "violation") -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    keep_out_of_collection(directory)
    digest = hashlib.sha1(repr((target_spec, patch_text, config, list(steps))).encode()).hexdigest()[:8]
    safe = re.sub(r"[^A-Za-z0-9]+", "_", target_spec).strip("_").lower()
    path = directory / f"test_{safe}_{invariant.lower()}_{digest}.py"
    label = title(invariant)
    ops = sorted({type(op).__name__ for op in steps})
    notes = _annotations(target, config, steps)
    lines: list[str] = []
    w = lines.append
    w(f'"""kvspec repro: {label} on target {target_spec!r}'
      + (f" with patch {patch_name}" if patch_name else "") + ".")
    w("")
    w(message.replace('"""', "'''"))
    w("")
    if command:
        w(f"Found by: {command}")
    w(f"{len(steps)} steps, {minimal_note(minimal, config.level, kind, invariant)}"
      + (f"; {kind} finding" if kind != "violation" else "") + ".")
    w("Replays the steps on a fresh allocator and checks every invariant after each one.")
    from kvspec.targets.policies import declaration_of
    w(f"Declaration: {declaration_of(target)}.")
    assumed = dict(getattr(target.traits, "assumed", ()))
    if assumed:
        w("Assuming (a policy hint's word, not the declaration): "
          + ", ".join(f"{k} = {v!r}" for k, v in assumed.items()) + ".")
    if patch_text:
        w("KVSPEC_PATCH=none replays on the unpatched target; KVSPEC_PATCH=other.diff on another patch.")
    w("Runs from any directory: TARGET is loaded from RAN_IN; KVSPEC_TARGET=FILE.py:NAME names another target.")
    w('"""')
    w("import os")
    w("")
    w(f"from kvspec.spec.ops import {', '.join(ops)}" if ops else "")
    w("from kvspec.check.replay import replay")
    w("")
    from kvspec.targets import watchdog
    w(f"TARGET = {target_spec!r}")
    w(f"RAN_IN = {ran_in(directory)!r}  # where kvspec check ran: from this file, and absolute")
    w(f"OP_TIMEOUT = {watchdog.default()!r}  # seconds per target call it ran under (None: no limit)")
    w(f"CONFIG = {config.to_dict()!r}")
    if assumed:
        w(f"ASSUME = {assumed!r}")
    if patch_text:
        w(f"PATCH_TEXT = {patch_text!r}")
    w("STEPS = [")
    for op, note in zip(steps, notes):
        w(f"    {op!r},{'  # ' + note if note else ''}")
    w("]")
    w("")
    w("")
    w(f"def test_{invariant.lower()}_{kind}():")
    more = (", assume=ASSUME" if assumed else "") + ", op_timeout=OP_TIMEOUT, origin=(__file__, RAN_IN)"
    if patch_text:
        w('    env = os.environ.get("KVSPEC_PATCH")')
        w('    if env is None:')
        w(f'        replay(TARGET, CONFIG, STEPS, patch_text=PATCH_TEXT{more})')
        w('    else:')
        w(f'        replay(TARGET, CONFIG, STEPS, patch=None if env.lower() == "none" else env{more})')
    else:
        w('    env = os.environ.get("KVSPEC_PATCH")')
        w(f'    replay(TARGET, CONFIG, STEPS, patch=None if env in (None, "", "none") else env{more})')
    write_atomic(path, "\n".join(lines) + "\n")
    return path

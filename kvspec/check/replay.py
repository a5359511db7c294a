"""Replay a step list on a fresh allocator: what every repro file calls."""
from __future__ import annotations

import hashlib
from typing import Optional, Sequence, Union

from kvspec.spec.config import Config
from kvspec.spec.invariants import title
from kvspec.spec.ops import Op
from kvspec.check.session import Outcome, run_steps
from kvspec.targets.base import Target
from kvspec.targets.registry import load_target


def _target(target: Union[str, Target], patch: Optional[str], patch_text: Optional[str]) -> Target:
    if isinstance(target, Target):
        return target
    if patch_text and patch is None:
        from kvspec.targets.patched import _tmp_dir

        # the per-process directory removed at exit, so repeated replays leave nothing behind
        path = _tmp_dir() / f"repro-{hashlib.sha1(patch_text.encode()).hexdigest()[:12]}.diff"
        path.write_text(patch_text)
        patch = str(path)
    return load_target(target, patch=patch)


def replay_outcome(target: Union[str, Target], config: Union[dict, Config], steps: Sequence[Op],
                   patch: Optional[str] = None, patch_text: Optional[str] = None,
                   assume: Optional[dict] = None) -> Outcome:
    cfg = config if isinstance(config, Config) else Config(**config)
    t = _target(target, patch, patch_text)
    if assume:  # a repro found under a policy hint's assumption (kvspec.check.hints) replays under it
        from kvspec.check.hints import assuming
        t = assuming(t, assume)
    return run_steps(t, cfg, steps)


def replay(target: Union[str, Target], config: Union[dict, Config], steps: Sequence[Op],
           patch: Optional[str] = None, patch_text: Optional[str] = None, assume: Optional[dict] = None) -> None:
    """Run ``steps``, checking every invariant after each; raise AssertionError at the first violation.
    ``assume``: policies assumed on a hint's word (never the target's declaration)."""
    out = replay_outcome(target, config, steps, patch, patch_text, assume)
    if out.failed:
        v = out.violations[0]
        where = "at construction" if out.index == -1 else f"at step {out.index + 1} ({steps[out.index]!r})"
        raise AssertionError(f"{title(v.invariant)} {where}: "
                             f"{v.message}\n  state: {v.excerpt}")

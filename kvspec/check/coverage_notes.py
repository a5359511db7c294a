"""What a passing ``--patch`` run never called: each public method the diff changes that
no level of the run called, with the level that does call it (from the run's own levels,
else a short seeded probe). Kept apart from ``coverage`` (the counting the session does on
every step) because the probe runs a search: the session must not import the search.
"""
from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path
from typing import Any, Optional

from kvspec.check import coverage


def _source_of(rel: str) -> Optional[Path]:
    """The installed file a diff path names (vllm/..., impl/...), or None."""
    parts = Path(rel).parts
    if not parts:
        return None
    if parts[0] in ("impl", "kvspec"):
        from kvspec.targets.impl_target import ImplTarget
        tail = parts[1:] if parts[0] == "impl" else parts[2:] if len(parts) > 2 and parts[1] == "impl" else ()
        return ImplTarget.package_dir().joinpath(*tail) if tail else None
    try:
        spec = importlib.util.find_spec(parts[0])
    except (ImportError, ValueError):
        return None
    locs = list(getattr(spec, "submodule_search_locations", None) or []) if spec else []
    return Path(locs[0]).joinpath(*parts[1:]) if locs else None


def changed_functions(patch_text: str) -> list[str]:
    """``Class.method`` (or ``function``) of each installed function a diff changes: the
    diff applied in memory (``kvspec.patching``) to the installed file, compared function
    by function (``crosshair.changed_functions``, docstrings ignored)."""
    from kvspec.check.crosshair import changed_functions as changed
    from kvspec.errors import PatchError
    from kvspec.patching import apply_unified_diff

    originals: dict[str, str] = {}

    def read(rel: str) -> str:
        src = _source_of(rel)
        if src is None or not src.is_file():
            raise FileNotFoundError(rel)
        originals[rel] = src.read_text()
        return originals[rel]

    try:
        patched = apply_unified_diff(patch_text, read)
    except PatchError:  # a file the run did not load from here, or a hunk that does not apply
        return []
    out: list[str] = []
    for rel, text in patched.items():
        if rel in originals:
            out.extend(f for f in changed(originals[rel], text) if f not in out)
    return out


def uncalled_notes(target: Any, patch_text: Optional[str], cov: dict, probe: bool = True) -> list[str]:
    """For a passing patch run: one line per changed function no level of the run called,
    with the level that does call it (from this run's levels, else a short probe)."""
    if not patch_text or not cov:
        return []
    notes = []
    for fn in changed_functions(patch_text):
        key = fn.split(".")[-1]
        if "." not in fn or key.startswith("_"):  # only public methods are counted: nothing to say
            continue
        def called(level_cov: dict) -> bool:
            return any(m == fn or m.endswith("." + key) for m in level_cov.get("methods_called", {}))
        if any(called(c) for c in cov.values()):
            continue
        ran = ", ".join(cov)
        where = [lv for lv, c in cov.items() if called(c)]
        if not where and probe:
            where = [lv for lv in _other_levels(target, cov) if _probe_calls(target, lv, key)]
        does = (f"the {where[0]} level does (--level {where[0]})" if where
                else "no level kvspec drove called it")
        notes.append(f"the {ran} level{'s' if len(cov) > 1 else ''} never called {key}; {does}")
    return notes


def _other_levels(target: Any, cov: dict) -> list[str]:
    levels = [lv for lv in getattr(target.traits, "levels", ("pool", "cache")) if lv not in cov]
    try:
        from kvspec.engine.drivers import supports_engine
        if "engine" not in cov and "engine" not in levels and supports_engine(target):
            levels.append("engine")
    except Exception:  # no engine level for this target
        pass
    return levels


PROBE_EXAMPLES = 10


def _probe_calls(target: Any, level: str, method: str) -> bool:
    """Whether ``PROBE_EXAMPLES`` seeded examples at ``level`` call ``method`` (a finding
    on the way is ignored: only the calls are asked about)."""
    from kvspec.check.search import LevelSearch

    saved_ops, saved_calls = Counter(coverage._OPS), Counter(coverage._CALLS)
    try:
        LevelSearch(target, level, misuse=False, seed=0).run_batch(PROBE_EXAMPLES)
        return any(lv == level and m.endswith("." + method) for (lv, m) in coverage._CALLS)
    except Exception:
        return False
    finally:
        coverage._OPS.clear(), coverage._OPS.update(saved_ops)
        coverage._CALLS.clear(), coverage._CALLS.update(saved_calls)


def for_report(report: Any, target: Any, patch_text: Optional[str]) -> dict:
    """The coverage a report carries (``report.coverage``): per level, and the notes."""
    cov = coverage.snapshot(report.levels)
    passed = not report.violations and not getattr(report, "interrupted", None) and not getattr(report, "error", None)
    return {"levels": cov, "notes": uncalled_notes(target, patch_text, cov) if passed else []}

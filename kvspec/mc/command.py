"""``kvspec mc``: exhaustive bounded model checking from the command line.

    kvspec mc [--target T] [--patch DIFF] [--level pool|cache] [--blocks N] [--depth D]
              [--requests R] [--kv-groups G] [--max-model-len N] [--time-cap S] [--mem-cap GIB] [--json] [--report-dir DIR]
              [--symmetry on|off] [--fork auto|compact|pickle|deepcopy|replay|driver]
              [--workers N] [--check-once on|off]

``--blocks`` counts usable blocks (the null block comes on top where the target has
one); the cache level uses block size 2. The domains are ``kvspec.mc.enumerate_ops``'s
defaults (``Bounds``), with ``--requests`` live requests at most.

Exit codes: 0 when the search found nothing, whether it was complete (verdict
``pass``) or stopped at the time or memory cap (verdict ``incomplete``: never reported
as a pass; the JSON says how far it got); 1 when it found a violation (the shortest
counterexample, also written as a standalone pytest repro); 2 on a usage or target
error (a configuration whose one state would not fit ``--mem-cap`` among them:
``kvspec.mc.budget``); 130 or 143 when Ctrl-C or SIGTERM stopped a search that found
nothing, after printing what it reached (verdict ``incomplete``, ``interrupted``).
Without ``--level``, the level the target supports (pool where it has it, else cache).
``--workers`` beyond the CPU count is capped, with a note.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

from kvspec.atomic_write import write_atomic
from kvspec.spec.config import Config
from kvspec.mc.enumerate_ops import Bounds
from kvspec.spec.invariants import title
from kvspec.mc.search import MCResult, confirm, model_check
from kvspec.check.repro import write_repro
from kvspec.targets.base import TargetError

DEFAULT_BLOCK_SIZE = 2


def _text(a: argparse.Namespace, r: MCResult, declaration: str = "") -> str:
    head = (f"kvspec mc: {r.verdict} on target {a.target}" + (f" with patch {a.patch}" if a.patch else "")
            + f" ({r.config.level} level, {a.blocks} usable blocks"
            + (f", {a.requests} requests" if r.config.level == "cache" else "") + f", depth {r.max_depth})")
    lines = [head,
             f"  {r.states:,} states, {r.transitions:,} transitions, depth {r.depth} explored"
             + (" (every reachable state seen)" if r.exhausted else "")
             + f", {r.seconds:.2f} s, {r.states_per_second:,.0f} states/s, "
             f"{r.transitions_per_second:,.0f} transitions/s (fork: {r.fork or 'not chosen yet'}"
             + (f", {r.workers} workers" if r.workers > 1 else "")
             + (f", states kept packed from depth {r.packed_from}" if r.packed_from is not None else "") + ")"]
    if r.collision is not None:
        # as TLC prints them (kvspec.mc.fingerprint.collision_odds)
        c = r.collision
        lines.append(f"  seen set: {c['fingerprints']:,} 64-bit fingerprints ({r.seen_bytes / 2 ** 20:.1f} MiB); "
                     f"probability of a fingerprint collision: optimistic {c['optimistic']:.2g}"
                     + (f", from the actual fingerprints {c['actual']:.2g}" if c.get("actual") is not None else "")
                     + (f"; levels on disk from depth {r.disk_from}" if r.disk_from is not None else ""))
    if declaration:
        lines.insert(1, f"  declaration: {declaration}")
    if r.verdict == "incomplete":
        lines.append(f"  incomplete: {r.reason}; no claim beyond depth {r.depth} (the counts above are partial)")
    if r.verdict == "violation":
        v = r.violations[0]
        lines.append(f"  {title(v.invariant)}: {v.message}")
        lines.append(f"  shortest counterexample, {len(r.counterexample or [])} steps:")
        lines += [f"    {i + 1}. {op!r}" for i, op in enumerate(r.counterexample or [])] or ["    (fails at construction)"]
        lines.append(f"  state: {v.excerpt}")
        if r.repro:
            lines.append(f"  repro: {r.repro}")
    return "\n".join(lines)


def _caching(a: argparse.Namespace, target) -> bool:
    """``--caching``, checked against the modes the target declares (Traits.prefix_caching)."""
    from kvspec.errors import UsageError
    modes = getattr(target.traits, "caching_modes", (True,))
    want = getattr(a, "caching", None)
    if want is None:
        return True if True in modes else False
    if (want == "on") not in modes:
        raise UsageError(f"kvspec mc: target {target.name} does not support prefix caching {want} "
                         f"(it declares prefix_caching = {getattr(target.traits, 'prefix_caching', 'on')!r})")
    return want == "on"


def _level(a: argparse.Namespace, target) -> str:
    """``--level``, or where it is not given the level the target supports (pool first),
    as ``kvspec check`` runs every level the target supports: a nano-style target has
    only the cache level."""
    supported = list(target.traits.levels)
    if a.level is None:
        for level in ("pool", "cache"):
            if level in supported:
                return level
    elif a.level in supported:
        return a.level
    raise TargetError(f"target {target.name} does not support the {a.level or 'pool or cache'} level "
                      f"(it supports: {', '.join(supported)})")


def _workers(n: int) -> int:
    """``--workers``, at most the CPU count: more processes than cores only share them."""
    cores = os.cpu_count() or 1
    if n > cores:
        print(f"kvspec mc: note: --workers {n} is more than the {cores} CPU cores; using {cores}", file=sys.stderr)
        return cores
    return n


def _distributed(a: argparse.Namespace, config: Config, bounds: Bounds, parts: int) -> MCResult:
    """``--partitions N``: kvspec.mc.distributed on Ray."""
    from kvspec.errors import UsageError
    try:
        import ray  # noqa: F401
    except ImportError:
        raise UsageError("kvspec mc: --partitions needs ray (pip install ray)") from None
    if a.resume and not a.checkpoint:
        raise UsageError("kvspec mc: --resume needs --checkpoint DIR")
    from kvspec.mc.distributed import distributed_check
    return distributed_check(a.target, config, a.depth, bounds, partitions=parts, patch=a.patch,
                             ray_address=a.ray_address, checkpoint=a.checkpoint, resume=a.resume,
                             time_cap=a.time_cap)


def _warn_unwritable(what: str, e: OSError) -> None:
    print(f"kvspec mc: warning: could not write {what}: {e.strerror or e}", file=sys.stderr)


def cmd_mc(a: argparse.Namespace) -> int:
    """Exit code: 1 with a violation; 130 / 143 for a search stopped by Ctrl-C / SIGTERM
    that found none (what it reached is printed first); else 0 (``pass``, or
    ``incomplete`` at a cap, as the module docstring says)."""
    from kvspec.errors import UsageError
    try:
        from kvspec.errors import interrupt_handlers   # SIGINT and SIGTERM raise kvspec.errors.Interrupted
    except ImportError:   # (a checkout from before it: a Ctrl-C is still a KeyboardInterrupt)
        from contextlib import nullcontext as interrupt_handlers
    from kvspec.targets.patched import read_patch
    from kvspec.targets.registry import load_target
    from kvspec.mc.budget import refuse_if_too_large

    if a.blocks < 1:
        raise UsageError("kvspec mc: --blocks must be at least 1")
    if a.depth < 0:
        raise UsageError("kvspec mc: --depth must not be negative")
    if a.requests < 1:
        raise UsageError("kvspec mc: --requests must be at least 1")
    if not (a.time_cap > 0 and a.mem_cap > 0) or a.time_cap == float("inf") or a.mem_cap == float("inf"):
        raise UsageError("kvspec mc: --time-cap and --mem-cap must be positive finite numbers")
    if getattr(a, "workers", 1) < 1:
        raise UsageError("kvspec mc: --workers must be at least 1")
    refuse_if_too_large(a.blocks, a.mem_cap)   # before loading anything (model_check asks again, null block and all)
    workers = _workers(getattr(a, "workers", 1))
    with interrupt_handlers():   # SIGTERM too: the search stops and reports what it reached
        target = load_target(a.target, patch=a.patch, api=getattr(a, "api", None))
        a.level = _level(a, target)
        patch_text = read_patch(a.patch) if a.patch else None
        from kvspec.check.command import check_kv_groups
        kv_groups = check_kv_groups(getattr(a, "kv_groups", None), target, family_ok=False) or "full"
        caching = _caching(a, target)
        mml = getattr(a, "max_model_len", None)
        if mml is not None and (mml < 1 or a.level != "cache"):
            raise UsageError("kvspec mc: --max-model-len takes a positive token count, at the cache level")
        config = Config(level=a.level, num_blocks=a.blocks + (1 if target.traits.null_block else 0),
                        block_size=DEFAULT_BLOCK_SIZE, kv_groups=kv_groups, caching=caching, max_model_len=mml)
        bounds = Bounds(requests=a.requests, symmetry=getattr(a, "symmetry", "on") != "off")
        parts = getattr(a, "partitions", None)
        if parts:
            r = _distributed(a, config, bounds, parts)
        else:
            if getattr(a, "checkpoint", None) or getattr(a, "resume", False):
                raise UsageError("kvspec mc: --checkpoint and --resume go with --partitions")
            r = model_check(target, config, a.depth, bounds, time_cap=a.time_cap, mem_cap_gib=a.mem_cap,
                            progress=sys.stderr.isatty() and not a.json, fork=getattr(a, "fork", "auto"),
                            check_once=getattr(a, "check_once", "on") != "off", workers=workers,
                            partial_on_interrupt=True, seen=getattr(a, "seen", "fingerprint"))
    # (from here a second Ctrl-C ends kvspec as usual: what the search reached comes first)
    if r.verdict == "violation" and r.counterexample is not None:
        r.replayed = confirm(target, config, r)
        command = "kvspec " + " ".join(shlex.quote(x) for x in sys.argv[1:]) if sys.argv[1:2] == ["mc"] else ""
        v = r.violations[0]
        try:
            r.repro = str(write_repro(Path(a.report_dir or os.path.join("reports", "repros")), a.target, target,
                                      config, r.counterexample, v.invariant, v.message, patch_text=patch_text,
                                      patch_name=a.patch, command=command, minimal=True))
        except OSError as e:   # the finding is still printed, and the exit code stays 1
            _warn_unwritable("the repro", e)
    from kvspec.targets.policies import declaration_of
    out = {"target": a.target, "patch": a.patch, "level": a.level, "blocks": a.blocks, "requests": a.requests, "caching": caching,
           "declaration": declaration_of(target), **r.to_dict()}
    print(json.dumps(out, default=str) if a.json else _text(a, r, out["declaration"]), flush=True)
    if a.report_dir:
        d = Path(a.report_dir)
        try:
            d.mkdir(parents=True, exist_ok=True)
            write_atomic(d / "kvspec-mc.json", json.dumps(out, indent=1, default=str) + "\n")
        except OSError as e:
            _warn_unwritable(str(d / "kvspec-mc.json"), e)
    if r.verdict == "violation":
        return 1
    if r.interrupted:
        import signal
        return 128 + int(getattr(signal, r.interrupted, signal.SIGINT))
    return 0

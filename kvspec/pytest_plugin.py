"""pytest plugin (entry point ``pytest11``): kvspec's machines in a user's own suite.

Two ways in:

* naming the target on the command line::

      pytest --kvspec-target mypkg/pool.py:BlockPool [--kvspec-level pool|cache|all]

  adds one test item per level the target supports (``kvspec[TARGET]::pool``,
  ``kvspec[TARGET]::cache``) to whatever else the run collects;

* one line in a test module::

      from kvspec.stateful import machines_for
      TestMyPool = machines_for("mypkg.pool:BlockPool")

  a ``unittest.TestCase`` class with ``test_pool`` / ``test_cache`` for the levels
  the target supports.

Both run the same Hypothesis machines ``kvspec check`` runs, with every invariant
checked after every step. A failure is cut down (ddmin, then a bounded shortest-path
search, as ``kvspec check`` does), written as a standalone repro file
(``kvspec.check.repro.write_repro``), and reported with the invariant id, the steps and
the repro's path.

Hypothesis settings profiles (registered here and nowhere else)
--------------------------------------------------------------
``ci``   640 examples per machine, deterministic: the batches ``kvspec check --level L
         --max-examples 640 --seed S`` runs (S: ``--kvspec-seed``), sized to find every
         safety bug of the impl and vLLM corpora (reports/profiles.md).
``dev``  50 random examples per machine, failures kept in the example database.
``deep`` 5,000 random examples of up to 120 steps: for nightly jobs.

A count is of examples *run* (those Hypothesis discards part-way included, as
``kvspec check`` counts them), and a machine stops within one small batch of it.

Chosen by ``--kvspec-profile``, else ``KVSPEC_PROFILE``, else ``HYPOTHESIS_PROFILE``
when it names one of them (``ci`` or ``kvspec-ci``, ...), else ``ci`` when the ``CI``
environment variable is set, else ``dev``. They are also registered with Hypothesis
as ``kvspec-ci``, ``kvspec-dev`` and ``kvspec-deep``, so that
``settings.load_profile("kvspec-deep")`` works in a user's conftest; Hypothesis's own
``ci`` profile is left alone.

``--kvspec-budget SECONDS`` turns a machine's run into a time budget: batches of
``BATCH`` examples until the budget is spent (under ``ci`` the first is the profile's
derandomized batch and the next are seeded from ``--kvspec-seed``, so the run stays
reproducible; the random profiles stay random). A budget makes the verdict depend
on the machine's speed and load: for CI use example counts.

``--kvspec-max-examples N`` is the deterministic mode: N examples per machine (the
profile's settings otherwise), in batches seeded from ``--kvspec-seed``, with no
deadline, no timed health check and a minimizer bounded by work, not seconds: the
same commit, target and seed give the same verdict and repro on any machine. The
``ci`` profile is the same mode at its own count.
``--kvspec-op-timeout S`` (default 10) turns a target call that does not return into
a ``NO_HANG`` failure.

Example database: the random profiles keep failing examples in Hypothesis's example
database, ``--kvspec-db DIR`` (or ``KVSPEC_DB``) when given, else Hypothesis's default
(``.hypothesis/examples``). Each machine has its own key (target, level), so a
failure found in one run is replayed first in the next, also under pytest-xdist
(the directory database is safe to share between processes). ``ci`` uses no
database: derandomized, it finds the same failure every run anyway.

This module is longer than 450 lines since the ci profile runs kvspec check's own
one-level search and the summary lists coverage; the option table and the item runner
share the profile state. Splitting the summary out is a follow-up.
"""
from __future__ import annotations

import hashlib
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pytest

# Hypothesis settings profiles: defined in kvspec.check.profiles, re-exported here.
from kvspec.check.profiles import (MINIMIZE_BUDGET, PROFILES, STEPS, _common, _profile_name,  # noqa: F401
                                   choose_profile, profile_settings, register_profiles)

BATCH = 25                 # examples per batch under --kvspec-budget
RUN_PER_KEPT = 4.0         # first guess of examples run per example Hypothesis keeps (cache level: 67 for 25)
DEFAULT_REPRO_DIR = os.path.join("reports", "repros")


# -- what a run is configured with --------------------------------------------------
@dataclass(frozen=True)
class RunOptions:
    level: str = "all"                 # levels to run: pool, cache or all (those the target supports)
    profile: Optional[str] = None      # None: choose_profile()
    budget: Optional[float] = None     # seconds per machine; None: one run of the profile's examples
    max_examples: Optional[int] = None  # deterministic: this many examples per machine, seeded from ``seed``
    seed: int = 0
    repro_dir: str = DEFAULT_REPRO_DIR
    database: Optional[str] = None     # example database directory (random profiles)
    api: Optional[str] = None          # --api of a user target
    patch: Optional[str] = None        # --patch for --kvspec-target
    kv_groups: Optional[str] = None    # --kv-groups of the cache machine (None: the machine's default)


_ACTIVE = RunOptions()  # what pytest_configure read from the command line
_CONFIGURED = False
_RAN: list = []  # (nodeid, outcome, counters) of the --kvspec-target machines run (from the reports: xdist too)


def active_options() -> RunOptions:
    return _ACTIVE


def under_pytest() -> bool:
    """True inside a pytest run that loaded this plugin."""
    return _CONFIGURED


class KvspecFailure(AssertionError):
    """A machine found a violation; the message names the invariant and the repro."""

    def __init__(self, text: str, invariant: str, repro: Optional[str], steps: int) -> None:
        super().__init__(text)
        self.text, self.invariant, self.repro, self.steps = text, invariant, repro, steps
        self.counters: dict = {}


def _db_key(spec: str, target: Any, level: str) -> bytes:
    return hashlib.sha256(f"kvspec-machine:{spec}:{target.name}:{level}".encode()).digest()


def run_machine(target: Any, spec: str, level: str, options: Optional[RunOptions] = None,
                command: str = "", patch: Optional[str] = None) -> dict:
    """Run kvspec's ``level`` machine against ``target``. Returns counters; raises
    ``KvspecFailure`` (an AssertionError) with the invariant, steps and repro path."""
    opts = options or _ACTIVE
    profile = choose_profile(opts.profile)
    base = profile_settings(profile, opts.database or os.environ.get("KVSPEC_DB"))
    # What a count counts: examples *run*, each one a machine checked step by step,
    # those Hypothesis discards half-way (no rule applies, a filtered draw) included,
    # as ``kvspec check`` counts them. Hypothesis's own ``max_examples`` counts only the
    # examples it keeps (25 kept ran 30 at the pool level, 67 at the cache level), so
    # one run of it with 100 ran about 250. The count is met in batches instead, and
    # the run stops at the first batch that reaches it: at most one batch over.
    wanted = opts.max_examples if opts.max_examples is not None else (
        None if opts.budget is not None else base.max_examples)
    from kvspec.check import coverage, coverage_notes
    coverage.reset()
    start = time.monotonic()
    found: Optional[Any] = None
    if wanted is not None and (opts.max_examples is not None or base.derandomize):
        # Deterministic (ci, --kvspec-max-examples): kvspec check's own search at one level,
        # so this machine runs exactly what ``kvspec check --level LEVEL --max-examples N
        # --seed S`` runs (same batches, same examples, same finding).
        from kvspec.check.search import LevelSearch
        search = LevelSearch(target, level, misuse=False, seed=opts.seed, kv_groups=opts.kv_groups)
        machine = search.machine
        while found is None and machine.counters["examples"] < wanted:
            found = search.run_batch(min(BATCH, wanted - machine.counters["examples"]))
    else:
        machine = _plain_machine(target, level, opts)
        found = _run_random(machine, base, spec, target, level, opts, wanted, start)
    counters = dict(machine.counters, seconds=round(time.monotonic() - start, 3), profile=profile,
                    stop=f"--kvspec-max-examples {wanted}" if opts.max_examples is not None else
                    f"budget {opts.budget:g}s" if opts.budget is not None else f"{wanted} examples")
    cov = coverage.snapshot([level])  # what this machine drew and called
    counters["coverage"] = {"levels": cov, "notes": [] if found is not None else coverage_notes.uncalled_notes(
        target, _patch_text(patch), cov)}
    if found is not None:
        failure = _failure(target, spec, level, found, profile, opts, command, patch)
        failure.counters = counters
        raise failure
    return counters


def _patch_text(patch: Optional[str]) -> Optional[str]:
    if not patch:
        return None
    try:
        from kvspec.targets.patched import read_patch
        return read_patch(patch)
    except Exception:  # the target loaded with it: a patch that cannot be read again says nothing here
        return None


def _plain_machine(target: Any, level: str, opts: RunOptions) -> Any:
    from kvspec.stateful import cache_machine, pool_machine
    if level == "engine":  # the engine's own scheduler drives its KV manager (kvspec.engine)
        from kvspec.engine.machines import engine_machine
        return engine_machine(target, kv_groups=opts.kv_groups)
    return cache_machine(target, kv_groups=opts.kv_groups) if level == "cache" else pool_machine(target)


def _run_random(machine: Any, base: Any, spec: str, target: Any, level: str, opts: RunOptions,
                wanted: Optional[int], start: float) -> Optional[Any]:
    """The random profiles (dev, deep) and any --kvspec-budget run: batches of Hypothesis
    examples until ``wanted`` examples have run (counted as ``kvspec check`` counts them)
    or, with a budget, until the budget is spent. Returns the InvariantViolation found."""
    from hypothesis import seed as hyp_seed, settings
    from hypothesis.errors import Flaky
    from hypothesis.stateful import get_state_machine_test

    from kvspec.stateful import InvariantViolation

    batch, ratio, asked, ran_before = 0, RUN_PER_KEPT, 0, machine.counters["examples"]
    while True:
        if asked:  # what the last batch cost per example kept
            ratio = max(1.0, (machine.counters["examples"] - ran_before) / asked)
        ran_before, asked = machine.counters["examples"], 0
        if wanted is not None:  # a profile's count: batches, the last ones shrinking to what is left
            left = wanted - machine.counters["examples"]
            if left <= 0:
                return None
            # Hypothesis keeps only some of the examples it runs (it discards the rest
            # part-way): ask for the share of what is left that it kept so far, so the run
            # ends close to the count (at most the discards of a one-example batch over).
            ask = max(1, min(BATCH, int(left / ratio)))
            s = settings(base, max_examples=ask)
            asked = ask
        elif batch == 0:
            s = settings(base, max_examples=min(BATCH, base.max_examples))
        else:
            s = settings(base, max_examples=BATCH, derandomize=False,
                         database=None if base.derandomize else base.database)
        test = get_state_machine_test(machine, settings=s)
        # Hypothesis keys its database on the test function's source, which is the same
        # for every state machine: give each (target, level) its own key.
        test._hypothesis_internal_database_key = _db_key(spec, target, level)
        if wanted is None and batch and base.derandomize:  # ci under a budget: reproducible batch after batch
            hyp_seed(opts.seed * 100_003 + batch)(test)
        batch += 1
        try:
            test()
        except InvariantViolation as e:
            return e
        except Flaky as e:  # a failure that does not replay is still a finding
            found = next((x for x in getattr(e, "exceptions", []) if isinstance(x, InvariantViolation)), None)
            if found is None:
                raise
            return found
        if wanted is None and time.monotonic() - start >= (opts.budget or 0):
            return None


def _failure(target: Any, spec: str, level: str, e: Any, profile: str, opts: RunOptions, command: str,
             patch: Optional[str]) -> KvspecFailure:
    from kvspec.spec.invariants import title
    from kvspec.check.minimize import minimize_finding
    from kvspec.check.repro import write_repro
    from kvspec.check.session import run_steps

    steps, config, violations = list(e.steps), e.config, e.violations
    invariant = violations[0].invariant
    minimal = None
    ddmin_s, bfs_s = MINIMIZE_BUDGET.get(profile, MINIMIZE_BUDGET["ci"])
    # A derandomized profile (ci) or an example count: the repro must not depend on the
    # machine either, so the minimizer is bounded by work, not seconds.
    deterministic = opts.max_examples is not None or bool(PROFILES.get(profile, {}).get("derandomize"))
    try:
        steps, minimal, config = minimize_finding(target, config, steps, invariant, budget_s=ddmin_s,
                                                  bfs_budget_s=bfs_s, deterministic=deterministic)
        out = run_steps(target, config, steps)
        if out.failed and out.invariant == invariant:
            violations = out.violations
    except Exception:  # keep what Hypothesis found
        steps, config, violations = list(e.steps), e.config, e.violations
    v = violations[0]
    repro: Optional[str] = None
    repro_note = ""
    try:
        patch_text = None
        if patch:
            from kvspec.targets.patched import read_patch
            patch_text = read_patch(patch)
        repro = str(write_repro(Path(opts.repro_dir), spec, target, config, steps, invariant, v.message,
                                patch_text=patch_text, patch_name=patch, command=command, minimal=minimal))
    except OSError as err:
        repro_note = f"(could not write the repro: {err})"
    lines = [f"kvspec: VIOLATION {title(invariant)} at the {level} level, target {spec}"
             + (f" + {patch}" if patch else ""),
             f"  {v.message}"]
    if v.excerpt:
        lines.append(f"  state: {v.excerpt}")
    lines.append(f"  {len(steps)} steps on {config.num_blocks} blocks"
                 + (f", block size {config.block_size}" if level == "cache" else "")
                 + (" (minimal: not proven; the repro says why)" if minimal is None
                    else f" (minimal: {str(minimal).lower()})") + ":")
    lines += [f"    {i + 1}. {op!r}" for i, op in enumerate(steps)]
    lines.append(f"  repro: {repro}" if repro else f"  repro: {repro_note}")
    if repro:
        from kvspec.report.text import replay_command
        lines.append(f"  replay: {replay_command(repro)}")
    return KvspecFailure("\n".join(lines), invariant, repro, len(steps))


def levels_to_run(target: Any, level: str) -> list[str]:
    if level == "engine":  # asked for by name only, never part of "all"
        from kvspec.engine.drivers import supports_engine
        return ["engine"] if supports_engine(target) else []
    supported = list(target.traits.levels)
    return supported if level == "all" else [lv for lv in supported if lv == level]


# -- pytest hooks ------------------------------------------------------------------
def pytest_addoption(parser) -> None:
    g = parser.getgroup("kvspec", "kvspec allocator verification")
    g.addoption("--kvspec-target", action="append", default=None, metavar="TARGET",
                help="run kvspec's machines against TARGET (impl, vllm, nanovllm[:PKG], FILE.py:NAME, "
                     "module:NAME); may be given more than once")
    g.addoption("--kvspec-level", default="all", choices=["pool", "cache", "engine", "all"],
                help="which machines to run (default: all the target supports)")
    g.addoption("--kvspec-budget", type=float, default=None, metavar="SECONDS",
                help="seconds per machine (default: one run of the profile's examples)")
    g.addoption("--kvspec-max-examples", type=int, default=None, metavar="N",
                help="deterministic: N examples per machine seeded from --kvspec-seed, no time limit anywhere "
                     "(same verdict on any machine; excludes --kvspec-budget)")
    g.addoption("--kvspec-op-timeout", type=float, default=None, metavar="S",
                help="seconds one target call may take before it is a NO_HANG finding (default 10; 0: off)")
    g.addoption("--kvspec-profile", default=None, choices=sorted(PROFILES),
                help="Hypothesis settings for kvspec's machines: ci (derandomized, bounded), dev, "
                     "deep (nightly); default: KVSPEC_PROFILE / HYPOTHESIS_PROFILE, else ci under CI, else dev")
    g.addoption("--kvspec-api", default=None, choices=["blockpool", "kvcachemanager", "nanovllm"],
                help="API of a user target (default: detected)")
    g.addoption("--kvspec-patch", default=None, metavar="DIFF",
                help="apply this unified diff to temporary copies of the --kvspec-target's sources")
    g.addoption("--kvspec-seed", type=int, default=0,
                help="ci profile with a budget: seed of the batches after the first")
    g.addoption("--kvspec-repro-dir", default=None, metavar="DIR",
                help=f"where failing runs write repro files (default: {DEFAULT_REPRO_DIR} under the rootdir)")
    g.addoption("--kvspec-kv-groups", default=None, metavar="SPEC",
                help="KV-cache groups of the cache machine, e.g. full,swa:4 (as kvspec check --kv-groups)")
    g.addoption("--kvspec-db", default=None, metavar="DIR",
                help="Hypothesis example database directory for kvspec's machines (default: Hypothesis's)")


_SAVED = pytest.StashKey[tuple]()
_SAVED_TIMEOUT = pytest.StashKey[object]()


def _kv_groups(config) -> Optional[str]:
    from kvspec.spec.model.groups import canonical_groups
    spec = config.getoption("--kvspec-kv-groups", None)
    try:
        return None if spec is None else canonical_groups(spec)
    except ValueError as e:
        raise pytest.UsageError(f"--kvspec-kv-groups: {e}") from None


def pytest_configure(config) -> None:
    global _ACTIVE, _CONFIGURED
    config.stash[_SAVED] = (_ACTIVE, _CONFIGURED, list(_RAN))  # a pytest run inside a pytest run (pytester)
    _RAN.clear()
    _CONFIGURED = True
    register_profiles()
    budget = config.getoption("--kvspec-budget", None)
    if budget is not None and budget <= 0:
        raise pytest.UsageError("--kvspec-budget must be positive")
    max_examples = config.getoption("--kvspec-max-examples", None)
    if max_examples is not None and (max_examples <= 0 or budget is not None):
        raise pytest.UsageError("--kvspec-max-examples must be positive and cannot be combined with --kvspec-budget")
    op_timeout = config.getoption("--kvspec-op-timeout", None)
    if op_timeout is not None:
        from kvspec.targets import watchdog
        config.stash[_SAVED_TIMEOUT] = watchdog.default()
        watchdog.set_default(op_timeout)
    repro = config.getoption("--kvspec-repro-dir", None) or str(Path(config.rootpath) / DEFAULT_REPRO_DIR)
    _ACTIVE = RunOptions(level=config.getoption("--kvspec-level", "all") or "all",
                         profile=config.getoption("--kvspec-profile", None), budget=budget, max_examples=max_examples,
                         seed=config.getoption("--kvspec-seed", 0) or 0, repro_dir=repro,
                         database=config.getoption("--kvspec-db", None), api=config.getoption("--kvspec-api", None),
                         patch=config.getoption("--kvspec-patch", None), kv_groups=_kv_groups(config))
    try:
        choose_profile(_ACTIVE.profile)
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None


def pytest_unconfigure(config) -> None:
    global _ACTIVE, _CONFIGURED
    saved = config.stash.get(_SAVED, None)
    if saved is not None:
        _ACTIVE, _CONFIGURED, ran = saved
        _RAN[:] = ran
    if _SAVED_TIMEOUT in config.stash:
        from kvspec.targets import watchdog
        watchdog.set_default(config.stash[_SAVED_TIMEOUT])


def pytest_report_header(config) -> Optional[str]:
    specs = config.getoption("--kvspec-target", None)
    if not specs:
        return None
    return (f"kvspec: targets {', '.join(specs)}, level {_ACTIVE.level}, profile {choose_profile(_ACTIVE.profile)}"
            + (f", budget {_ACTIVE.budget:g}s per machine" if _ACTIVE.budget else ""))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items) -> None:
    """Add the machines of every ``--kvspec-target`` in front of the collected items
    (first, so that -k, -m and deselection apply to them as to any test)."""
    specs = config.getoption("--kvspec-target", None)
    if not specs:
        return
    added = []
    for spec in specs:
        name = f"kvspec[{spec}]"
        col = KvspecTargetCollector.from_parent(session, name=name, nodeid=name, spec=spec)
        ihook = col.ihook
        ihook.pytest_collectstart(collector=col)
        rep = ihook.pytest_make_collect_report(collector=col)
        ihook.pytest_collectreport(report=rep)
        if rep.passed:
            for item in rep.result:
                ihook.pytest_itemcollected(item=item)
                added.append(item)
    items[:0] = added


def pytest_runtest_logreport(report) -> None:
    if report.when == "call":
        for name, value in getattr(report, "user_properties", ()):
            if name == "kvspec" and isinstance(value, dict):
                _RAN.append((report.nodeid, report.outcome, value))


def pytest_terminal_summary(terminalreporter) -> None:
    if not _RAN:
        return
    from kvspec.check.coverage import coverage_lines
    terminalreporter.section("kvspec")
    for nodeid, outcome, c in _RAN:
        terminalreporter.write_line(
            f"{nodeid}: {c.get('examples', 0)} examples, {c.get('steps', 0)} steps in {c.get('seconds', 0):.1f}s "
            f"(profile {c.get('profile', '?')}, stop: {c.get('stop', '?')}): {outcome}")
        cov = c.get("coverage")
        if cov:  # what the verdict covered, and a changed method this level never called
            for line in coverage_lines(cov["levels"], cov["notes"]):
                terminalreporter.write_line(line)


class KvspecTargetCollector(pytest.Collector):
    """The machines for one ``--kvspec-target``: the target is loaded here, so that a
    target that cannot be loaded is a collection error of one line."""

    def __init__(self, *, spec: str, **kw) -> None:
        super().__init__(**kw)
        self.spec = spec
        self.target = None

    def collect(self):
        from kvspec.targets import load_target

        self.target = load_target(self.spec, patch=_ACTIVE.patch, api=_ACTIVE.api)
        levels = levels_to_run(self.target, _ACTIVE.level)
        if not levels:
            raise _NoLevels(f"kvspec: target {self.spec} supports the {', '.join(self.target.traits.levels)} "
                            f"level(s), and --kvspec-level {_ACTIVE.level} asks for none of them")
        return [KvspecMachineItem.from_parent(self, name=lv, level=lv) for lv in levels]

    def repr_failure(self, excinfo):
        from kvspec.targets.base import TargetError

        if isinstance(excinfo.value, (TargetError, _NoLevels)):
            msg = str(excinfo.value)
            return msg if msg.startswith("kvspec") else f"kvspec: {msg}"
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, f"kvspec machines for {self.spec}"


class _NoLevels(Exception):
    pass


class KvspecMachineItem(pytest.Item):
    """One kvspec machine (pool or cache level) against one target."""

    def __init__(self, *, level: str, **kw) -> None:
        super().__init__(**kw)
        self.level = level
        self.counters: dict = {}

    def runtest(self) -> None:
        parent: KvspecTargetCollector = self.parent  # type: ignore[assignment]
        cmd = (f"pytest --kvspec-target {parent.spec} --kvspec-level {self.level}"
               + (f" --kvspec-patch {_ACTIVE.patch}" if _ACTIVE.patch else ""))
        try:
            self.counters = run_machine(parent.target, parent.spec, self.level, _ACTIVE, command=cmd,
                                        patch=_ACTIVE.patch)
        except KvspecFailure as e:
            self.counters = e.counters
            raise
        finally:
            if self.counters:
                self.user_properties.append(("kvspec", dict(self.counters)))

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, KvspecFailure):
            return excinfo.value.text
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self):
        parent: KvspecTargetCollector = self.parent  # type: ignore[assignment]
        return self.path, None, f"kvspec {self.level} machine on {parent.spec}"


def safe_name(spec: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", spec).strip("_") or "target"


__all__ = ["PROFILES", "RunOptions", "KvspecFailure", "profile_settings", "register_profiles", "choose_profile",
           "run_machine", "levels_to_run", "active_options"]

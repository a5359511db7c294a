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
``ci``   derandomized, 100 examples per machine: the same run every time, bounded.
``dev``  50 random examples per machine, failures kept in the example database.
``deep`` 5,000 random examples of up to 120 steps: for nightly jobs.

Chosen by ``--kvspec-profile``, else ``KVSPEC_PROFILE``, else ``HYPOTHESIS_PROFILE``
when it names one of them (``ci`` or ``kvspec-ci``, ...), else ``ci`` when the ``CI``
environment variable is set, else ``dev``. They are also registered with Hypothesis
as ``kvspec-ci``, ``kvspec-dev`` and ``kvspec-deep``, so that
``settings.load_profile("kvspec-deep")`` works in a user's conftest; Hypothesis's own
``ci`` profile is left alone.

``--kvspec-budget SECONDS`` turns a machine's run into a time budget: batches of
``BATCH`` examples until the budget is spent (under ``ci`` the first is the profile's
derandomized batch and the next are seeded from ``--kvspec-seed``, so the run stays
reproducible; the random profiles stay random).

Example database: the random profiles keep failing examples in Hypothesis's example
database, ``--kvspec-db DIR`` (or ``KVSPEC_DB``) when given, else Hypothesis's default
(``.hypothesis/examples``). Each machine has its own key (target, level), so a
failure found in one run is replayed first in the next, also under pytest-xdist
(the directory database is safe to share between processes). ``ci`` uses no
database: derandomized, it finds the same failure every run anyway.
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

BATCH = 25                 # examples per batch under --kvspec-budget
STEPS = 60                 # steps per example, as kvspec check (about 5x the largest pool)
DEFAULT_REPRO_DIR = os.path.join("reports", "repros")

# -- Hypothesis settings profiles: the one place they are defined ---------------------
PROFILES: dict[str, dict[str, Any]] = {
    "ci": dict(max_examples=100, stateful_step_count=STEPS, derandomize=True, database=None),
    "dev": dict(max_examples=50, stateful_step_count=STEPS, derandomize=False),
    "deep": dict(max_examples=5000, stateful_step_count=2 * STEPS, derandomize=False),
}
# Seconds of ddmin and of bounded shortest-path search when cutting a failure down.
MINIMIZE_BUDGET = {"ci": (5.0, 4.0), "dev": (5.0, 4.0), "deep": (20.0, 30.0)}


def _common() -> dict[str, Any]:
    from hypothesis import HealthCheck, Phase, Verbosity

    # Generation and replay only: a failure is cut down by kvspec.check.minimize (what
    # ``kvspec check`` does), which finds shorter sequences than shrinking, sooner.
    return dict(deadline=None, suppress_health_check=list(HealthCheck), report_multiple_bugs=False,
                phases=(Phase.explicit, Phase.reuse, Phase.generate), verbosity=Verbosity.quiet, print_blob=False)


def profile_settings(name: str, database: Optional[str] = None):
    """The Hypothesis ``settings`` of kvspec profile ``name`` (``database``: a directory)."""
    from hypothesis import settings

    if name not in PROFILES:
        raise ValueError(f"unknown kvspec profile {name!r}: choose {', '.join(PROFILES)}")
    kw = {**_common(), **PROFILES[name]}
    if database and not kw.get("derandomize"):
        from hypothesis.database import DirectoryBasedExampleDatabase
        kw["database"] = DirectoryBasedExampleDatabase(database)
    return settings(**kw)


def register_profiles() -> None:
    """Register ``kvspec-ci``, ``kvspec-dev`` and ``kvspec-deep`` with Hypothesis."""
    from hypothesis import settings

    for name in PROFILES:
        settings.register_profile(f"kvspec-{name}", profile_settings(name))


def _profile_name(value: str) -> str:
    return value[len("kvspec-"):] if value.startswith("kvspec-") else value


def choose_profile(explicit: Optional[str] = None) -> str:
    """The kvspec profile to run: see the module doc for the order."""
    for value in (explicit, os.environ.get("KVSPEC_PROFILE")):
        if value:
            if _profile_name(value) not in PROFILES:
                raise ValueError(f"unknown kvspec profile {value!r}: choose {', '.join(PROFILES)}")
            return _profile_name(value)
    hyp = os.environ.get("HYPOTHESIS_PROFILE")
    if hyp and _profile_name(hyp) in PROFILES:  # a profile of the user's own is none of ours
        return _profile_name(hyp)
    return "ci" if os.environ.get("CI") else "dev"


# -- what a run is configured with --------------------------------------------------
@dataclass(frozen=True)
class RunOptions:
    level: str = "all"                 # levels to run: pool, cache or all (those the target supports)
    profile: Optional[str] = None      # None: choose_profile()
    budget: Optional[float] = None     # seconds per machine; None: one run of the profile's examples
    seed: int = 0
    repro_dir: str = DEFAULT_REPRO_DIR
    database: Optional[str] = None     # example database directory (random profiles)
    api: Optional[str] = None          # --api of a user target
    patch: Optional[str] = None        # --patch for --kvspec-target


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
    from hypothesis import seed as hyp_seed, settings
    from hypothesis.errors import Flaky
    from hypothesis.stateful import get_state_machine_test

    from kvspec.stateful import InvariantViolation, cache_machine, pool_machine

    opts = options or _ACTIVE
    profile = choose_profile(opts.profile)
    base = profile_settings(profile, opts.database or os.environ.get("KVSPEC_DB"))
    machine = (cache_machine if level == "cache" else pool_machine)(target)
    start = time.monotonic()
    batch = 0
    found: Optional[InvariantViolation] = None
    while found is None:
        if opts.budget is None:
            s = base
        elif batch == 0:
            s = settings(base, max_examples=min(BATCH, base.max_examples))
        else:
            s = settings(base, max_examples=BATCH, derandomize=False,
                         database=None if base.derandomize else base.database)
        test = get_state_machine_test(machine, settings=s)
        # Hypothesis keys its database on the test function's source, which is the same
        # for every state machine: give each (target, level) its own key.
        test._hypothesis_internal_database_key = _db_key(spec, target, level)
        if batch and base.derandomize:  # a derandomized profile stays reproducible batch after batch
            hyp_seed(opts.seed * 100_003 + batch)(test)
        batch += 1
        try:
            test()
        except InvariantViolation as e:
            found = e
        except Flaky as e:  # a failure that does not replay is still a finding
            found = next((x for x in getattr(e, "exceptions", []) if isinstance(x, InvariantViolation)), None)
            if found is None:
                raise
        if opts.budget is None or time.monotonic() - start >= opts.budget:
            break
    counters = dict(machine.counters, seconds=round(time.monotonic() - start, 3), profile=profile)
    if found is not None:
        failure = _failure(target, spec, level, found, profile, opts, command, patch)
        failure.counters = counters
        raise failure
    return counters


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
    try:
        steps, minimal, config = minimize_finding(target, config, steps, invariant, budget_s=ddmin_s,
                                                  bfs_budget_s=bfs_s)
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
                 + ("" if minimal is None else f" (minimal: {str(minimal).lower()})") + ":")
    lines += [f"    {i + 1}. {op!r}" for i, op in enumerate(steps)]
    lines.append(f"  repro: {repro}" if repro else f"  repro: {repro_note}")
    return KvspecFailure("\n".join(lines), invariant, repro, len(steps))


def levels_to_run(target: Any, level: str) -> list[str]:
    supported = list(target.traits.levels)
    return supported if level == "all" else [lv for lv in supported if lv == level]


# -- pytest hooks ------------------------------------------------------------------
def pytest_addoption(parser) -> None:
    g = parser.getgroup("kvspec", "kvspec allocator verification")
    g.addoption("--kvspec-target", action="append", default=None, metavar="TARGET",
                help="run kvspec's machines against TARGET (impl, vllm, nanovllm[:PKG], FILE.py:NAME, "
                     "module:NAME); may be given more than once")
    g.addoption("--kvspec-level", default="all", choices=["pool", "cache", "all"],
                help="which machines to run (default: all the target supports)")
    g.addoption("--kvspec-budget", type=float, default=None, metavar="SECONDS",
                help="seconds per machine (default: one run of the profile's examples)")
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
    g.addoption("--kvspec-db", default=None, metavar="DIR",
                help="Hypothesis example database directory for kvspec's machines (default: Hypothesis's)")


_SAVED = pytest.StashKey[tuple]()


def pytest_configure(config) -> None:
    global _ACTIVE, _CONFIGURED
    config.stash[_SAVED] = (_ACTIVE, _CONFIGURED, list(_RAN))  # a pytest run inside a pytest run (pytester)
    _RAN.clear()
    _CONFIGURED = True
    register_profiles()
    budget = config.getoption("--kvspec-budget", None)
    if budget is not None and budget <= 0:
        raise pytest.UsageError("--kvspec-budget must be positive")
    repro = config.getoption("--kvspec-repro-dir", None) or str(Path(config.rootpath) / DEFAULT_REPRO_DIR)
    _ACTIVE = RunOptions(level=config.getoption("--kvspec-level", "all") or "all",
                         profile=config.getoption("--kvspec-profile", None), budget=budget,
                         seed=config.getoption("--kvspec-seed", 0) or 0, repro_dir=repro,
                         database=config.getoption("--kvspec-db", None), api=config.getoption("--kvspec-api", None),
                         patch=config.getoption("--kvspec-patch", None))
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
    terminalreporter.section("kvspec")
    for nodeid, outcome, c in _RAN:
        terminalreporter.write_line(
            f"{nodeid}: {c.get('examples', 0)} examples, {c.get('steps', 0)} steps in {c.get('seconds', 0):.1f}s "
            f"(profile {c.get('profile', '?')}): {outcome}")


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

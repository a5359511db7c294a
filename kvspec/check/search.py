"""``kvspec check``: run the stateful machines against a target within a time budget,
then cut each finding down and write it as a standalone pytest repro.

This module is longer than 450 lines since it learned to go on past a finding (every
distinct finding, its signature excluded): the batch loop and that continuation share one
run's example count. Splitting the continuation out is a follow-up.
"""
from __future__ import annotations

import contextlib
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from hypothesis import HealthCheck, Phase, Verbosity, seed as hyp_seed, settings
from hypothesis.errors import Flaky
from hypothesis.stateful import get_state_machine_test

from kvspec.spec.config import Config
from kvspec.spec.invariants import title
from kvspec.check.minimize import minimize_finding
from kvspec.spec.ops import Op
from kvspec.check.repro import write_repro
from kvspec.check.session import Session, run_steps
from kvspec.targets.base import Target, TargetError
from kvspec.spec.violation import Violation, signature, signature_text

EXAMPLES_PER_BATCH = 25
MAX_FINDINGS = 5  # kvspec check --max-findings: distinct findings a run reports before it stops
# After a finding the search goes on only while fruitful, as Hypothesis does when it reports
# several bugs (ConjectureRunner.should_generate_more): up to twice the examples at which
# the latest finding was made (one batch at least), and at most CONTINUE_MAX examples past
# the first finding.
CONTINUE_FACTOR = 2
CONTINUE_MAX = 1000
DETERMINISTIC_EXAMPLES = 1000  # kvspec check --derandomize without --max-examples
STEPS_PER_EXAMPLE = {"pool": 60, "cache": 60, "engine": 40}  # about 5x the largest pool: evictions and reuse happen


@dataclass
class Finding:
    kind: str                 # "violation" or "robustness"
    level: str
    config: Config
    steps: list[Op]
    violations: list[Violation]
    shrunk_steps: int         # length Hypothesis shrank it to, before ddmin
    minimal: Optional[bool] = None
    repro: Optional[str] = None
    seconds_to_failure: Optional[float] = None
    examples_to_failure: Optional[int] = None  # examples run (all levels) when it was found
    hints: list = field(default_factory=list)  # kvspec.check.hints.Hint: policies under which the repro passes
    label: Optional[str] = None  # "policy" (hints), "bug" (no declarable policy explains it), None: not asked
    disproved: Optional[str] = None  # why its hints, though they pass its repro, do not explain the behaviour
    signatures: frozenset = frozenset()  # of every violation of its step as found: excluded from the search after it

    @property
    def invariant(self) -> str:
        return self.violations[0].invariant

    @property
    def signature(self) -> tuple:
        """Its first violation's signature (kvspec.spec.violation.signature), as cut down."""
        return signature(self.violations[0], self.steps[-1] if self.steps else None)

    def found_signatures(self) -> frozenset:
        return frozenset(signature(v, self.steps[-1] if self.steps else None) for v in self.violations)

    def to_dict(self) -> dict[str, Any]:
        v = self.violations[0]
        return {
            "invariant": v.invariant, "name": title(v.invariant), "message": v.message,
            "excerpt": v.excerpt, "also": sorted({x.invariant for x in self.violations[1:]} - {v.invariant}),
            "level": self.level, "config": self.config.to_dict(), "steps": [op.to_dict() for op in self.steps],
            "steps_text": [repr(op) for op in self.steps], "num_steps": len(self.steps),
            "shrunk_steps": self.shrunk_steps, "minimal": self.minimal, "repro": self.repro,
            "seconds_to_failure": None if self.seconds_to_failure is None else round(self.seconds_to_failure, 3),
            "examples_to_failure": self.examples_to_failure,
            "hints": [h.to_dict() for h in self.hints], "label": self.label, "disproved": self.disproved,
            "target_output": getattr(v, "target_output", ""),
            "signature": signature_text(self.signature), "where": v.where or None,
            "caller_bug": v.caller or None,
        }


@dataclass
class CheckReport:
    target: str
    patch: Optional[str]
    levels: list[str]
    misuse: bool
    seed: int
    budget: float
    violations: list[Finding] = field(default_factory=list)
    robustness: list[Finding] = field(default_factory=list)
    examples: int = 0
    steps: int = 0
    seconds: float = 0.0
    error: Optional[str] = None
    max_examples: Optional[int] = None  # deterministic mode (--max-examples / --derandomize); None: the budget
    max_findings: int = 1  # distinct findings (signatures) the search reports before it stops (--max-findings)
    whole_budget: bool = False  # after a finding, on through the whole budget (--whole-budget), not only while fruitful
    declaration: str = ""  # the policy declaration checked against, in words (kvspec.targets.policies)
    hintable: frozenset = frozenset()  # the policies left undeclared, open to hints
    assuming: list = field(default_factory=list)  # kvspec.check.hints.Assumption: searches continued under hints
    interrupted: Optional[str] = None  # "SIGINT" / "SIGTERM": stopped early; the counts are what was reached
    warnings: list = field(default_factory=list)  # files that could not be written (one line each)
    not_exercised: dict = field(default_factory=dict)  # invariant -> why its check never ran (not_exercised())

    @property
    def verdict(self) -> str:
        if self.violations:
            return "violation"  # a finding is never hidden by an error or an interrupt elsewhere
        return "error" if self.error else "incomplete" if self.interrupted else "pass"  # as kvspec mc says it

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target, "patch": self.patch, "levels": self.levels, "misuse": self.misuse,
            "seed": self.seed, "budget": self.budget, "verdict": self.verdict,
            "violations": [self._finding(f) for f in self.violations],
            "robustness": [self._finding(f) for f in self.robustness],
            "examples": self.examples, "steps": self.steps, "seconds": round(self.seconds, 3),
            "steps_per_second": round(self.steps / self.seconds, 1) if self.seconds else None, "error": self.error,
            "max_examples": self.max_examples, "deterministic": self.max_examples is not None,
            "max_findings": self.max_findings, "whole_budget": self.whole_budget,
            "declaration": self.declaration, "assuming": [a.to_dict() for a in self.assuming],
            "not_exercised": dict(self.not_exercised), "complete": self.interrupted is None,
            "interrupted": self.interrupted, "warnings": list(self.warnings),
        }


    def _finding(self, f: Finding) -> dict[str, Any]:
        d = f.to_dict()
        if self.max_examples is not None:
            d["seconds_to_failure"] = None  # a deterministic report holds no timing but its total ``seconds``
        return d


class Progress:
    """A one-line progress display on a terminal; silent otherwise."""

    def __init__(self, enabled: bool, budget: float) -> None:
        self.enabled = enabled
        self.budget = budget
        self.start = time.monotonic()
        self.level = ""
        self.counters: dict = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True) if enabled else None

    def __enter__(self) -> "Progress":
        if self._thread:
            self._thread.start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()
            # interrupted: the last progress line stays on the terminal (what was reached)
            stopped = exc_type is not None and issubclass(exc_type, KeyboardInterrupt)
            sys.stderr.write("\n" if stopped else "\r\033[K")
            sys.stderr.flush()

    def _loop(self) -> None:
        while not self._stop.wait(0.25):
            c = self.counters
            sys.stderr.write(f"\r\033[K[{self.level}] examples {c.get('examples', 0)}  steps {c.get('steps', 0)}  "
                             f"{time.monotonic() - self.start:5.1f}s / {self.budget:.0f}s")
            sys.stderr.flush()


def not_exercised(target: Target, levels: list[str], kv_groups: Optional[str]) -> dict[str, str]:
    """The invariants whose checks cannot fire in this run, and why, from the target's
    traits and the options: a report must not say "no violation found" for them.
    (ATOMIC_REJECT without --misuse and the cache-only checks on the pool level are
    the report's own rules, kvspec.report.files.)"""
    out: dict[str, str] = {}
    if not getattr(target.traits, "null_block", True):
        out["NULL_BLOCK"] = "the target has no null block"
    groups_why = None
    if "cache" not in levels and "engine" not in levels:
        groups_why = "cache level only"
    elif not getattr(target.traits, "cache_features", False):
        groups_why = "the target drives one KV-cache group"
    if groups_why:
        # the engine level's own SLOTS check (kvspec.engine.checks) runs on any target it drives
        for inv in ("HIT_AGREEMENT", "WINDOW") + (() if "engine" in levels else ("SLOTS",)):
            out[inv] = groups_why
    elif kv_groups is not None and kv_groups.startswith("with:"):
        pass   # a family of layouts drawn per example (stateful.cache.FAMILY), several groups in each
    elif kv_groups is not None or levels == ["engine"]:  # pinned by --kv-groups (the engine level: full unless
        kv_groups = kv_groups or "full"                  # given); None: drawn per example, several among them
        from kvspec.spec.model.groups import parse_groups
        groups = parse_groups(kv_groups)
        if len(groups) < 2:
            out["HIT_AGREEMENT"] = f"one KV-cache group: --kv-groups {kv_groups}"
        if all(g.whole for g in groups):
            out["WINDOW"] = f"no sliding-window or chunked group: --kv-groups {kv_groups}"
    return out


def _levels(target: Target, level: str) -> list[str]:
    if level == "engine":  # never part of "all": an engine run is slower, and asked for by name
        from kvspec.engine.drivers import supports_engine
        if not supports_engine(target):
            raise TargetError(f"target {target.name} has no engine level (it drives vllm and nanovllm[:PKG])")
        return ["engine"]
    supported = list(target.traits.levels)
    if level == "all":
        if getattr(target, "undriven", ()):  # the cache level cannot play this package's scheduler
            from kvspec.engine.drivers import supports_engine
            from kvspec.targets.scheduler_calls import engine_note
            if supports_engine(target):
                print(f"kvspec: note: {engine_note(list(target.undriven), Path.cwd())}", file=sys.stderr)
                return ["engine"]
        return supported
    if level not in supported:
        raise TargetError(f"target {target.name} does not support the {level} level (it supports: {', '.join(supported)})")
    return [level]


def search_order(levels: list[str], round_: int) -> list[str]:
    """The order of the levels in round ``round_`` of the round-robin: in the first, the
    cache level first; from the second on, as given (the pool level first).

    The cache level drives the same pool through the request API, so it meets most
    pool-level bugs too, within its first batch (impl's corpus, reports/patches.md,
    2026-11-29: 8 to 20 cache examples), and only it sees the request-level ones: with the
    pool level first, every one of those waited out a pool batch (half of its time to
    failure). The order of the later rounds puts every later batch of either level
    exactly where it was (pool batch k, k >= 2, after k - 1 cache batches; cache batch k
    after k pool batches): only the first pool batch waits one cache batch, so a bug
    that only the pool level sees (a reset of the prefix cache) and that only needs many
    pool examples is no later than before."""
    if round_ == 0:
        return sorted(levels, key=lambda lvl: lvl != "cache")   # stable: the rest keep their order
    return list(levels)


def _settings(n_steps: int, max_examples: int = EXAMPLES_PER_BATCH, database: Optional[str] = None) -> settings:
    # Generation only: Hypothesis finds these bugs in tens of milliseconds but spends
    # seconds shrinking, and its shrunk sequences are rarely the shortest anyway.
    # kvspec.check.minimize (ddmin, then a bounded BFS where small enough) does that part.
    # No deadline and no health checks (several are timed): nothing here depends on the clock.
    if database:  # --db: failures found anywhere are replayed first (Hypothesis's own directory database)
        from hypothesis.database import DirectoryBasedExampleDatabase
        return settings(max_examples=max_examples, stateful_step_count=n_steps, deadline=None,
                        database=DirectoryBasedExampleDatabase(database), phases=(Phase.reuse, Phase.generate),
                        report_multiple_bugs=False, derandomize=False, suppress_health_check=list(HealthCheck),
                        verbosity=Verbosity.quiet, print_blob=False)
    return settings(max_examples=max_examples, stateful_step_count=n_steps, deadline=None, database=None,
                    phases=(Phase.generate,), report_multiple_bugs=False, derandomize=False,
                    suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet, print_blob=False)


def _machine(target: Target, level: str, misuse: bool, sink: Callable, kv_groups: Optional[str] = None):
    from kvspec.stateful import cache_machine, pool_machine
    if level == "engine":
        from kvspec.engine.machines import engine_machine
        if kv_groups is not None and kv_groups.startswith("with:"):
            from kvspec.errors import UsageError
            raise UsageError(f"--kv-groups {kv_groups}: a family of layouts is drawn at the cache level; "
                             "the engine level takes one layout (e.g. --kv-groups full,swa:4)")
        return engine_machine(target, misuse=misuse, on_robustness=sink, kv_groups=kv_groups)
    if level == "cache":
        return cache_machine(target, misuse=misuse, on_robustness=sink, kv_groups=kv_groups)
    return pool_machine(target, misuse=misuse, on_robustness=sink)


class LevelSearch:
    """Batches of Hypothesis examples on one level, seeded ``seed``, ``seed+1``, ..."""

    def __init__(self, target: Target, level: str, *, misuse: bool, seed: int, kv_groups: Optional[str] = None) -> None:
        self.level = level
        self.seed = seed
        self.batch = 0
        self.robust: dict[tuple, Finding] = {}
        self.database: Optional[str] = None  # --db DIR
        self.db_key = target.name
        self.machine = _machine(target, level, misuse, self._sink, kv_groups)
        self.machine.excluded = frozenset()  # signatures of findings already made (run_check)

    def _sink(self, violations: list[Violation], steps: list[Op], config: Config, reason: str) -> None:
        # Keep the shortest sequence per (invariant, misuse op, kind of misuse): the
        # reason with its block ids and counts blanked, so "double free of block 3" and
        # "double free of block 5" are one finding, a free of an unheld block another.
        key = _robustness_key(violations[0].invariant, steps[-1], reason)
        if key not in self.robust or len(steps) < len(self.robust[key].steps):
            self.robust[key] = Finding("robustness", self.level, config, steps, violations, len(steps))

    def run_batch(self, max_examples: int = EXAMPLES_PER_BATCH) -> Optional[Finding]:
        from kvspec.stateful import InvariantViolation

        # a machine may draw differently by batch (kvspec.engine.machine: a release's first batch as before)
        machine = self.machine.for_batch(self.batch) if hasattr(self.machine, "for_batch") else self.machine
        test = get_state_machine_test(machine, settings=_settings(STEPS_PER_EXAMPLE[self.level], max_examples,
                                                                       self.database))
        if self.database:  # one key per (target, level): every machine's test function looks the same
            import hashlib
            test._hypothesis_internal_database_key = hashlib.sha256(
                f"kvspec-check:{self.db_key}:{self.level}".encode()).digest()
        hyp_seed(self.seed * 100_003 + self.batch)(test)
        if self.database:  # @seed switches the database off; the seed stays, the database comes back
            test._hypothesis_internal_use_settings = _settings(STEPS_PER_EXAMPLE[self.level], max_examples,
                                                               self.database)
        self.batch += 1
        try:
            with draws_independent_of_loaded_modules():
                test()
        except InvariantViolation as e:
            return Finding("violation", self.level, e.config, e.steps, e.violations, len(e.steps))
        except Flaky as e:  # a failure that does not replay: still a finding
            # the finding is among its exceptions, or (FlakyStrategyDefinition) its context
            cands = list(getattr(e, "exceptions", None) or []) + [e.__context__, e.__cause__]
            cause = next((x for x in cands if isinstance(x, InvariantViolation)), None)
            if cause is None:
                raise
            return Finding("violation", self.level, cause.config, cause.steps, cause.violations, len(cause.steps))
        return None


@contextlib.contextmanager
def draws_independent_of_loaded_modules():
    """Hypothesis (6.13x and later) mixes literal constants from every *local* module in
    ``sys.modules`` (any file outside site-packages and the standard library: an editable
    kvspec, the user's package, the test files) into its draws, and scans again whenever a
    module is loaded. A seed's verdict would then depend on what happened to be imported
    first: ``kvspec patches`` (which imports ``kvspec.mc``) and ``kvspec check`` drew
    differently on the same seed, as did two pytest workers. kvspec's searches draw
    without them; Hypothesis's own global constants stay. Hypothesis's private provider
    module is patched for the duration only; where it has no such hook, nothing to do."""
    try:
        from hypothesis.internal.conjecture import providers
        get, constants_cls, cache = providers._get_local_constants, type(providers._local_constants), \
            providers.CONSTANTS_CACHE
    except (ImportError, AttributeError):
        yield
        return
    empty = constants_cls()
    providers._get_local_constants = lambda: empty
    cache.cache.clear()   # allowed constants computed with the local ones
    try:
        yield
    finally:
        providers._get_local_constants = get
        cache.cache.clear()


def _robustness_key(invariant: str, op: Op, reason: Optional[str]) -> tuple:
    return (invariant, type(op).__name__, re.sub(r"-?\d+", "N", reason or ""))


def _dedupe_robustness(target: Target, findings: list[Finding]) -> list[Finding]:
    """After ddmin two findings may have become the same misuse (a double free cut
    down to a free of an unheld block): keep the shortest of each kind."""
    kept: dict[tuple, Finding] = {}
    for f in findings:
        if f.invariant == "NO_HANG":
            kept[("NO_HANG", id(f))] = f
            continue
        session = Session(target, f.config)
        for op in f.steps[:-1]:
            session.apply(op)
        key = _robustness_key(f.invariant, f.steps[-1], session.misuse_reason(f.steps[-1]))
        if key not in kept or len(f.steps) < len(kept[key].steps):
            kept[key] = f
    return list(kept.values())


def run_check(target: Target, target_spec: str, *, patch: Optional[str] = None, patch_text: Optional[str] = None,
              level: str = "all", misuse: bool = False, seed: int = 0, budget: float = 30.0,
              report_dir: str = "reports/repros", progress: bool = False, command: str = "",
              kv_groups: Optional[str] = None, max_examples: Optional[int] = None,
              database: Optional[str] = None, stop: Optional[Callable[[], bool]] = None,
              max_findings: int = 1, whole_budget: bool = False, prove_minimal: bool = True) -> CheckReport:
    """Search ``budget`` seconds, or, with ``max_examples`` (deterministic mode), exactly
    that many examples over all levels: then nothing depends on the clock (no deadline,
    no timed health check, minimization bounded by work, not seconds), so the same
    commit, target and seed give the same verdict, counts and repro on any machine.

    Every distinct bug, up to ``max_findings``: after a finding the search goes on, with
    the signatures of its step's violations excluded (``kvspec.spec.violation.signature``:
    an example that breaks one of them again ends there, unreported), until the run has
    ``max_findings`` findings or its examples run out. The examples are counted over the
    whole run: the search after a finding gets what the run has left of ``max_examples``
    (or of the budget), and no more than ``CONTINUE_FACTOR`` times the examples at which
    the latest finding was made (one batch at least; nor ``CONTINUE_MAX`` past the first):
    a search that has gone as long again without a new bug stops (with ``whole_budget``, it
    goes on through the whole of ``max_examples`` or the budget: the release sweep's way,
    where a release may hold several bugs, one found late). So the first finding is
    the one a run stopping there makes, at the same example, and the whole run is
    deterministic by example count. Each finding is cut down on its own, never into
    another finding's signature, with its own repro. A hang (NO_HANG) ends the search: the
    next example to reach the hanging call would wait out the op timeout again, and so on.
    The default, 1, is the first finding
    only (``kvspec patches``' time to failure, the corpus); ``kvspec check`` asks for ``MAX_FINDINGS``.

    ``prove_minimal=False`` (``--minimize ddmin``) cuts each finding down with ddmin alone,
    without the bounded BFS that proves the repro shortest: on an old vLLM release whose
    calls are slow that proof took most of a sweep job (0.10.0: 1,550 of 1,566 s for four
    findings, none proven within its 30,000 states)."""
    levels = _levels(target, level)
    report = CheckReport(target_spec, patch, levels, misuse, seed, budget, max_examples=max_examples,
                         max_findings=max_findings, whole_budget=whole_budget)
    report.not_exercised = not_exercised(target, levels, kv_groups)
    from kvspec.targets.policies import declaration_of
    report.declaration, report.hintable = declaration_of(target), target.traits.hintable
    start = time.monotonic()
    searches = [LevelSearch(target, lvl, misuse=misuse, seed=seed, kv_groups=kv_groups) for lvl in levels]

    def ran() -> int:  # examples run so far, every level (what the report counts)
        return sum(x.machine.counters["examples"] for x in searches)

    for search in searches:
        search.database, search.db_key = database, target_spec

    excluded: set = set()  # the signatures found so far

    def left() -> float:
        """Examples the run may still take: what is left of max_examples, and, past a
        finding, of its fruitful continuation (CONTINUE_FACTOR); inf: only the budget."""
        out = float("inf") if max_examples is None else max_examples - ran()
        if report.violations and not whole_budget:
            first, last = report.violations[0].examples_to_failure, report.violations[-1].examples_to_failure
            out = min(out, min(first + CONTINUE_MAX, max(CONTINUE_FACTOR * last, last + EXAMPLES_PER_BATCH)) - ran())
        return out

    def more() -> bool:
        if len(report.violations) >= max_findings or (stop is not None and stop()):  # stop: another --jobs worker
            return False                                                              # found one
        if any(f.invariant == "NO_HANG" for f in report.violations):
            return False  # a hang ends the search: every further one costs an op timeout (a hang is paid for once)
        return left() > 0 and (max_examples is not None or time.monotonic() - start < budget)

    try:
        with Progress(progress, budget) as prog:
            # Round-robin over the levels, one batch at a time (the cache level first in the
            # first round: search_order), so a bug that only one level can see is found as fast
            # as one that both can; after a finding, on with its signatures excluded, until
            # max_findings (the docstring).
            round_ = 0
            while more():
                by_level = {x.level: x for x in searches}
                for search in [by_level[lvl] for lvl in search_order(levels, round_)]:
                    # Deterministic mode: the last batches shrink so the run stops near N (Hypothesis
                    # may run a few more examples than asked, discarded ones included: those count too).
                    n = int(min(EXAMPLES_PER_BATCH, left()))
                    if n <= 0:
                        break
                    prog.level, prog.counters = search.level, search.machine.counters
                    search.machine.excluded = frozenset(excluded)
                    found = search.run_batch(n)
                    if found:
                        found.seconds_to_failure = time.monotonic() - start
                        found.examples_to_failure = ran()
                        found.signatures = found.found_signatures()
                        excluded.update(found.signatures)
                        report.violations.append(found)
                        if not more():
                            break
                round_ += 1
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: report what was reached, marked incomplete
        report.interrupted = _signal_name(e)
    report.seconds = time.monotonic() - start
    for search in searches:
        report.examples += search.machine.counters["examples"]
        report.steps += search.machine.counters["steps"]
        report.robustness += list(search.robust.values())
    if not report.interrupted:  # interrupted: the findings are kept as found, not cut down
        try:
            _cut_down(target, report, misuse, max_examples,
                      confirm_by=None if max_examples is not None else start + budget, prove_minimal=prove_minimal)
        except KeyboardInterrupt as e:
            report.interrupted = _signal_name(e)
    for f in report.violations + report.robustness:
        f.repro = write_repro_or_warn(report, Path(report_dir), target_spec, target, f, patch_text=patch_text,
                                      patch_name=patch, command=command)
    return report


def _signal_name(e: BaseException) -> str:
    from kvspec.errors import Interrupted
    return str(e) if isinstance(e, Interrupted) and str(e) else "SIGINT"


def _cut_down(target: Target, report: CheckReport, misuse: bool, max_examples: Optional[int],
              confirm_by: Optional[float] = None, prove_minimal: bool = True) -> None:
    """Minimize every finding, drop duplicate robustness findings, and take each
    message and excerpt from a replay of the steps as cut down. A NO_HANG finding is cut
    down by the model alone and confirmed with at most one more hang, only if that can
    end by ``confirm_by`` (None: always; see minimize.minimize_hang)."""
    for f in report.violations + report.robustness:
        allow = f.kind == "robustness" or misuse
        # never cut down into another finding's bug: each distinct finding stays itself
        avoid = frozenset().union(*(g.signatures for g in report.violations if g is not f)) \
            if f.kind == "violation" else frozenset()
        # ddmin, then a bounded BFS that may also move the repro to a smaller pool
        f.steps, f.minimal, f.config = minimize_finding(target, f.config, f.steps, f.invariant, allow_misuse=allow,
                                                        deterministic=max_examples is not None,
                                                        confirm_by=confirm_by, avoid=avoid, bfs=prove_minimal)
    report.robustness = _dedupe_robustness(target, report.robustness)
    for f in report.violations + report.robustness:
        if f.invariant != "NO_HANG":
            out = run_steps(target, f.config, f.steps)  # the message and excerpt of the repro as cut down
            if out.failed and out.invariant == f.invariant:
                f.violations = out.violations
        if f.kind == "violation" and f.violations[0].caller:
            f.label = "bug"  # a callee rejected what its caller passed on a valid sequence (kvspec.spec.blame)


def write_repro_or_warn(report: CheckReport, directory: Path, target_spec: str, target: Target, f: Finding,
                        **kw: Any) -> Optional[str]:
    """Write ``f``'s repro and return its path; a directory or file that cannot be
    written is a one-line warning on stderr (kept in ``report.warnings``) and None:
    the finding itself is still reported."""
    try:
        return str(write_repro(directory, target_spec, target, f.config, f.steps, f.invariant,
                               f.violations[0].message, minimal=f.minimal, kind=f.kind, **kw))
    except OSError as e:
        line = f"kvspec check: warning: repro not written to {directory}: {e.strerror or e}"
        report.warnings.append(line)
        print(line, file=sys.stderr)
        return None

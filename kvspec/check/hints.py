"""Policy hints: a finding that another declarable policy explains says so, and the
search goes on under that policy, so a policy difference never hides a bug.

After ``kvspec check`` has cut a finding down, its minimal repro is replayed under each
other value of each declarable policy the user left undeclared (``Traits.hintable``;
what a user declared is never second-guessed). A value under which the repro passes
becomes a ``Hint``: the exact declaration that accepts the finding, in words. A finding
no value explains is labelled a bug. kvspec never adopts a hint as the user's
declaration: the finding stands and the exit code stays 1. Instead the search runs
again, same seed, under the hinted policy (``Traits.assumed``), and what it finds there
is reported under its own heading ("assuming `admit_all_blocks = true`: ..."), with
repros that replay under the same assumption.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from kvspec.check.session import run_steps
from kvspec.spec.invariants import title
from kvspec.targets.base import Target
from kvspec.targets.nano_reading import READ_MARK
from kvspec.targets.policies import HINTABLE, policy_value, with_policies

# What each policy value means, said of the user's engine: "if <words>, declare ...".
WORDS: dict[tuple[str, Any], str] = {
    ("admit_all_blocks", True): "your engine admits a prompt only when all its blocks are free (its cached ones too)",
    ("admit_all_blocks", False): "your engine admits a prompt when its new blocks (and the free cached blocks it "
                                 "revives) are free",
    ("free_evicts", True): "a block leaves your prefix cache when its last holder frees it",
    ("free_evicts", False): "a freed block stays cached, and can be hit, until allocation reuses it",
    ("whole_prompt_hits", True): "your engine's model runner handles a hit that covers the whole prompt (it still "
                                 "computes the last token's logits, e.g. as a decode step; if it does not, this "
                                 "is a bug)",
    ("whole_prompt_hits", False): "a prefix hit never covers the whole prompt in your engine",
    ("free_order", "lru_tail_first"): "freed blocks go to the back of your free queue, a request's tail first",
    ("free_order", "mru"): "freed blocks go to the front of your free queue (the most recently freed is reused first)",
    ("free_order", "fifo"): "freed blocks go to the back of your free queue, a request's head first",
    ("free_order", "sorted"): "your free queue is kept in block-id order",
    ("unhashed_free_first", True): "freed blocks without a hash go to the front of your free queue",
    ("unhashed_free_first", False): "freed blocks go to the back of your free queue, hashed or not",
    ("partial_block_caching", True): "your engine hashes and caches a partly filled last block (copy-on-write)",
    ("partial_block_caching", False): "your engine caches full blocks only",
    ("lru_refresh_on_lookup", True): "your admission check or lookup moves a hit free block to the back (the MRU "
                                     "end) of the free queue",
    ("lru_refresh_on_lookup", False): "a lookup leaves your free queue's order alone",
    ("index", "all"): "your index keeps every block that holds a content",
    ("index", "latest_wins"): "your index keeps one block per hash and the latest cached block replaces it",
    ("index", "first_wins"): "your index keeps one block per hash and the first cached block keeps it",
}
WHERE = "[tool.kvspec] in pyproject.toml or kvspec_traits"
BUG = "no declarable policy explains this: a bug"
MAX_ROUNDS = 3  # continued searches after the first, each under one more hinted policy


def toml(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else f'"{value}"'


@dataclass(frozen=True)
class Hint:
    key: str
    value: Any

    @property
    def declare(self) -> str:
        return f"{self.key} = {toml(self.value)}"

    @property
    def text(self) -> str:
        return f"if {WORDS[(self.key, self.value)]}, declare `{self.declare}` ({WHERE})"

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "value": self.value, "declare": self.declare, "text": self.text}


def assuming(target: Target, values: dict[str, Any]) -> Target:
    """A copy of ``target`` checked as if ``values`` were declared: a hint's assumption,
    kept apart from the declaration (``Traits.assumed``). An assumed key stays open to
    hints: where two values explained a finding (two free orders, say) and the first
    assumed was the wrong one, the next finding's hint names the other."""
    t = copy.copy(target)
    base = target.traits
    traits = with_policies(base, values, "a policy hint", declaration=base.declaration)
    t.traits = dataclasses.replace(traits, assumed=tuple({**dict(base.assumed), **values}.items()))
    return t


def explain(target: Target, finding: Any) -> list[Hint]:
    """The undeclared policy values under which ``finding``'s repro passes."""
    out = []
    for key, values in HINTABLE.items():
        if key not in target.traits.hintable:
            continue
        now = policy_value(target.traits, key)
        for value in values:
            if value == now:
                continue
            try:
                alt = assuming(target, {key: value})
                passed = not run_steps(alt, finding.config, finding.steps).failed
            except Exception:  # a value this target cannot take (or a replay that breaks): no hint
                passed = False
            if passed:
                out.append(Hint(key, value))
    return out


def label(target: Target, finding: Any) -> None:
    """Set ``finding.hints`` and ``finding.label`` ("policy" or "bug"); nothing where
    every policy is declared (kvspec's own targets) or the finding cannot be replayed."""
    if finding.kind != "violation" or finding.invariant == "NO_HANG" or not target.traits.hintable:
        return
    finding.hints = explain(target, finding)
    finding.label = "policy" if finding.hints else "bug"
    if not finding.hints:
        finding.disproved = read_over(target, finding) or finding.disproved


def read_over(target: Target, finding: Any) -> Optional[str]:
    """Why a bug is one although another value of a policy kvspec read from the target's
    code (``Traits.read``) would pass its repro: the code settles that policy."""
    for key, value, why in getattr(target.traits, "read", ()):
        for alt in HINTABLE.get(key, ()):
            if alt == value:
                continue
            try:
                passed = not run_steps(assuming(target, {key: alt}), finding.config, finding.steps).failed
            except Exception:
                passed = False
            if passed:
                return (f"`{key} = {toml(alt)}` passes this repro, but kvspec read {key} = {toml(value)} "
                        f"from your code: {why}")
    return None


def continue_search(target: Target, target_spec: str, report: Any, kw: dict[str, Any]) -> None:
    """Label ``report``'s violations; after a policy finding, run the search again under
    its first hint (and again, up to MAX_ROUNDS, while the next finding is a policy one
    too) and append each run to ``report.assuming``. ``kw``: run_check's keywords."""
    from kvspec.check.search import run_check

    for f in report.violations:
        label(target, f)
    # the values each hinted policy is known to fail under: the declared one, then each
    # value assumed in turn once a finding shows under it. A later hint back to one of
    # them would contradict an earlier hint of the same run: it is dropped (one run's
    # hints never say "declare k = true" and then "declare k = false").
    failed_under: dict[str, set] = {}
    for f in report.violations:
        for h in f.hints:
            failed_under.setdefault(h.key, set()).add(policy_value(target.traits, h.key))
    last, assumed, spent, tried = report, {}, report, set()
    for _ in range(MAX_ROUNDS):
        # the hints not assumed before (two values may explain one finding: each gets its turn),
        # the first under which a short probe finds nothing preferred
        todo = [h for x in last.violations for h in x.hints if (h.key, h.value) not in tried]
        if not todo:
            return
        h = _best(target, assumed, todo, report, kw)
        tried.add((h.key, h.value))
        assumed = {**assumed, h.key: h.value}
        hinted = assuming(target, assumed)
        sub_kw = dict(kw)
        if kw.get("max_examples") is not None:  # what the first run left, at least half again
            sub_kw["max_examples"] = max(kw["max_examples"] - spent.examples, kw["max_examples"] // 2, 1)
        else:
            budget = kw.get("budget", 30.0)
            sub_kw["budget"] = max(budget - spent.seconds, budget / 2)
        try:
            sub = run_check(hinted, target_spec, **sub_kw)
        except Exception as e:  # the hinted search could not run: say so, keep the findings that stand
            from kvspec.check.search import CheckReport
            sub = CheckReport(target_spec, report.patch, report.levels, report.misuse, report.seed, report.budget,
                              error=f"{type(e).__name__}: {e}")
        for x in sub.violations:
            label(hinted, x)
            for k, v in assumed.items():  # it failed under every value assumed
                failed_under.setdefault(k, set()).add(v)
        drop_contradictions(sub.violations, failed_under)
        disprove(last, h, sub)
        report.assuming.append(Assumption(dict(assumed), sub))
        last = spent = sub


def drop_contradictions(findings: list, failed_under: dict[str, set]) -> None:
    """Drop each hint that names a value an earlier finding of the run failed under; a
    finding left with none is a bug: no one value of that policy explains both."""
    for f in findings:
        kept = [h for h in f.hints if h.value not in failed_under.get(h.key, ())]
        if len(kept) == len(f.hints):
            continue
        dropped = [h for h in f.hints if h not in kept]
        f.hints = kept
        if not kept:
            f.label = "bug"
            f.disproved = (f"`{dropped[0].declare}` passes this repro, but an earlier finding of this run fails "
                           f"under {dropped[0].key} = {toml(dropped[0].value)}: no one {dropped[0].key} explains both")


def disprove(previous: Any, hint: Hint, sub: Any) -> None:
    """A hint passes one repro; it explains the behaviour only if the search under it does
    not find the same invariant broken again in a way no value explains. Where it does
    (a lazily cleaned free list whose order is neither LRU nor FIFO: one repro passes
    under MRU, the next under no order), the earlier finding is relabelled a bug."""
    again = next((x for x in sub.violations if x.label == "bug"), None)
    if again is None:
        return
    for f in previous.violations:
        if (f.label == "policy" and f.invariant == again.invariant
                and all(h.key == hint.key for h in f.hints) and any(h == hint for h in f.hints)):
            f.label = "bug"
            f.disproved = (f"`{hint.declare}` passes this repro, but assuming it kvspec found "
                           f"{title(again.invariant)} again in {len(again.steps)} steps, which no declarable "
                           f"{hint.key} explains")


PROBE_EXAMPLES = 25  # per level: a short search that tells two hints for one finding apart


def _best(target: Target, assumed: dict[str, Any], hints: list[Hint], report: Any, kw: dict[str, Any]) -> Hint:
    """The first of ``hints`` under which a short probe (no minimizing, no repro) finds
    nothing, else the first: where several values explain a finding, the one the target
    follows is usually the one under which nothing else shows at once."""
    if len(hints) == 1:
        return hints[0]
    from kvspec.check.search import LevelSearch

    for h in hints:
        try:
            t = assuming(target, {**assumed, h.key: h.value})
            found = any(LevelSearch(t, lvl, misuse=report.misuse, seed=report.seed,
                                    kv_groups=kw.get("kv_groups")).run_batch(PROBE_EXAMPLES)
                        for lvl in report.levels)
        except Exception:
            found = True
        if not found:
            return h
    return hints[0]


@dataclass
class Assumption:
    """One continued search: the policies assumed (on hints' word) and what it found."""
    values: dict[str, Any]
    report: Any  # a CheckReport

    @property
    def heading(self) -> str:
        said = " and ".join(f"`{k} = {toml(v)}`" for k, v in self.values.items())
        r = self.report
        if r.violations:
            f = r.violations[0]
            found = f"{title(f.invariant)} in {len(f.steps)} steps"
        elif r.error:
            found = f"error: {r.error}"
        else:
            found = f"nothing found in {r.examples} examples"
        return f"assuming {said}: {found}"

    def to_dict(self) -> dict[str, Any]:
        d = self.report.to_dict()
        return {"assume": dict(self.values), "heading": self.heading,
                **{k: d[k] for k in ("verdict", "violations", "examples", "steps", "seconds", "error")}}


# -- rendering (text, Markdown): called by kvspec.report --------------------------------------
def finding_lines(f: Any, indent: str = "  ") -> list[str]:
    """A finding's hints, or its bug label, for the text report."""
    hints = getattr(f, "hints", None) or []
    if getattr(f, "disproved", None):
        return [f"{indent}{BUG}: {f.disproved}"]
    if hints:
        return [f"{indent}policy hint: {h.text}" for h in hints]
    return [f"{indent}{BUG}"] if getattr(f, "label", None) == "bug" else []


def not_second_guessed(report: Any) -> Optional[str]:
    """The declared policies hints left alone, in one line (None where nothing was declared
    or every policy is kvspec's own)."""
    hintable = getattr(report, "hintable", None)
    if hintable is None or not hintable or len(hintable) == len(HINTABLE):
        return None
    # a policy read from the target's code (kvspec.targets.nano_reading) is named in the
    # declaration line, with why; it was not declared
    read = str(getattr(report, "declaration", "") or "").partition(READ_MARK)[2]
    declared = [k for k in HINTABLE if k not in hintable and f"{k} = " not in read]
    return f"declared, so not second-guessed by hints: {', '.join(declared)}" if declared else None


def assuming_lines(report: Any) -> list[str]:
    """Each continued search under its own heading, for the text report."""
    out = []
    for a in getattr(report, "assuming", ()):
        out.append(a.heading + " (a hint's assumption, not your declaration)")
        for f in a.report.violations:
            v = f.violations[0]
            out.append(f"  {v.message}")
            out += [f"    {i + 1}. {op!r}" for i, op in enumerate(f.steps)]
            out.append(f"  repro: {f.repro}")
            out += finding_lines(f)
    return out


def assuming_markdown(report: Any) -> list[str]:
    out = []
    for a in getattr(report, "assuming", ()):
        out += [f"## {a.heading}", "", "A policy hint's assumption, not your declaration: the findings above stand.", ""]
        for f in a.report.violations:
            out.append(f"- {title(f.invariant)}: {f.violations[0].message}")
            out += [f"  {i + 1}. `{op!r}`" for i, op in enumerate(f.steps)]
            if f.repro:
                out.append(f"  - repro: `{f.repro}`")
            out += [f"  - {line.strip()}" for line in finding_lines(f)]
        out.append("")
    return out

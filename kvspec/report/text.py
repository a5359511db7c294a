"""Human-readable terminal summaries."""
from __future__ import annotations

import shlex

from kvspec.spec.invariants import title


def replay_command(repro: str) -> str:
    """The command that replays a repro file, exactly as it can be pasted."""
    return f"python -m pytest {shlex.quote(str(repro))}"


def check_text(report) -> str:
    lines = [f"kvspec check: target {report.target}" + (f" + {report.patch}" if report.patch else "")
             + f", levels {', '.join(report.levels)}{', misuse' if report.misuse else ''}, seed {report.seed}",
             f"  {report.examples} examples, {report.steps} steps in {report.seconds:.1f}s"]
    if getattr(report, "interrupted", None):
        found = len(report.violations) + len(report.robustness)
        lines.append(f"  INCOMPLETE: interrupted ({report.interrupted}); the counts above are what was reached, "
                     f"{found} finding(s) so far" + (", possibly not cut down" if found else ""))
    from kvspec.check import hints
    if getattr(report, "declaration", ""):
        lines.insert(1, f"  declaration: {report.declaration}")
        said = hints.not_second_guessed(report)
        lines[2:2] = [f"  {said}"] if said else []
    several = len(report.violations) > 1  # distinct findings (kvspec.spec.violation.signature)
    if several:
        lines.append(f"  {len(report.violations)} distinct findings, each cut down on its own, with its own repro")
    for f in report.violations:
        v = f.violations[0]
        lines.append(f"VIOLATION {title(v.invariant)} at the {f.level} level")
        lines.append(f"  {v.message}")
        lines.append(f"  state: {v.excerpt}")
        if several:
            from kvspec.spec.violation import signature_text
            lines.append(f"  signature: {signature_text(f.signature)}")
        lines.append(f"  {len(f.steps)} steps (Hypothesis shrank to {f.shrunk_steps})"
                     + (", minimal: not proven (the repro says why)" if f.minimal is None
                        else f", minimal: {str(f.minimal).lower()}") + ":")
        lines += [f"    {i + 1}. {op!r}" for i, op in enumerate(f.steps)]
        lines.append(f"  repro: {f.repro or 'not written (see the warning above)'}")
        if f.repro:  # pasted as printed, from this directory
            lines.append(f"  replay: {replay_command(f.repro)}"
                         + (f"   (unpatched: KVSPEC_PATCH=none {replay_command(f.repro)})" if report.patch else ""))
        lines += hints.finding_lines(f)
        said = getattr(v, "target_output", "")
        if said:  # what the target printed while the finding's session ran (kept out of kvspec's own output)
            lines.append("  the target printed (last 4 KB):")
            lines += [f"    {line}" for line in said.splitlines()]
    for f in report.robustness:
        v = f.violations[0]
        lines.append(f"robustness: {v.invariant}: {v.message} ({len(f.steps)} steps; repro: {f.repro})")
    lines += hints.assuming_lines(report)
    cov = getattr(report, "coverage", None)
    if cov:  # what the verdict covered, and a changed method the run never called
        from kvspec.check.coverage import coverage_lines
        lines += coverage_lines(cov["levels"], cov["notes"])
    lines.append(f"verdict: {report.verdict}")
    return "\n".join(lines)

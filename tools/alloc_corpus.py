"""Measure the allocator level on tests/data/allocators (issue 31's acceptance): each
allocator run as a stranger would (``kvspec check --target FILE:CLASS``, nothing declared,
from the corpus directory), then the refused ones once more after pasting the declaration
kvspec proposed into a pyproject.toml next to a copy. Prints one row per allocator and the
totals: checked on the first run, checked after the paste, first-run findings that are the
bug the file names (``BUG:`` in its docstring).

``--checkout DIR FILE:CLASS...`` runs real allocators the same way from a fetched
checkout's root (the proposed declaration pasted into a pyproject.toml next to the file,
removed again), one row each, for reports/field.md."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "data" / "allocators"


def _run(cwd: Path, spec: str, n: int, misuse: bool) -> tuple[int, dict, str]:
    args = [sys.executable, "-m", "kvspec", "check", "--target", spec, "--max-examples", str(n), "--seed", "0",
            "--json", "--report-dir", str(Path(tempfile.mkdtemp()))] + (["--misuse"] if misuse else [])
    # this checkout's kvspec, whichever python runs the tool and wherever it runs from (a
    # subprocess in the corpus directory would otherwise import any other kvspec installed)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH", "")) if x))
    p = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=900, env=env)
    try:
        out = json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        out = {}
    return p.returncode, out, p.stderr


def _proposal(stderr: str) -> list[str]:
    lines = stderr.splitlines()
    start = next((i for i, x in enumerate(lines) if x.startswith("kvspec: proposed declaration")), None)
    return [] if start is None else [x[4:] for x in lines[start + 1:] if x.startswith("    ")]


def checkout(root: Path, specs: list[str], n: int, misuse: bool) -> int:
    """Real allocators, run from the root of a fetched checkout as a stranger would (nothing
    declared), then after pasting the proposed declaration where refused: one row each with
    the verdict and the first finding, to be classified by reading the code."""
    for spec in specs:
        rc, out, err = _run(root, spec, n, misuse)
        how = "first run"
        if rc == 2:
            lines = _proposal(err)
            how = "refused"
            if lines:
                py = root / Path(spec.split(":")[0]).parent / "pyproject.toml"
                if py.exists():
                    print(f"{spec}: {py} exists; not pasting into it", file=sys.stderr)
                else:
                    py.write_text("\n".join(lines) + "\n")
                    try:
                        rc, out, err = _run(root, spec, n, misuse)
                    finally:
                        py.unlink()
                    how = "after the paste" if rc != 2 else "refused after the paste"
        vs = [v for v in out.get("violations", []) if isinstance(v, dict)]
        first = (f"{vs[0].get('invariant')}: {vs[0].get('message')}" if vs else
                 next((x[len("kvspec: error: "):] for x in err.splitlines() if x.startswith("kvspec: error:")), ""))
        print(" | ".join((spec, how, {0: "pass", 1: "violation", 2: "exit 2"}.get(rc, str(rc)), first[:300])))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-examples", type=int, default=150)
    ap.add_argument("--misuse", action="store_true")
    ap.add_argument("--checkout", type=Path, help="run FILE:CLASS targets from this checkout's root instead")
    ap.add_argument("targets", nargs="*", help="with --checkout: FILE:CLASS, FILE relative to the checkout")
    a = ap.parse_args()
    if a.checkout is not None:
        return checkout(a.checkout.resolve(), a.targets, a.max_examples, a.misuse)
    rows, first, pasted, findings, real = [], 0, 0, 0, 0
    entries = [x.split() for x in (CORPUS / "MANIFEST").read_text().splitlines() if x.strip()]
    for f, cls in entries:
        bug = "BUG:" in (CORPUS / f).read_text().split('"""')[1]
        rc, out, err = _run(CORPUS, f"{f}:{cls}", a.max_examples, a.misuse)
        how = "first run"
        if rc == 2:
            lines = _proposal(err)
            if lines:
                with tempfile.TemporaryDirectory() as d:
                    shutil.copy(CORPUS / f, Path(d) / f)
                    (Path(d) / "pyproject.toml").write_text("[project]\nname = \"x\"\n\n" + "\n".join(lines) + "\n")
                    rc, out, err = _run(Path(d), f"{f}:{cls}", a.max_examples, a.misuse)
                how = "after the paste" if rc != 2 else "refused"
            else:
                how = "refused"
        else:
            first += 1
        pasted += how == "after the paste"
        invs = sorted({v.get("invariant") for v in out.get("violations", []) if isinstance(v, dict)})
        if how == "first run" and rc == 1:
            findings += 1
            real += bug
        rows.append((f, cls, how, {0: "pass", 1: "violation", 2: "exit 2"}.get(rc, str(rc)), ",".join(invs),
                     "BUG" if bug else "-"))
    for r in rows:
        print(" | ".join(r))
    n = len(entries)
    print(f"checked on the first run: {first}/{n} = {100 * first / n:.0f}%; after the paste: {pasted}; "
          f"first-run findings: {findings}, on files with the named bug: {real}"
          + (f" = {100 * real / findings:.0f}%" if findings else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

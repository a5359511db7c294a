"""Measure the allocator level on tests/data/allocators (issue 31's acceptance): each
allocator run as a stranger would (``kvspec check --target FILE:CLASS``, nothing declared,
from the corpus directory), then the refused ones once more after pasting the declaration
kvspec proposed into a pyproject.toml next to a copy. Prints one row per allocator and the
totals: checked on the first run, checked after the paste, first-run findings that are the
bug the file names (``BUG:`` in its docstring)."""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "data" / "allocators"


def _run(cwd: Path, spec: str, n: int, misuse: bool) -> tuple[int, dict, str]:
    args = [sys.executable, "-m", "kvspec", "check", "--target", spec, "--max-examples", str(n), "--seed", "0",
            "--json", "--report-dir", str(Path(tempfile.mkdtemp()))] + (["--misuse"] if misuse else [])
    p = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=900)
    try:
        out = json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        out = {}
    return p.returncode, out, p.stderr


def _proposal(stderr: str) -> list[str]:
    lines = stderr.splitlines()
    start = next((i for i, x in enumerate(lines) if x.startswith("kvspec: proposed declaration")), None)
    return [] if start is None else [x[4:] for x in lines[start + 1:] if x.startswith("    ")]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-examples", type=int, default=150)
    ap.add_argument("--misuse", action="store_true")
    a = ap.parse_args()
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

"""A small, honest mutation-testing driver for impl/ (kvspec's reference allocator).

Why not mutmut or cosmic-ray: mutmut is not in this environment's package index, and
both tools assume the package under test is imported from the directory they mutate,
while impl/ is installed as ``kvspec.impl`` through setuptools ``package-dir``. So
this driver generates the mutants itself and runs each through the *same patched-
import path kvspec uses for ``--patch``*: a mutant is a unified diff against impl/,
applied to a temporary copy (``kvspec.targets.patched.import_patched_copy``).

Operators (AST-located, applied as minimal text edits, one per mutant):
  cmp     swap a comparison operator (< <=, > >=, == !=, is / is not, in / not in)
  arith   swap a binary or augmented arithmetic operator (+ -, // *, += -=)
  const   change an int constant (0 -> 1, 1 -> 0, n -> n + 1) or flip True/False
  bool    swap and / or; drop a ``not``
  loop    swap break / continue
  stmt    replace a one-line statement (assignment, call, raise, return, ...) by ``pass``
          (a return becomes ``return None``)
Docstrings and ``__repr__``-free lines are never touched; errors.py and __init__.py
(declarations only) are not mutated.

Killing (the suite, in order, stopping at the first kill):
  1. import   the mutated package fails to import;
  2. search   kvspec's stateful machines (the same ``LevelSearch`` ``kvspec check``
              runs, without the minimizer) on pool and cache level, valid use and with
              misuse, ``--budget`` seconds each, seed 0;
  3. suite    ``pytest tests/mutation/test_kill.py`` (the same machines, on fresh
              seeds, plus small unit checks) and impl's unit tests
              (test_free_queue, test_hashing, test_kv_cache_manager, test_misuse),
              run in a subprocess with ``KVSPEC_MUTANT`` set, so tests/mutation/
              conftest.py swaps the mutant in for ``kvspec.impl``.
A mutant that survives all three is *survived*; tools/mutate.py never decides that
a survivor is equivalent -- reports/mutation.md lists the survivors a person judged
equivalent, with the reason.

    python tools/mutate.py [--jobs N] [--budget S] [--only FILE] [--out reports/mutation.json]
"""
from __future__ import annotations

import argparse
import ast
import difflib
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMPL = ROOT / "impl"
FILES = ["block.py", "free_queue.py", "block_pool.py", "hashing.py", "kv_cache_manager.py"]
UNIT_TESTS = ["tests/mutation/test_kill.py", "tests/test_free_queue.py", "tests/test_hashing.py",
              "tests/test_kv_cache_manager.py", "tests/test_misuse.py"]

CMP_SWAP = {ast.Lt: "<=", ast.LtE: "<", ast.Gt: ">=", ast.GtE: ">", ast.Eq: "!=", ast.NotEq: "==",
            ast.Is: "is not", ast.IsNot: "is", ast.In: "not in", ast.NotIn: "in"}
CMP_TEXT = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=",
            ast.Is: "is", ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in"}
ARITH_SWAP = {ast.Add: ("+", "-"), ast.Sub: ("-", "+"), ast.FloorDiv: ("//", "*"), ast.Mult: ("*", "//")}


@dataclass
class Mutant:
    id: str
    file: str
    line: int
    operator: str
    before: str
    after: str
    diff: str


def _docstring_nodes(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                out.add(id(first))
    return out


def _offset(lines: list[str], line: int, col: int) -> int:
    return sum(len(x) for x in lines[: line - 1]) + len(lines[line - 1].encode()[:col].decode())


def _edits(src: str) -> list[tuple[int, int, int, str, str]]:
    """(start, end, line, operator, replacement) text edits, one per mutant."""
    tree = ast.parse(src)
    lines = src.splitlines(True)
    docs = _docstring_nodes(tree)
    out = []

    def span(node) -> tuple[int, int]:
        return _offset(lines, node.lineno, node.col_offset), _offset(lines, node.end_lineno, node.end_col_offset)

    def between(a, b, text: str, repl: str, op: str, line: int) -> None:
        s, e = span(a)[1], span(b)[0]
        seg = src[s:e]
        i = seg.find(f" {text} ") if text.isalpha() or " " in text else seg.find(text)
        if i < 0:
            return
        if text.isalpha() or " " in text:
            i += 1
        out.append((s + i, s + i + len(text), line, op, repl))

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            prev = node.left
            for op, right in zip(node.ops, node.comparators):
                if type(op) in CMP_SWAP:
                    between(prev, right, CMP_TEXT[type(op)], CMP_SWAP[type(op)], "cmp", node.lineno)
                prev = right
        elif isinstance(node, ast.BinOp) and type(node.op) in ARITH_SWAP:
            t, r = ARITH_SWAP[type(node.op)]
            between(node.left, node.right, t, r, "arith", node.lineno)
        elif isinstance(node, ast.AugAssign) and type(node.op) in (ast.Add, ast.Sub):
            t, r = ("+=", "-=") if isinstance(node.op, ast.Add) else ("-=", "+=")
            between(node.target, node.value, t, r, "arith", node.lineno)
        elif isinstance(node, ast.BoolOp):
            t, r = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
            for a, b in zip(node.values, node.values[1:]):
                between(a, b, t, r, "bool", node.lineno)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            s, e = span(node)
            inner = span(node.operand)
            out.append((s, inner[0], node.lineno, "bool", ""))
        elif isinstance(node, ast.Constant) and id(node) not in docs:
            v = node.value
            if isinstance(v, bool):
                s, e = span(node)
                out.append((s, e, node.lineno, "const", str(not v)))
            elif isinstance(v, int) and node.lineno == node.end_lineno:
                s, e = span(node)
                if src[s:e].isdigit():
                    out.append((s, e, node.lineno, "const", "1" if v == 0 else "0" if v == 1 else str(v + 1)))
        elif isinstance(node, (ast.Break, ast.Continue)):
            s, e = span(node)
            out.append((s, e, node.lineno, "loop", "continue" if isinstance(node, ast.Break) else "break"))
        if isinstance(node, ast.stmt) and id(node) not in docs and node.lineno == node.end_lineno and \
                isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.Raise, ast.Return)):
            s, e = span(node)
            repl = "return None" if isinstance(node, ast.Return) else "pass"
            if isinstance(node, ast.Return) and (node.value is None or
                                                 (isinstance(node.value, ast.Constant) and node.value.value is None)):
                continue
            out.append((s, e, node.lineno, "stmt", repl))
    return out


def generate(only: str | None = None) -> list[Mutant]:
    mutants = []
    for name in FILES:
        if only and name != only:
            continue
        rel = f"impl/{name}"
        src = (IMPL / name).read_text()
        seen = set()
        for k, (s, e, line, op, repl) in enumerate(sorted(_edits(src))):
            new = src[:s] + repl + src[e:]
            if new == src or new in seen:
                continue
            try:
                ast.parse(new)
            except SyntaxError:
                continue
            seen.add(new)
            diff = "".join(difflib.unified_diff(src.splitlines(True), new.splitlines(True), f"a/{rel}", f"b/{rel}", n=3))
            mutants.append(Mutant(f"{name[:-3]}:{line}:{op}:{len(mutants)}", rel, line, op,
                                  src.splitlines()[line - 1].strip(), new.splitlines()[line - 1].strip()
                                  if line <= len(new.splitlines()) else "", diff))
    return mutants


def kill(m: dict, budget: float, suite: bool) -> dict:
    """Run the killing suite on one mutant (in a worker process)."""
    from kvspec.checker import LevelSearch
    from kvspec.targets.registry import load_target

    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "mutant.diff"
        path.write_text(m["diff"])
        try:
            target = load_target("impl", patch=str(path))
        except Exception as e:
            return {"id": m["id"], "status": "killed", "by": "import", "detail": str(e)[:200],
                    "seconds": round(time.monotonic() - t0, 2)}
        for misuse in (False, True):
            searches = [LevelSearch(target, lvl, misuse=misuse, seed=0) for lvl in ("pool", "cache")]
            end = time.monotonic() + budget
            try:
                while time.monotonic() < end:
                    for s in searches:
                        f = s.run_batch()
                        if f is None and s.robust:
                            f = next(iter(s.robust.values()))
                        if f is not None:
                            return {"id": m["id"], "status": "killed",
                                    "by": f"search{'+misuse' if misuse else ''}:{f.invariant}",
                                    "detail": f.violations[0].message[:200], "seconds": round(time.monotonic() - t0, 2)}
            except Exception as e:  # a mutant that breaks the harness itself
                return {"id": m["id"], "status": "killed", "by": "search:error", "detail": f"{type(e).__name__}: {e}"[:200],
                        "seconds": round(time.monotonic() - t0, 2)}
        if suite:
            env = dict(os.environ, KVSPEC_MUTANT=str(path), KVSPEC_KILL_BUDGET=str(budget))
            try:
                r = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *UNIT_TESTS],
                                   cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
                failed = r.returncode != 0
                detail = next((ln for ln in r.stdout.splitlines() if ln.startswith("FAILED")), r.stdout.strip()[-200:])
            except subprocess.TimeoutExpired:
                failed, detail = True, "the suite timed out (an infinite loop)"
            if failed:
                return {"id": m["id"], "status": "killed", "by": "suite", "detail": detail[:200],
                        "seconds": round(time.monotonic() - t0, 2)}
    return {"id": m["id"], "status": "survived", "by": None, "detail": "", "seconds": round(time.monotonic() - t0, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--budget", type=float, default=2.0, help="seconds per machine search (default 2)")
    ap.add_argument("--only", help="one file of impl/, e.g. free_queue.py")
    ap.add_argument("--no-suite", action="store_true", help="skip the pytest stage")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--out", default="reports/mutation.json")
    a = ap.parse_args()
    mutants = generate(a.only)
    if a.list:
        for m in mutants:
            print(f"{m.id}  {m.before!r} -> {m.after!r}")
        print(f"{len(mutants)} mutants")
        return 0
    t0 = time.monotonic()
    results = {}
    with ProcessPoolExecutor(max_workers=a.jobs) as ex:
        futs = {ex.submit(kill, asdict(m), a.budget, not a.no_suite): m for m in mutants}
        for i, fut in enumerate(as_completed(futs), 1):
            r = fut.result()
            results[r["id"]] = r
            if sys.stderr.isatty():
                sys.stderr.write(f"\r\033[K[{i}/{len(mutants)}] {r['id']} {r['status']}")
                sys.stderr.flush()
    if sys.stderr.isatty():
        sys.stderr.write("\r\033[K")
    rows = [asdict(m) | results[m.id] for m in mutants]
    killed = sum(r["status"] == "killed" for r in rows)
    out = {"command": "python tools/mutate.py " + " ".join(sys.argv[1:]), "mutants": len(rows), "killed": killed,
           "survived": len(rows) - killed, "score": round(killed / len(rows), 4) if rows else None,
           "budget": a.budget, "seconds": round(time.monotonic() - t0, 1),
           "by_operator": {op: {"mutants": sum(r["operator"] == op for r in rows),
                                "killed": sum(r["operator"] == op and r["status"] == "killed" for r in rows)}
                           for op in sorted({r["operator"] for r in rows})},
           "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"{killed}/{len(rows)} mutants killed ({100 * killed / max(len(rows), 1):.1f}%) in {out['seconds']:.0f} s; "
          f"wrote {a.out}")
    for r in rows:
        if r["status"] == "survived":
            print(f"  survived {r['id']}: {r['before']!r} -> {r['after']!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

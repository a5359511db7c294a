"""The package layout's import rules (README, "How kvspec is built"), read off the AST.

Each package's ``__init__`` docstring says what it may import; these tests hold the
code to it: the spec imports no other kvspec package, targets never reach up into
the checkers, nothing imports the CLI, and no module-level import cycle exists.
"""
from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# installed name -> folder (pyproject's package-dir)
FOLDERS = {"kvspec": ROOT / "kvspec", "kvspec.impl": ROOT / "impl", "kvspec.kernels": ROOT / "kernels",
           "kvspec.stateful": ROOT / "stateful"}
MAX_LINES = 450


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for pkg, folder in FOLDERS.items():
        for f in folder.rglob("*.py"):
            rel = f.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([pkg, *parts])
            if pkg == "kvspec" and parts and parts[0] in ("impl", "kernels", "stateful"):
                continue
            mods[name] = f
    return mods


MODULES = _modules()


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(name: str, top_level_only: bool = False) -> set[str]:
    """The kvspec modules ``name`` imports (a package's submodule when one is named)."""
    path = MODULES[name]
    tree = ast.parse(path.read_text())
    body = tree.body if top_level_only else list(ast.walk(tree))
    out: set[str] = set()
    for node in body:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("kvspec")}
        elif isinstance(node, ast.ImportFrom):
            mod = _resolve(name, path.name == "__init__.py", node)
            if not mod.startswith("kvspec"):
                continue
            for a in node.names:
                sub = f"{mod}.{a.name}"
                out.add(sub if sub in MODULES else mod)
    return {m for m in out if m != name}


def _package(mod: str) -> str:
    parts = mod.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else mod


# package -> packages it may never import (the rules in each __init__ docstring)
FORBIDDEN = {
    "kvspec.spec": {"kvspec.targets", "kvspec.check", "kvspec.mc", "kvspec.corpus", "kvspec.report", "kvspec.cli",
                    "kvspec.stateful", "kvspec.pytest_plugin", "kvspec.impl", "kvspec.kernels"},
    "kvspec.targets": {"kvspec.check", "kvspec.mc", "kvspec.corpus", "kvspec.report", "kvspec.cli",
                       "kvspec.stateful", "kvspec.pytest_plugin"},
    "kvspec.vllm": {"kvspec.check", "kvspec.mc", "kvspec.corpus", "kvspec.report", "kvspec.cli",
                    "kvspec.stateful", "kvspec.pytest_plugin"},
    "kvspec.alloc": {"kvspec.check", "kvspec.mc", "kvspec.corpus", "kvspec.report", "kvspec.cli",
                     "kvspec.stateful", "kvspec.pytest_plugin"},
    "kvspec.errors": {"*"},
    "kvspec.patching": {"*"},
    "kvspec.impl": {"*"},
    "kvspec.report": {"kvspec.cli", "kvspec.corpus", "kvspec.mc"},
    "kvspec.mc": {"kvspec.cli", "kvspec.corpus", "kvspec.report"},
    "kvspec.stateful": {"kvspec.cli", "kvspec.corpus", "kvspec.report", "kvspec.mc"},
}
# A leaf module may import these few of its own package's neighbours.
LEAF_OK = {"kvspec.patching": {"kvspec.errors"}}


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_import_rules(mod):
    pkg = _package(mod)
    banned = FORBIDDEN.get(pkg, set())
    bad = []
    for dep in imports_of(mod):
        dpkg = _package(dep)
        if dpkg == pkg:
            continue
        if (dep == "kvspec.cli" or dep.startswith("kvspec.cli.")) and mod != "kvspec.__main__":
            bad.append(dep)  # nothing imports the CLI but ``python -m kvspec``
        elif "*" in banned and dep not in LEAF_OK.get(pkg, set()):
            bad.append(dep)
        elif dpkg in banned:
            bad.append(dep)
    assert not bad, f"{mod} imports {sorted(bad)}, against the rules of {pkg} (see its __init__ docstring)"


def test_the_rules_see_a_violation():
    # the checker of the rules can fail: a synthetic spec module importing a target
    tree = ast.parse("from kvspec.targets.base import Target\n")
    node = tree.body[0]
    assert _resolve("kvspec.spec.ops", False, node) == "kvspec.targets.base"
    assert "kvspec.targets" in FORBIDDEN[_package("kvspec.spec.ops")]
    rel = ast.parse("from ..targets import base\n").body[0]
    assert _resolve("kvspec.spec.ops", False, rel) == "kvspec.targets"


def test_no_module_level_import_cycle():
    graph = {m: {d for d in imports_of(m, top_level_only=True) if d in MODULES} for m in MODULES}
    # a package's __init__ that re-exports its submodules is not a cycle with them
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in graph[m]:
            if d.startswith(m + "."):
                continue
            if state.get(d) == 1:
                cyc = stack[stack.index(d):] + [d]
                raise AssertionError("import cycle: " + " -> ".join(cyc))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_module_size(mod):
    path = MODULES[mod]
    n = len(path.read_text().splitlines())
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert n <= MAX_LINES or "longer than" in doc, \
        f"{path.relative_to(ROOT)} has {n} lines: split it, or say in its docstring why it is longer than {MAX_LINES}"


def test_every_package_says_what_it_is_for_and_may_import():
    for pkg in ("kvspec.spec", "kvspec.targets", "kvspec.check", "kvspec.mc", "kvspec.corpus", "kvspec.report",
                "kvspec.vllm", "kvspec.alloc"):
        doc = ast.get_docstring(ast.parse(MODULES[pkg].read_text())) or ""
        assert "May import" in doc, pkg


OLD_PATHS = ["kvspec.ops", "kvspec.observation", "kvspec.config", "kvspec.invariants", "kvspec.model",
             "kvspec.session", "kvspec.checker", "kvspec.minimize", "kvspec.repro", "kvspec.replay",
             "kvspec.canonical", "kvspec.enumerate_ops", "kvspec.corpus_runner", "kvspec.report_files",
             "kvspec.targets.vllm_target", "kvspec.engine.vllm_engine"]


@pytest.mark.parametrize("old", OLD_PATHS)
def test_old_import_paths_still_work_with_a_deprecation_warning(old):
    from kvspec._moved import MOVED

    code = textwrap.dedent(f"""
        import importlib, warnings
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            old = importlib.import_module({old!r})
        new = importlib.import_module({MOVED[old]!r})
        assert old is new, "the alias is the same module"
        assert new.__spec__.name == {MOVED[old]!r}
        assert any(issubclass(x.category, DeprecationWarning) and {MOVED[old]!r} in str(x.message) for x in w), w
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


OLD_REPRO = '''"""kvspec repro written by kvspec 0.1 (the flat layout): I4 on target 'impl' with a patch."""
import os

from kvspec.ops import Alloc, Cache, Free, Lookup
from kvspec.replay import replay

TARGET = 'impl'
CONFIG = {'level': 'pool', 'num_blocks': 4, 'block_size': 2, 'caching': True}
PATCH_TEXT = PATCH
STEPS = [
    Alloc(n=1),
    Cache(blocks=(1,), hashes=('a',)),
    Free(blocks=(1,)),
    Alloc(n=3),
    Lookup(hash='a'),
]


def test_i4_violation():
    env = os.environ.get("KVSPEC_PATCH")
    if env is None:
        replay(TARGET, CONFIG, STEPS, patch_text=PATCH_TEXT)
    else:
        replay(TARGET, CONFIG, STEPS, patch=None if env.lower() == "none" else env)
'''


def test_an_old_repro_file_still_replays(tmp_path):
    """A repro file of the flat layout imports kvspec.ops and kvspec.replay: it still fails
    on the patch it was written for and passes on the unpatched allocator."""
    patch = (ROOT / "kvspec" / "corpus" / "impl" / "no_evict.diff").read_text()
    f = tmp_path / "test_old_repro.py"
    f.write_text(OLD_REPRO.replace("PATCH_TEXT = PATCH", f"PATCH_TEXT = {patch!r}"))
    run = lambda env: subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(f)],
                                     capture_output=True, text=True, timeout=300, cwd=tmp_path,
                                     env={**__import__("os").environ, **env})
    failing = run({})
    assert failing.returncode == 1 and "I4" in failing.stdout, failing.stdout[-3000:]
    passing = run({"KVSPEC_PATCH": "none"})
    assert passing.returncode == 0, passing.stdout[-3000:]


def test_aliases_do_not_warn_for_the_new_paths():
    # a fresh interpreter: in this one the modules are imported already and could not warn
    code = "import kvspec.check.replay, kvspec.spec.ops, kvspec.cli, kvspec.pytest_plugin"
    r = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", code],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]

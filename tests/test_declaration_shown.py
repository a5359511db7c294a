"""Declarations by location, always shown (issue 20, item 1): kvspec's shipped declaration
for a released package applies only to that package's installed files, never to another
package that happens to share its name, and every output (text, JSON, Markdown, JUnit,
the repro's header, kvspec mc) says which declaration was used and where it came from.

Every search is bounded by an example count, never by seconds."""
import json
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kvspec.cli import main
from kvspec.targets import policies
from kvspec.targets.registry import load_target

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = (ROOT / "examples" / "my_block_manager.py").read_text()
BUGGY = (ROOT / "examples" / "my_block_manager_buggy.py").read_text()


def _fork(tmp_path: Path, source: str = EXAMPLE) -> Path:
    """A user's own package called ``nanovllm`` (a fork's name), not the installed one."""
    pkg = tmp_path / "fork" / "nanovllm"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "engine" / "__init__.py").write_text("")
    (pkg / "engine" / "block_manager.py").write_text(source)
    return pkg / "engine" / "block_manager.py"


def _installed_nano_file() -> Path:
    from importlib.metadata import PackageNotFoundError, distribution
    try:
        d = distribution("nano-vllm-fork")
    except PackageNotFoundError:
        pytest.skip("nano-vllm-fork is not installed")
    f = next((f for f in d.files or () if str(f).endswith("engine/block_manager.py")), None)
    if f is None:
        pytest.skip("nano-vllm-fork lists no engine/block_manager.py")
    return Path(d.locate_file(f)).resolve()


# -- by location, never by name ----------------------------------------------------------------
def test_a_fork_named_nanovllm_gets_no_shipped_declaration(tmp_path, capsys):
    bm = _fork(tmp_path)
    t = load_target(f"{bm}:BlockManager")
    # nano-vllm-fork's shipped declaration says free_evicts / admit_all_blocks: not applied here
    assert t.traits.declaration == "none: vLLM's defaults"
    assert not t.traits.free_evicts and not t.traits.admit_all_blocks
    assert policies.shipped_distribution(bm) is None


@pytest.fixture(autouse=True)
def nanovllm_modules():
    """Put back exactly the ``nanovllm`` modules there were: a fork is imported under its
    own package name, and must not linger for the next test (or stand in for the installed one)."""
    def ours(m: str) -> bool:
        return m == "nanovllm" or m.startswith("nanovllm.")
    saved, path = {m: mod for m, mod in sys.modules.items() if ours(m)}, list(sys.path)
    for m in saved:
        del sys.modules[m]
    yield
    for m in [m for m in sys.modules if ours(m)]:
        del sys.modules[m]
    sys.modules.update(saved)
    sys.path[:] = path  # the loader puts a FILE target's package root on the path
    import importlib
    importlib.invalidate_caches()


def test_a_fork_named_nanovllm_imported_by_module_name_gets_none_either(tmp_path, monkeypatch):
    bm = _fork(tmp_path)
    monkeypatch.syspath_prepend(str(bm.parents[2]))
    t = load_target("nanovllm.engine.block_manager:BlockManager")
    assert Path(sys.modules[t.manager_cls.__module__].__file__).resolve() == bm.resolve()
    assert t.traits.declaration == "none: vLLM's defaults" and not t.traits.free_evicts


def test_the_installed_distribution_still_gets_its_own():
    f = _installed_nano_file()
    dist, version = policies.shipped_distribution(f)
    assert dist == "nano-vllm-fork"
    t = load_target("nanovllm")
    assert t.traits.declaration == f"kvspec's declaration for nano-vllm-fork {version} (installed files)".replace(
        "  ", " ")
    assert t.traits.free_evicts and t.traits.admit_all_blocks  # KNOWN["nano-vllm-fork"]
    assert not t.traits.hintable  # a shipped declaration is declared: no hints second-guess it


def test_each_source_is_named(tmp_path):
    d = tmp_path / "proj"
    d.mkdir()
    (d / "bm.py").write_text(EXAMPLE.replace("class BlockManager:\n",
                                             'class BlockManager:\n    kvspec_traits = {"free_evicts": False}\n', 1))
    t = load_target(f"{d / 'bm.py'}:BlockManager")
    assert t.traits.declaration == "BlockManager.kvspec_traits"
    assert t.traits.hintable == frozenset(policies.HINTABLE) - {"free_evicts"}
    (d / "bm2.py").write_text(EXAMPLE)
    (d / "pyproject.toml").write_text('[tool.kvspec]\nadmit_all_blocks = false\n')
    t = load_target(f"{d / 'bm2.py'}:BlockManager")
    assert t.traits.declaration == f"[tool.kvspec] in {(d / 'pyproject.toml').resolve()}"
    assert load_target("impl").traits.declaration == "impl: KVCacheManager.kvspec_traits"


def test_names_and_protocol_subtables_pass_through(tmp_path):
    d = tmp_path / "proj"
    d.mkdir()
    (d / "bm.py").write_text(EXAMPLE)
    (d / "pyproject.toml").write_text(textwrap.dedent('''
        [tool.kvspec]
        free_evicts = false
        [tool.kvspec.names]
        [tool.kvspec.protocol]
    '''))
    assert policies.validate({"names": {"a": "b"}, "protocol": {}, "free_evicts": True}, "x") == {"free_evicts": True}
    t = load_target(f"{d / 'bm.py'}:BlockManager")
    assert t.traits.declaration.startswith("[tool.kvspec] in ")
    # a table of sub-tables only declares no policies: vLLM's defaults, named as such
    d2 = tmp_path / "proj2"
    d2.mkdir()
    (d2 / "pyproject.toml").write_text('[tool.kvspec.names]\n[tool.kvspec.protocol]\n')
    (d2 / "bm.py").write_text(EXAMPLE)
    assert load_target(f"{d2 / 'bm.py'}:BlockManager").traits.declaration == "none: vLLM's defaults"


# -- shown in every output ----------------------------------------------------------------------
def test_every_check_output_names_the_declaration(tmp_path, capsys):
    bm = _fork(tmp_path, BUGGY)
    spec = f"{bm}:BlockManager"
    out = tmp_path / "out"
    assert main(["check", "--target", spec, "--max-examples", "300", "--report-dir", str(out)]) == 1
    text = capsys.readouterr().out
    assert "  declaration: none: vLLM's defaults" in text.splitlines()[1]
    d = json.loads((out / "kvspec-check.json").read_text())
    assert d["declaration"] == "none: vLLM's defaults"
    assert "| declaration | none: vLLM's defaults |" in (out / "kvspec-check.md").read_text()
    props = {p.get("name"): p.get("value") for p in ET.parse(out / "kvspec-check.junit.xml").iter("property")}
    assert props["declaration"] == "none: vLLM's defaults"
    repro = Path(d["violations"][0]["repro"]).read_text()
    assert "Declaration: none: vLLM's defaults." in repro


def test_mc_names_the_declaration(tmp_path, capsys):
    d = tmp_path / "proj"
    d.mkdir()
    (d / "bm.py").write_text(EXAMPLE.replace("class BlockManager:\n",
                                             'class BlockManager:\n    kvspec_traits = {"free_evicts": False}\n', 1))
    argv = ["mc", "--target", f"{d / 'bm.py'}:BlockManager", "--level", "cache", "--blocks", "2", "--depth", "2",
            "--report-dir", str(tmp_path / "mc")]
    assert main(argv) == 0
    assert capsys.readouterr().out.splitlines()[1] == "  declaration: BlockManager.kvspec_traits"
    assert main(argv + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["declaration"] == "BlockManager.kvspec_traits"

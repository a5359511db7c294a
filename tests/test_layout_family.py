"""``--kv-groups with:KIND``: a family of layouts, each example drawing one that has a
KIND group (the release sweep's pass per opt-in group kind, tools/vllm_releases.py)."""
import subprocess
import sys

import pytest

from kvspec.check.search import LevelSearch
from kvspec.stateful.base import KVMachine
from kvspec.stateful.cache import drawable, family_layouts, layout_family, missing_kinds
from kvspec.targets.registry import load_target


def test_the_family_is_the_drawable_layouts_with_that_kind():
    impl = load_target("impl")
    missing = missing_kinds(impl.traits)
    swa = family_layouts("swa", missing)
    assert swa and len(set(swa)) == len(swa)
    assert set(swa) == {s for s in drawable(missing)[0] if "swa" in {p.partition(":")[0] for p in s.split(",")}}
    assert family_layouts("compressed", missing) == ()   # impl does not build the opt-in kind
    assert layout_family("with:swa") == "swa" and layout_family("full,swa:2") is None and layout_family(None) is None


def test_every_example_draws_a_layout_of_the_family(monkeypatch):
    seen = []
    real = KVMachine.start

    def start(self, config):
        seen.append(config.kv_groups)
        return real(self, config)

    monkeypatch.setattr(KVMachine, "start", start)
    search = LevelSearch(load_target("impl"), "cache", misuse=False, seed=0, kv_groups="with:swa")
    assert search.run_batch(40) is None   # kvspec's own allocator is clean
    assert len(seen) >= 40
    assert all("swa" in {p.partition(":")[0] for p in s.split(",")} for s in seen), seen
    assert len(set(seen)) > 1   # a family, not one pinned layout


@pytest.mark.parametrize("args, message", [
    (["--kv-groups", "with:mamba"], "no layout it builds has a 'mamba' group"),
    (["--kv-groups", "with:swa", "--level", "engine", "--target", "vllm"], "the engine level takes one layout"),
])
def test_a_family_the_run_cannot_draw_is_one_line_and_exit_2(args, message, tmp_path):
    argv = [sys.executable, "-m", "kvspec", "check", "--max-examples", "3", "--report-dir", str(tmp_path)]
    argv += args if "--target" in args else args + ["--target", "impl", "--level", "cache"]
    r = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith(("INFO", "WARNING"))]
    assert len(lines) == 1 and message in lines[0], r.stderr


def test_the_model_checker_refuses_a_family_in_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvspec", "mc", "--target", "impl", "--level", "cache",
                        "--kv-groups", "with:swa", "--depth", "2"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "explores one layout" in r.stderr, r.stderr

"""The API contract (issue 20, item 4): every call kvspec will make is checked against the
class's signature before the first step, defaults and keywords included; a mismatch is
exit 2 with the expected call, never a finding or a repro; kvspec's own binding error at
call time is kvspec's; ``kvspec api`` prints the same tables the check reads.

The managers are this project's examples/my_block_manager.py and kvspec's own impl
BlockPool, changed here in the one signature each test is about."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvspec.cli import main
from kvspec.targets import contract
from kvspec.targets.base import TargetError
from kvspec.targets.nanovllm_target import NANO_CALLS
from kvspec.targets.registry import load_target
from kvspec.targets.user_target import API_METHODS

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = (ROOT / "examples" / "my_block_manager.py").read_text()


def _kvspec(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-m", "kvspec", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def _write(tmp: Path, name: str, src: str) -> str:
    (tmp / f"{name}.py").write_text(src)
    return f"{tmp / name}.py"


def test_can_allocate_taking_an_int_is_exit_2_with_the_expected_call_and_no_repro(tmp_path):
    src = EXAMPLE.replace("    def can_allocate(self, seq) -> bool:\n",
                          "    def can_allocate(self, num_tokens: int) -> bool:\n        seq = num_tokens\n")
    _write(tmp_path, "int_admission", src)
    reports = tmp_path / "reports"
    r = _kvspec(tmp_path, "check", "--target", "int_admission.py:BlockManager", "--max-examples", "20",
                "--report-dir", str(reports))
    assert r.returncode == 2, r.stdout + r.stderr
    errors = [ln for ln in r.stderr.splitlines() if "error" in ln]
    assert len(errors) == 1
    assert "BlockManager.can_allocate(self, num_tokens: int) cannot be called as can_allocate(seq: Sequence)" \
        in errors[0]
    assert "NO_CRASH" not in r.stdout + r.stderr
    assert not reports.exists() or not list(reports.rglob("*repro*"))


def test_a_pool_cache_full_blocks_with_other_parameters_is_exit_2_not_a_finding(tmp_path):
    src = ("import sys\nsys.path.insert(0, %r)\nfrom impl.block_pool import BlockPool as _Pool\n\n"
           "class BlockPool(_Pool):\n    def cache_full_blocks(self, blocks, hashes):\n"
           "        return super().cache_full_blocks(blocks, hashes, 0, len(blocks))\n") % str(ROOT)
    _write(tmp_path, "two_arg_cache", src)
    reports = tmp_path / "reports"
    r = _kvspec(tmp_path, "check", "--target", "two_arg_cache.py:BlockPool", "--max-examples", "20",
                "--report-dir", str(reports))
    assert r.returncode == 2, r.stdout + r.stderr
    assert ("BlockPool.cache_full_blocks(self, blocks, hashes) cannot be called as cache_full_blocks(blocks: "
            "list[Block], block_hashes: list[bytes], num_cached_blocks: int, num_full_blocks: int)") in r.stderr
    assert not reports.exists() or not list(reports.rglob("*repro*"))


def test_a_defaulted_extra_parameter_is_fine(tmp_path, monkeypatch):
    src = EXAMPLE.replace("    def allocate(self, seq) -> None:\n", "    def allocate(self, seq, plan=None) -> None:\n")
    src = src.replace("    def deallocate(self, seq) -> None:\n",
                      "    def deallocate(self, seq, *, reason: str = 'finish') -> None:\n")
    assert "plan=None" in src and "reason" in src
    monkeypatch.chdir(tmp_path)
    target = load_target(_write(tmp_path, "defaulted", src) + ":BlockManager")
    assert target.api == "boolean"


class _Seq:  # stands for a Sequence in the unit checks below
    pass


@pytest.mark.parametrize("signature, fits", [
    ("(self, seq)", True),
    ("(self, seq, plan=None)", True),
    ("(self, *args)", True),
    ("(self, seq, **kw)", True),
    ("(self)", False),
    ("(self, seq, n)", False),
    ("(self, seq, *, must)", False),
    ("(self, seq: int)", False),
    ("(self, seq: 'Sequence')", True),
])
def test_binding_rules(signature, fits):
    ns: dict = {}
    exec(f"class M:\n    def can_allocate{signature}:\n        pass\n", ns)
    call = contract.Call("can_allocate", ("seq: Sequence",), "bool")
    assert (contract.mismatch(ns["M"], call) is None) == fits


def test_alternative_forms_and_optional_calls():
    class M:
        def hash_blocks(self, seq, n):
            pass

    both = contract.Call("hash_blocks", ("seq: Sequence",), "None", alternatives=(("seq: Sequence", "n: int"),))
    assert contract.mismatch(M, both) is None
    assert contract.mismatch(M, contract.Call("absent", (), "None", optional=True)) is None
    assert "has no absent" in contract.mismatch(M, contract.Call("absent", (), "None"))


def test_the_nano_check_reads_the_drivers_own_table():
    """Each generation's methods in ``kvspec api nanovllm`` are exactly NANO_CALLS's."""
    styles = {s.style: s for s in contract.nano_styles()}
    assert set(styles) == set(NANO_CALLS)
    for gen, rows in NANO_CALLS.items():
        assert [c.method for c in styles[gen].calls if c.method != "__init__"] == [r.method for r in rows]


def test_binding_error_at_call_time_is_kvspecs_not_the_targets():
    from kvspec.targets.watchdog import guarded

    def takes_one(seq):
        return seq

    with pytest.raises(TypeError) as bound:  # kvspec's frame made the call that did not bind
        guarded(None, takes_one, 1, 2)
    assert contract.binding_error(bound.value) is not None

    def raises_inside(seq):
        return takes_one(seq, seq)  # the target's own TypeError: a finding, not kvspec's

    with pytest.raises(TypeError) as own:
        guarded(None, raises_inside, 1)
    assert contract.binding_error(own.value) is None
    assert contract.binding_error(ValueError("positional argument")) is None


def test_describe_exception_names_a_bare_assert(tmp_path):
    import importlib.util
    f = tmp_path / "insists_bm.py"  # a module of its own: pytest rewrites asserts only in tests
    f.write_text("def build(block_size):\n    assert block_size == 256\n")
    spec = importlib.util.spec_from_file_location("insists_bm", f)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with pytest.raises(AssertionError) as e:
        mod.build(2)
    assert contract.describe_exception(e.value) == "AssertionError at insists_bm.py:2: assert block_size == 256"
    assert contract.describe_exception(ValueError("bad")) == "ValueError: bad"


def test_kvspec_api_lists_every_method_of_each_api(capsys):
    assert main(["api"]) == 0
    out = capsys.readouterr().out
    for api, methods in API_METHODS.items():
        assert contract.API_TITLES[api] in out
        for m in methods:
            assert f"  {m}(" in out, (api, m)
    for m in ("free_block_ids", "hash_to_block_id", "ref_count", "free_block_queue", "cached_block_hash_to_block",
              "ref_cnt", "block_hash", "kvspec_observe", "[tool.kvspec.names]"):
        assert m in out


def test_kvspec_api_one_api_and_json(capsys):
    assert main(["api", "blockpool"]) == 0
    out = capsys.readouterr().out
    assert "cache_full_blocks(" in out and "can_allocate" not in out
    assert main(["api", "nanovllm", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert list(data) == ["nanovllm"]
    methods = {c["method"] for s in data["nanovllm"] for c in s["calls"]}
    assert {"can_allocate", "allocate", "deallocate", "can_append", "may_append"} <= methods
    assert main(["api", "bogus"]) == 2


def test_the_v1_check_uses_the_rendered_table():
    """The impl-style calls checked are the rendered ones: kvspec's own impl passes them."""
    sys.path.insert(0, str(ROOT))
    try:
        from impl.block_pool import BlockPool
        from impl.kv_cache_manager import KVCacheManager
    finally:
        sys.path.remove(str(ROOT))
    contract.check_v1("impl", "blockpool", False, BlockPool)
    contract.check_v1("impl", "kvcachemanager", False, KVCacheManager)

    class Narrow(BlockPool):
        def get_new_blocks(self):
            return []

    with pytest.raises(TargetError, match=r"get_new_blocks\(self\) cannot be called as get_new_blocks\(num_blocks"):
        contract.check_v1("narrow", "blockpool", False, Narrow)

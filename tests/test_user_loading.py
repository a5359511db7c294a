"""Loading a user's allocator as the user's own code runs (issue 20, item 3): a
``FILE.py:NAME`` inside a package is imported under its real name from the package root
without the parents' heavy ``__init__``; sibling modules resolve; a missing third-party
module the import needs only by name is stood in for (with a note), and calling it is
kvspec's error, never a finding; ``module:NAME`` finds modules in the working directory;
an import that hangs is bounded by ``--op-timeout``; ``--patch`` on such a file works.

Every package here is written in the test's tmp_path (this project's own code, built from
examples/my_block_manager.py). The command runs in a subprocess from tmp_path, as a user
would run it, with PYTHONPATH cleared."""
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from kvspec.targets.file_import import package_root
from kvspec.targets.registry import load_target
from kvspec.targets.user_target import load_object

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = (ROOT / "examples" / "my_block_manager.py").read_text()


def _kvspec(cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-m", "kvspec", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _manager(imports: str = "", body_prefix: str = "") -> str:
    """The example manager with ``imports`` added at the top of the module."""
    return EXAMPLE.replace("from collections import deque\n", f"from collections import deque\n{imports}\n", 1) \
        + body_prefix


SEQUENCE = '''
class Sequence:
    """A nano-vllm-shaped Sequence (this package's own)."""
    block_size = 2

    def __init__(self, token_ids):
        self.token_ids = list(token_ids)
        self.block_table = []
        self.num_cached_tokens = 0
        self.num_scheduled_tokens = 0

    def __len__(self):
        return len(self.token_ids)

    @property
    def num_blocks(self):
        return (len(self.token_ids) + self.block_size - 1) // self.block_size

    @property
    def last_block_num_tokens(self):
        return len(self.token_ids) - (self.num_blocks - 1) * self.block_size

    def block(self, i):
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_token(self, token_id):
        self.token_ids.append(token_id)
'''


def _package(tmp: Path, name: str, manager_src: str, engine_init: bool = True) -> Path:
    """tmp/NAME/__init__.py imports a GPU library that does not exist; NAME/engine/ has the
    manager, its sibling sequence.py and a config.py."""
    pkg = tmp / name
    (pkg / "engine").mkdir(parents=True)
    (pkg / "__init__.py").write_text("import nonexistent_gpu_lib  # a heavy __init__ kvspec must not run\n")
    if engine_init:
        (pkg / "engine" / "__init__.py").write_text("raise RuntimeError('the engine __init__ must not run')\n")
    (pkg / "engine" / "sequence.py").write_text(SEQUENCE)
    (pkg / "engine" / "config.py").write_text("KVCACHE_BLOCK_SIZE = 2\n")
    (pkg / "engine" / "block_manager.py").write_text(manager_src)
    return pkg / "engine" / "block_manager.py"


def test_file_in_a_package_loads_with_relative_and_absolute_sibling_imports(tmp_path):
    _package(tmp_path, "pkg", _manager("from .sequence import Sequence\nfrom pkg.engine.config import "
                                       "KVCACHE_BLOCK_SIZE\n"))
    r = _kvspec(tmp_path, "check", "--target", "pkg/engine/block_manager.py:BlockManager", "--max-examples", "20")
    assert r.returncode in (0, 1), r.stderr
    assert "nonexistent_gpu_lib" not in r.stderr


def test_nano_vllm_layout_without_engine_init_and_an_installed_namesake(tmp_path):
    """nano-vllm's own layout: engine/ has no __init__.py and the manager imports
    ``nanovllm.engine.sequence`` by its absolute name; an installed nano-vllm of the same
    name must not be the one loaded."""
    marker = "\nLOADED_FROM_THE_USERS_FORK = True\n"
    bm = _package(tmp_path, "nanovllm", _manager("from nanovllm.engine.sequence import Sequence\n") + marker,
                  engine_init=False)
    assert package_root(bm) == (tmp_path, "nanovllm.engine.block_manager")
    probe = ("import sys; from kvspec.targets.user_target import load_object; "
             "obj, mod = load_object('nanovllm/engine/block_manager.py:BlockManager'); "
             "print(mod.__name__, mod.__file__, getattr(mod, 'LOADED_FROM_THE_USERS_FORK', False), "
             "mod.Sequence.__module__)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    name, file, marked, seq_mod = r.stdout.split()
    assert name == "nanovllm.engine.block_manager" and Path(file) == bm and marked == "True"
    assert seq_mod == "nanovllm.engine.sequence"


def test_package_root_rules(tmp_path):
    flat = tmp_path / "flat.py"
    flat.write_text("import os\n")
    assert package_root(flat) is None  # no package: executed as a fresh module, as before
    d = tmp_path / "a" / "b"
    d.mkdir(parents=True)
    (tmp_path / "a" / "__init__.py").write_text("")
    (d / "__init__.py").write_text("")
    (d / "m.py").write_text("from . import x\n")
    assert package_root(d / "m.py") == (tmp_path, "a.b.m")
    ns = tmp_path / "ns" / "inner"
    ns.mkdir(parents=True)
    (ns / "m.py").write_text("from ..other import y\n")  # relative imports, no __init__ files
    assert package_root(ns / "m.py") == (tmp_path, "ns.inner.m")


def test_a_missing_third_party_module_is_stood_in_for_with_a_note(tmp_path):
    _package(tmp_path, "pkg", _manager("from .sequence import Sequence\nimport flash_attn_not_installed_kv\n"
                                       "from torch_npu_not_installed_kv.ops import fused as _fused\n"
                                       "@flash_attn_not_installed_kv.jit\ndef _kernel():\n    pass\n"))
    r = _kvspec(tmp_path, "check", "--target", "pkg/engine/block_manager.py:BlockManager", "--max-examples", "10")
    assert r.returncode in (0, 1), r.stderr
    for mod in ("flash_attn_not_installed_kv", "torch_npu_not_installed_kv"):
        assert f"kvspec: note: stubbed missing module {mod} to import pkg.engine.block_manager" in r.stderr


def test_calling_a_stood_in_module_is_kvspecs_error_not_a_finding(tmp_path):
    src = _manager("from .sequence import Sequence\nimport fast_hash_not_installed_kv\n")
    src = src.replace("    def can_allocate(self, seq) -> bool:\n",
                      "    def can_allocate(self, seq) -> bool:\n        fast_hash_not_installed_kv.digest(seq.block(0))\n")
    _package(tmp_path, "pkg", src)
    reports = tmp_path / "reports"
    r = _kvspec(tmp_path, "check", "--target", "pkg/engine/block_manager.py:BlockManager", "--max-examples", "10",
                "--report-dir", str(reports))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "fast_hash_not_installed_kv" in r.stderr and "not installed" in r.stderr
    assert not reports.exists() or not list(reports.rglob("*repro*"))


def test_module_target_from_the_working_directory_without_pythonpath(tmp_path):
    """``python -I`` puts neither the working directory nor PYTHONPATH on sys.path (as the
    ``kvspec`` console script does not put the working directory there): kvspec must."""
    (tmp_path / "my_alloc_mod.py").write_text(EXAMPLE)
    r = subprocess.run([sys.executable, "-I", "-m", "kvspec", "check", "--target", "my_alloc_mod:BlockManager",
                        "--max-examples", "10"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode in (0, 1), r.stderr


def test_an_import_that_hangs_is_bounded_by_op_timeout(tmp_path):
    (tmp_path / "slow_mod.py").write_text("import time\ntime.sleep(600)\n" + EXAMPLE)
    r = _kvspec(tmp_path, "check", "--target", "slow_mod.py:BlockManager", "--max-examples", "5",
                "--op-timeout", "1", timeout=200)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("kvspec: error")]
    assert len(lines) == 1 and "importing slow_mod.py did not finish within 1 s" in lines[0]


def test_patch_on_a_file_in_a_package(tmp_path, monkeypatch):
    name = f"pkg_{uuid.uuid4().hex[:8]}"
    bm = _package(tmp_path, name, _manager(f"from .sequence import Sequence\nfrom {name}.engine.config import "
                                           "KVCACHE_BLOCK_SIZE\n") + "\nPATCHED = False\n")
    monkeypatch.chdir(tmp_path)
    rel = f"{name}/engine/block_manager.py"
    lines = bm.read_text().splitlines()
    n = len(lines)
    diff = textwrap.dedent(f"""\
        --- a/{rel}
        +++ b/{rel}
        @@ -{n},1 +{n},1 @@
        -PATCHED = False
        +PATCHED = True
        """)
    try:
        _, plain = load_object(f"{rel}:BlockManager")
        _, patched = load_object(f"{rel}:BlockManager", diff)
        assert plain.__name__ == patched.__name__ == f"{name}.engine.block_manager"
        assert plain.PATCHED is False and patched.PATCHED is True
        assert sys.modules[plain.__name__] is plain  # the patched copy lived only for its import
        (tmp_path / "fix.diff").write_text(diff)
        target = load_target(f"{rel}:BlockManager", patch=str(tmp_path / "fix.diff"))
        assert target.name.endswith("+" + str(tmp_path / "fix.diff"))
    finally:
        for m in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[m]
        sys.path[:] = [p for p in sys.path if p != str(tmp_path)]


def test_a_bare_assert_in_the_constructor_says_what_kvspec_tried(tmp_path):
    src = EXAMPLE.replace("        self.block_size = block_size\n",
                          "        assert block_size == 256\n        self.block_size = block_size\n", 1)
    (tmp_path / "insists.py").write_text(src)
    r = _kvspec(tmp_path, "check", "--target", "insists.py:BlockManager", "--max-examples", "5")
    if r.returncode != 2:
        pytest.skip("the nano driver built the manager with its own block size (issue 20 item 6)")
    assert "assert block_size == 256" in r.stderr and "block_size=" in r.stderr


def test_the_import_limit_is_op_timeout_for_the_users_code_only(tmp_path, monkeypatch):
    """Code under the working directory gets --op-timeout; an installed package (vLLM's
    import alone outlasts a 10 s call limit) gets at least DEPENDENCY_LIMIT_S."""
    from kvspec.targets import watchdog
    from kvspec.targets.file_import import DEPENDENCY_LIMIT_S, import_limit

    monkeypatch.chdir(tmp_path)
    saved = watchdog.default()
    watchdog.set_default(3)
    try:
        assert import_limit("mine", tmp_path / "mine" / "engine" / "bm.py") == (3, "--op-timeout")
        seconds, why = import_limit("pytest")  # installed, outside the working directory
        assert seconds == DEPENDENCY_LIMIT_S and "installed" in why
    finally:
        watchdog.set_default(saved)

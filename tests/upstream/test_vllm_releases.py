"""The `vllm` target on older vLLM releases: feature detection and a short drive, each in
a subprocess whose PYTHONPATH puts the release's extracted tree first (it shadows the
installed 0.33.0). Releases come from tools/vllm_releases.py's cache
(``~/.cache/kvspec/vllm-releases/X``, or ``$KVSPEC_VLLM_RELEASES``); CI never downloads
them, so a release that is not there is skipped with that reason.

What each release should look like is read off its own sources (the files the adapter
imports), never written down here."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.upstream, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("KVSPEC_VLLM_RELEASES", Path.home() / ".cache" / "kvspec" / "vllm-releases"))
# The oldest release (open free list, no null block, builtin hash, 0.8's manager) and
# one from the middle (sentinels, null block, Request without a hasher, grouped touch).
RELEASES = ("0.8.0", "0.10.0")

DRIVE = r"""
import json, sys
from pathlib import Path
import vllm
from kvspec.check.search import run_check
from kvspec.check.session import Session
from kvspec.spec.config import Config
from kvspec.spec.ops import Alloc, Cache, Free, Lookup, Touch
from kvspec.vllm import compat as c
from kvspec.vllm.target import VllmTarget

t = VllmTarget()
hashes, by_group, grouped = c.pool_api(t.up.block_pool.BlockPool)
s = Session(t, Config(level="pool", num_blocks=4, block_size=2))
out = {"file": vllm.__file__, "null_block": t.traits.null_block, "hashes_arg": hashes, "by_group": by_group,
       "grouped_touch": grouped, "hasher": t.up.request_hasher(2) is not None, "violations": []}
s.apply(Alloc(2))
ids = s.last_result
# Only hashed blocks are freed: every release puts those at the tail, whatever it does
# with unhashed ones.
for op in (Cache((ids[0], ids[1]), ("a", "b")), Free((ids[0], ids[1])), Lookup("b"), Touch((ids[1],)),
           Free((ids[1],)), Lookup("a")):
    out["violations"] += [v.message for v in s.apply(op)]
    out[type(op).__name__] = s.last_result
out["cached"] = list(ids)
rep = run_check(t, "vllm", level="pool", seed=0, max_examples=40, report_dir=sys.argv[1])
out["check"] = [rep.verdict] + [[v.invariant, len(v.steps)] for v in rep.violations]
print(json.dumps(out))
"""


def _source(tree: Path, rel: str) -> str:
    return (tree / "vllm" / rel).read_text()


def _def(src: str, name: str) -> str:
    """The text of ``def name(...)`` up to the next def at the same indent."""
    m = re.search(rf"\n(\s*)def {name}\(.*?(?=\n\1def |\Z)", src, re.S)
    assert m, f"no def {name}"
    return m.group(0)


@pytest.mark.parametrize("version", RELEASES)
def test_old_release_is_detected_and_driven(version, tmp_path):
    tree = CACHE / version
    if not (tree / "vllm" / "v1" / "core" / "block_pool.py").is_file():
        pytest.skip(f"vLLM {version} is not in {CACHE} (python tools/vllm_releases.py --releases {version})")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(CACHE / "_deps"), str(ROOT)]))
    r = subprocess.run([sys.executable, "-c", DRIVE, str(tmp_path)], env=env, capture_output=True, text=True,
                       cwd=tmp_path, timeout=600)
    line = next((ln for ln in reversed(r.stdout.splitlines()) if ln.startswith("{")), None)
    if r.returncode and line is None and "ModuleNotFoundError" in r.stderr:
        pytest.skip(f"vLLM {version} needs a package that is missing here: {r.stderr.strip().splitlines()[-1]}")
    assert line is not None, r.stderr[-2000:]
    got = json.loads(line)
    assert Path(got["file"]).resolve().is_relative_to(tree.resolve())  # the release, not 0.33.0

    pool = _source(tree, "v1/core/block_pool.py")
    utils = _source(tree, "v1/core/kv_cache_utils.py")
    assert got["null_block"] == ("self.null_block" in pool)
    assert got["hashes_arg"] == ("block_hashes" in _def(pool, "cache_full_blocks").split(")")[0])
    assert got["by_group"] == ("kv_cache_group_ids" in _def(pool, "get_cached_block").split(")")[0])
    assert got["grouped_touch"] == ("tuple[" in _def(pool, "touch").split(")")[0])
    assert got["hasher"] == ("def get_request_block_hasher" in utils)

    # The drive: two cached blocks freed (LRU tail), one found again and touched back out.
    assert got["violations"] == []
    a, b = got["cached"]
    assert got["Lookup"] == a and got["Touch"] is None

    # Whether the release puts unhashed blocks first is read off its free_blocks: if it
    # does not, kvspec (checking vLLM's current policy) must say so in a few steps.
    prepends = "prepend" in _def(pool, "free_blocks")
    if prepends:
        assert got["check"][0] == "pass", got["check"]
    else:
        assert got["check"][0] == "violation" and got["check"][1][0] == "EVICTION_ORDER" \
            and got["check"][1][1] <= 3, got["check"]


FEATURES = r"""
import json
from kvspec.vllm.target import VllmTarget
t = VllmTarget()
print(json.dumps({"groups": t.groups, "missing": sorted(t.traits.cache_missing),
                  "layout": t.cache_api.mm_layout if t.cache_api else None}))
"""


@pytest.mark.parametrize("version", ("0.9.0", "0.14.0"))
def test_cache_features_are_read_off_the_release(version, tmp_path):
    """What the groups driver draws on a release follows its sources: several groups only
    with a coordinator, a group kind only with its spec class, connector tokens only where
    allocate_slots takes them, multimodal keys in the Request's own layout."""
    tree = CACHE / version
    if not (tree / "vllm" / "v1" / "core" / "block_pool.py").is_file():
        pytest.skip(f"vLLM {version} is not in {CACHE} (python tools/vllm_releases.py --releases {version})")
    sys.path.insert(0, str(ROOT / "tools"))
    import vllm_releases
    r = subprocess.run([sys.executable, "-c", FEATURES], env=vllm_releases.env_for(version), capture_output=True,
                       text=True, cwd=tmp_path, timeout=900)
    line = next((ln for ln in reversed(r.stdout.splitlines()) if ln.startswith("{")), None)
    assert line is not None, r.stderr[-2000:]
    got = json.loads(line)
    iface = _source(tree, "v1/kv_cache_interface.py")
    mgr = _source(tree, "v1/core/kv_cache_manager.py")
    req = _def(_source(tree, "v1/request.py"), "__init__").split(")")[0]
    assert got["groups"] is True   # both build their manager from a KVCacheConfig
    missing = set(got["missing"])
    assert ("groups" in missing) == (not (tree / "vllm" / "v1" / "core" / "kv_cache_coordinator.py").is_file())
    assert ("chunked" in missing) == ("class ChunkedLocalAttentionSpec" not in iface)
    assert ("swa" in missing) == ("class SlidingWindowSpec" not in iface)
    assert ("external" in missing) == ("num_external_computed_tokens" not in _def(mgr, "allocate_slots"))
    assert ("salt" in missing) == ("cache_salt" not in req)
    assert got["layout"] == ("features" if "mm_features" in req else "hashes")

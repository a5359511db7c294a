"""Replaying op sequences on cached vLLM release trees, for the tests of shipped bugs.

Each release runs in one subprocess whose PYTHONPATH puts the release first
(``tools/vllm_releases.py``'s ``env_for``). Without the release tree (the tool fetches it
into ~/.cache/kvspec/vllm-releases) the test skips and says so.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import vllm_releases  # noqa: E402

OLD_POLICY = "unhashed_free_first=false"   # the free-queue policy of 0.9.0 to 0.23's time (POLICY_HISTORY)

_REPLAY = r'''
import json
from kvspec.check.replay import replay_outcome
from kvspec.spec.ops import *
from kvspec.vllm.inputs import features
CASES = CASES_HERE
out = {"features": sorted(features())}
for name, cfg, steps in CASES:
    o = replay_outcome("vllm", cfg, steps, op_timeout=60.0)
    out[name] = [o.index, o.invariant, o.violations[0].message] if o.failed else None
print("RESULT " + json.dumps(out))
'''


def ready(version: str) -> str:
    """Empty when the release tree and its deps are cached; else why not."""
    tree = vllm_releases.tree(version)
    if not (tree / ".complete").exists():
        return f"vLLM {version} release tree not cached at {tree} (python tools/vllm_releases.py fetches it)"
    missing = [p for p in vllm_releases.deps_path(version) if not Path(p).is_dir()]
    if missing:
        return f"vLLM {version} extra deps not installed: {', '.join(missing)} (vllm_releases.install_deps())"
    return ""


def replay_on(version: str, cases: str, policies: str = "") -> dict:
    """``cases``: Python source of a list of (name, config dict, steps). Returns
    {"features": the release's deployment inputs, name: [index, invariant, message] or None}."""
    why = ready(version)
    if why:
        pytest.skip(why)
    code = _REPLAY.replace("CASES_HERE", cases)
    r = subprocess.run([sys.executable, "-c", code], env=vllm_releases.env_for(version, policies=policies),
                       capture_output=True, text=True, cwd=tempfile.gettempdir(), timeout=900)   # a loaded box: import alone takes minutes
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, r.stderr[-2000:]
    return json.loads(line[len("RESULT "):])

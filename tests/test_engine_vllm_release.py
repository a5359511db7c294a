"""vLLM 0.9.0's #19459 through its own v1 Scheduler (the engine level on a release tree).

#19459: a request's ``req_to_block_hashes`` entry survives preemption; with n-gram
speculative decoding an accepted draft can carry the request past a block boundary that
its hashes do not cover yet, so on re-admission ``find_longest_cache_hit`` indexes past
the list (``block_hash = block_hashes[i]``, IndexError). The events below reach it
through 0.9.0's real scheduler: two requests, drafts proposed, one accepted, the later
request preempted by the earlier one's growth, then re-admitted. The controls show what
it needs: no accepted draft, no preemption (a bigger pool), or prefix caching off, and
the same events pass. Then the search finds it too, with the engine machine's default
draws (no monkeypatching), within 300 examples at seed 0 (14; 181 at seed 1, 309 at seed 2).
Its minimized repro is a file of engine events that replays the IndexError.

The release tree comes from ``tools/vllm_releases.py`` (``fetch('0.9.0')`` and
``install_deps()``, into ~/.cache/kvspec/vllm-releases); without it the test skips and
says so. Each case runs in one subprocess whose PYTHONPATH puts the release first.
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

VERSION = "0.9.0"
POLICIES = "unhashed_free_first=false"   # the free-queue policy of 0.9.0's time (vllm_releases.POLICY_HISTORY)

CASES = r'''
import json
from kvspec.check.replay import replay_outcome
from kvspec.spec.ops import Arrive, EngineStep, op_from_dict

BASE = dict(level="engine", num_blocks=7, block_size=4, caching=True, kv_groups="full", spec_tokens=2)

def events(accepted):
    return [Arrive(req="r2", prompt=(11, 12, 13, 14, 21, 22, 23, 24), max_tokens=8, extra=None),
            Arrive(req="r1", prompt=(21, 22, 23, 24, 1, 2), max_tokens=8, extra=None),
            EngineStep(token=1, drafts=2, accepted=0),         # prefill both; drafts proposed
            EngineStep(token=1, drafts=2, accepted=accepted),  # r1: 1 draft kept, 7 -> 9 tokens
            EngineStep(token=1),                               # r2 grows, r1 (last) is preempted
            EngineStep(token=1)]                               # r1 re-admitted: get_computed_blocks

out = {}
for name, cfg, acc in [("found", BASE, 1), ("no_draft_accepted", BASE, 0),
                       ("no_preemption", dict(BASE, num_blocks=16), 1), ("caching_off", dict(BASE, caching=False), 1)]:
    o = replay_outcome("vllm", cfg, events(acc), op_timeout=60.0)
    out[name] = [o.index, o.invariant, o.violations[0].message] if o.failed else None

# The search: the engine machine's default draws, bounded by examples (14 at seed 0)
import contextlib, io
from kvspec.cli import main
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    main(["check", "--target", "vllm", "--level", "engine", "--max-examples", "300", "--seed", "0", "--json",
          "--report-dir", REPORT_DIR])
report = next(json.loads(ln) for ln in buf.getvalue().splitlines() if ln.startswith("{"))
found = report.get("violations") or [{}]
# every distinct finding is reported (--max-findings): #19459's is the one with the IndexError
v = next((x for x in found if "IndexError" in (x.get("message") or "")), found[0])
out["findings"] = [[x.get("invariant"), (x.get("message") or "")[:200]] for x in found]
out["search"] = [report.get("verdict"), v.get("invariant"), v.get("message"), [s["op"] for s in v.get("steps", [])],
                 v.get("repro"), v.get("examples_to_failure")]
if v.get("repro"):   # the minimized repro replays on the release: the same crash, at its last event
    o = replay_outcome("vllm", v["config"], [op_from_dict(s) for s in v["steps"]], op_timeout=60.0)
    out["repro_replay"] = [o.index, len(v["steps"]), o.invariant, o.violations[0].message] if o.failed else None
print("RESULT " + json.dumps(out))
'''


def _release_ready() -> str:
    """Empty when the 0.9.0 tree and its deps are cached; else why not."""
    tree = vllm_releases.tree(VERSION)
    if not (tree / ".complete").exists():
        return f"vLLM {VERSION} release tree not cached at {tree} (python tools/vllm_releases.py fetches it)"
    missing = [p for p in vllm_releases.deps_path(VERSION) if not Path(p).is_dir()]
    if missing:
        return f"vLLM {VERSION} extra deps not installed: {', '.join(missing)} (vllm_releases.install_deps())"
    return ""


@pytest.mark.slow
def test_vllm_0_9_0_issue_19459_through_its_scheduler(tmp_path):
    why = _release_ready()
    if why:
        pytest.skip(why)
    cases = CASES.replace("REPORT_DIR", repr(str(tmp_path)))
    r = subprocess.run([sys.executable, "-c", cases], env=vllm_releases.env_for(VERSION, policies=POLICIES),
                       capture_output=True, text=True, cwd=tempfile.gettempdir(), timeout=300)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, r.stderr[-2000:]
    got = json.loads(line[len("RESULT "):])
    assert got["found"] is not None, "0.9.0's scheduler ran the #19459 events without a finding"
    index, invariant, message = got["found"]
    assert (index, invariant) == (5, "NO_CRASH") and "IndexError" in message, got["found"]   # at the re-admission
    for control in ("no_draft_accepted", "no_preemption", "caching_off"):
        assert got[control] is None, f"{control}: {got[control]}"
    verdict, invariant, message, ops, repro, examples = got["search"]
    assert verdict == "violation", got["search"]   # found with the default draws within 300 examples (14 at seed 0)
    assert invariant == "NO_CRASH" and "IndexError" in message, got["search"]
    assert repro and set(ops) <= {"Arrive", "EngineStep", "Abort"}, ops   # a repro of engine events
    assert got["repro_replay"] is not None, "the minimized repro does not replay the crash"
    index, n, invariant, message = got["repro_replay"]
    assert (index, invariant) == (n - 1, "NO_CRASH") and "IndexError" in message, got["repro_replay"]

"""Async scheduling and the connector's asynchronous loads at the engine level (issue 37,
part 3; vLLM #49674 / #49675, the C2 row of reports/vllm-history.md).

On the installed vLLM (0.33.0) the engine runs vLLM's own ``AsyncScheduler`` with two
batches in flight, a consumer connector deferring block frees behind them (#45357's fence),
and a connector that loads asynchronously; every engine-level check passes. On 0.27.0 (the
fence without #49675's guard, read in its tree) the same two requests in a 7-block pool make
the scheduler preempt a request whose free is deferred (NO_LEAK: a preemption that reclaims
nothing); without the connector no free is deferred and the events pass. On 0.14.0 (before
#32255, read) aborting a request whose asynchronous load is in flight frees the blocks the
load still writes (KV_INTEGRITY); with a synchronous load the same events pass.

The release cases run in a subprocess over the cached release tree (skipped, saying so,
when it is absent) and are marked slow: importing a release's vLLM alone takes minutes on
the loaded 2-core box (about 26 s of CPU each).
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvspec.engine.checks import check_event
from kvspec.spec.config import Config
from kvspec.spec.ops import Abort, EngineStep

ROOT = Path(__file__).resolve().parents[1]

# two 8-token prompts that each grow to 20 tokens in a pool of 6 usable blocks: the second
# needs a block the first holds while the first's last step is still in flight
C2 = dict(level="engine", num_blocks=7, block_size=4, caching=True, kv_groups="full", spec_tokens=0,
          connector="1,2,3,4", async_scheduling=True)
C2_STEPS = ("[Arrive('r1', (1, 2, 3, 4, 5, 6, 7, 8), 12), Arrive('r2', (21, 22, 23, 24, 25, 26, 27, 28), 12)]"
            " + [EngineStep(token=1)] * 8")


def _engine(**kw):
    from kvspec.check.replay import _target
    from kvspec.engine.drivers import engine_driver
    pytest.importorskip("vllm.v1.core.sched.async_scheduler", reason="this vLLM has no AsyncScheduler")
    return engine_driver(_target("vllm", None, None, None), Config(level="engine", block_size=4, **kw))


def test_connector_spec_says_whether_it_loads_async():
    from kvspec.vllm.connector import loads_async, parse_remote, remote_tokens
    assert loads_async("async;1,2,3,4") and not loads_async("1,2,3,4") and not loads_async(None)
    assert parse_remote("async;1,2,3,4|1,2") == parse_remote("1,2,3,4|1,2") == [(1, 2, 3, 4), (1, 2)]
    assert remote_tokens((1, 2, 3, 4, 9), 0, parse_remote("async;1,2,3,4")) == 4


def test_async_scheduling_with_a_consumer_connector_passes_on_the_installed_vllm():
    e = _engine(num_blocks=7, connector="1,2,3,4", async_scheduling=True)
    assert type(e.sched).__name__ == "AsyncScheduler" and e.sched.defer_block_free   # #45357's fence is on
    assert e.unfollowed   # the cache model does not follow a step in flight; the engine checks judge it
    e.arrive("r1", (1, 2, 3, 4, 5, 6, 7, 8), 12, None)
    e.arrive("r2", (21, 22, 23, 24, 25, 26, 27, 28), 12, None)
    lagged = 0
    for _ in range(24):
        facts = e.step(lambda req, pos: 1)
        assert facts.unreclaimed == (), facts   # 0.33.0 never preempts a victim whose free is deferred
        assert check_event(EngineStep(token=1), facts, e) == []
        lagged += bool(facts.scheduled) and not facts.finished and any(
            e.sched.requests[r].num_output_placeholders for r in facts.scheduled if r in e.sched.requests)
    assert lagged, "no step was scheduled while the one before it was in flight"


def test_an_async_load_holds_its_blocks_until_it_reports_even_when_aborted():
    e = _engine(num_blocks=8, connector="async;1,2,3,4,11,12,13,14")
    e.arrive("r1", (1, 2, 3, 4, 11, 12, 13, 14, 21, 22), 4, None)
    facts = e.step(lambda req, pos: 1)
    status = e.sched.requests["r1"].status
    assert status.name == "WAITING_FOR_REMOTE_KVS" and e.tables()["r1"] and "r1" in e.loading(), (status, e.tables())
    assert check_event(EngineStep(token=1), facts, e) == []
    e.abort("r1")                      # the load still writes its blocks: they stay held, and that is no leak
    assert e.tables().get("r1") and check_event(Abort("r1"), None, e) == []
    from kvspec.vllm.connector import LOAD_STEPS
    for _ in range(LOAD_STEPS - 1):      # still in flight
        facts = e.step(lambda req, pos: 1)
        assert e.tables().get("r1") and "r1" in e.loading() and check_event(EngineStep(token=1), facts, e) == []
    facts = e.step(lambda req, pos: 1)   # the load reports: the scheduler frees them now
    assert "r1" not in e.tables() and not e.loading() and check_event(EngineStep(token=1), facts, e) == []


# -- on the release that shipped the bug (its cached tree; tools/vllm_releases.py fetches it) ---
REPLAY = r'''
import json
from kvspec.check.replay import replay_outcome
from kvspec.spec.ops import Abort, Arrive, EngineStep
out = {}
for name, cfg in CASES:
    o = replay_outcome("vllm", cfg, STEPS, op_timeout=120.0)
    out[name] = [o.index, o.invariant, o.violations[0].message] if o.failed else None
print("RESULT " + json.dumps(out))
'''
# an asynchronous load aborted while in flight (vLLM #32255): 0.9.0 to 0.15.1 free its blocks at once
LOAD = dict(level="engine", num_blocks=8, block_size=4, caching=True, kv_groups="full", spec_tokens=0,
            connector="async;1,2,3,4,11,12,13,14")
LOAD_STEPS = "[Arrive('r1', (1, 2, 3, 4, 11, 12, 13, 14, 21, 22), 4), EngineStep(token=1), Abort('r1'), EngineStep(token=1)]"


def _on_release(version: str, cases: list, steps: str) -> dict:
    sys.path.insert(0, str(ROOT / "tools"))
    import vllm_releases
    tree = vllm_releases.tree(version)
    if not (tree / ".complete").exists():
        pytest.skip(f"vLLM {version} release tree not cached at {tree} (python tools/vllm_releases.py fetches it)")
    missing = [p for p in vllm_releases.deps_path(version) if not Path(p).is_dir()]
    if missing:
        pytest.skip(f"vLLM {version} extra deps not installed: {', '.join(missing)}")
    code = REPLAY.replace("CASES", repr(cases)).replace("STEPS", steps)
    policies = [p.policies for p in vllm_releases.passes_for(version, engine=True) if p.level == "engine"][0]
    r = subprocess.run([sys.executable, "-c", code], env=vllm_releases.env_for(version, policies=policies),
                       capture_output=True,
                       text=True, cwd=tempfile.gettempdir(), timeout=900)   # a loaded box: the import alone takes minutes
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, r.stderr[-2000:]
    return json.loads(line[len("RESULT "):])


@pytest.mark.slow
def test_zero_progress_preemption_of_a_fenced_victim_on_0_27_0():
    got = _on_release("0.27.0", [("connector", C2), ("no_connector", dict(C2, connector=None))], C2_STEPS)
    assert got["connector"] is not None, "0.27.0 preempted no request whose free is deferred"
    index, invariant, message = got["connector"]
    assert (index, invariant) == (7, "NO_LEAK") and "deferred" in message and "r2" in message, got["connector"]
    assert got["no_connector"] is None, got["no_connector"]   # no consumer connector, no fence: the events pass


@pytest.mark.slow
def test_aborted_async_load_frees_blocks_the_load_still_writes_on_0_14_0():
    got = _on_release("0.14.0", [("async", LOAD), ("sync", dict(LOAD, connector=LOAD["connector"][len("async;"):]))],
                      LOAD_STEPS)
    assert got["async"] is not None, "0.14.0 kept an aborted request's blocks while its load was in flight"
    index, invariant, message = got["async"]
    assert (index, invariant) == (2, "KV_INTEGRITY") and "load was in flight" in message, got["async"]
    assert got["sync"] is None, got["sync"]   # a synchronous load has finished before the abort: nothing to wait for

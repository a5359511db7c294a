"""vLLM 0.8.x at the engine level: H8 (reports/vllm-history.md), EAGLE lookahead slots not
reserved for a WAITING request, replayed through each release's own v1 Scheduler.

0.8.4's Scheduler passes ``num_lookahead_tokens`` to ``allocate_slots`` on the running path
only (the waiting path's call has none: vLLM #16612, PR #16613, superseded by #16941), and
its manager preallocates blocks past a request's tokens, which hide the missing slots unless
the pool is scarce. So: a 4-block pool (3 usable, 12 positions), an 11-token prompt, EAGLE
with 2 drafts: the new request is admitted with 3 blocks, and the drafter's 2 lookahead
positions (11, 12) run past its table. That is the minimized repro the sweep's engine pass
finds on 0.8.4 (``--max-examples 60 --seed 0``, its time's policy). With the n-gram drafter
(no lookahead slots) the same events pass on 0.8.4; on 0.8.5 (#16941: the waiting path
passes the lookahead) EAGLE passes.

Each release runs in its own subprocess (the release's tree first on PYTHONPATH), both at
once: about 22 s of CPU each, nearly all of it importing the release's scheduler stack.
Without a release tree (``tools/vllm_releases.py`` fetches it into
~/.cache/kvspec/vllm-releases) the test skips and says so.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile

import pytest

from release_trees import ready as _ready, vllm_releases

AFFECTED, FIXED = "0.8.4", "0.8.5"

REPLAY = r'''
import json
from kvspec.check.replay import replay_outcome
from kvspec.spec.ops import Arrive, EngineStep
EAGLE = dict(level="engine", num_blocks=4, block_size=4, caching=False, kv_groups="full", spec_tokens=2,
             spec_method="eagle")
STEPS = [Arrive("r1", (21, 22, 23, 24, 1, 2, 3, 4, 21, 22, 23), 1), EngineStep(token=1, drafts=2, accepted=1)]
out = {}
for name, cfg in (("eagle", EAGLE), ("ngram", dict(EAGLE, spec_method="ngram")), ("roomy", dict(EAGLE, num_blocks=5))):
    o = replay_outcome("vllm", cfg, STEPS, op_timeout=60.0)
    out[name] = [o.index, o.invariant, o.violations[0].message] if o.failed else None
print("RESULT " + json.dumps(out))
'''


@pytest.fixture(scope="module")
def replays() -> dict:
    """Each release's replay result, both subprocesses run side by side."""
    why = [w for w in (_ready(AFFECTED), _ready(FIXED)) if w]
    if why:
        pytest.skip("; ".join(why))
    procs = {v: subprocess.Popen([sys.executable, "-c", REPLAY], env=vllm_releases.env_for(v),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 cwd=tempfile.gettempdir()) for v in (AFFECTED, FIXED)}
    out = {}
    for v, p in procs.items():
        stdout, stderr = p.communicate(timeout=900)   # a loaded box: importing vLLM alone can take minutes
        line = next((ln for ln in stdout.splitlines() if ln.startswith("RESULT ")), None)
        assert line is not None, f"{v}: {stderr[-2000:]}"
        out[v] = json.loads(line[len("RESULT "):])
    return out


def test_eagle_lookahead_not_reserved_for_a_waiting_request_on_0_8_4(replays):
    got = replays[AFFECTED]
    assert got["eagle"] is not None, "0.8.4 reserved EAGLE's lookahead slots for a new request"
    index, invariant, message = got["eagle"]
    # the scheduler's own count (2: EAGLE told by the draft model's folder name), 11 + 2 > 12 positions
    assert (index, invariant) == (1, "SLOTS") and "2 lookahead slots" in message and "not 13" in message, got["eagle"]
    assert got["ngram"] is None, got["ngram"]   # no drafter KV, no lookahead slots: the same events pass
    assert got["roomy"] is None, got["roomy"]   # a free block past the prompt: preallocation covers the slots


def test_eagle_lookahead_reserved_on_0_8_5(replays):
    got = replays[FIXED]
    assert got["eagle"] is None, got["eagle"]   # #16941: the waiting path asks for them (here the pool has no
    # room for 13 positions, so r1 waits: what the fix does; with room it is admitted with its slots)
    assert got["ngram"] is None, got["ngram"]
    assert got["roomy"] is None, got["roomy"]   # room for 13 positions: admitted with its lookahead slots

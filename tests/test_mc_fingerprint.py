"""The model checker's fingerprinted seen set, its on-disk levels and its on-disk trace
(kvspec.mc.fingerprint, kvspec.mc.frontier, kvspec.mc.trace): they change no state
count, no level, no transition and no counterexample."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvspec.mc import trace
from kvspec.mc.enumerate_ops import Bounds
from kvspec.mc.fingerprint import FingerprintSet, collision_odds, fingerprint
from kvspec.mc.frontier import DiskFrontier
from kvspec.mc.search import confirm, model_check
from kvspec.spec.config import Config
from kvspec.targets import load_target

CORPUS = Path(__file__).resolve().parents[1] / "kvspec" / "corpus" / "impl"


@pytest.fixture(scope="module")
def impl():
    return load_target("impl")


def pool(usable):
    return Config(level="pool", num_blocks=usable + 1)


def cache(usable, **kw):
    return Config(level="cache", num_blocks=usable + 1, block_size=2, **kw)


# -- the set ------------------------------------------------------------------------------
def test_fingerprint_set_agrees_with_a_python_set_through_growth():
    rng = random.Random(7)
    ref: set = set()
    fs = FingerprintSet()
    for _ in range(5000):
        x = rng.randrange(1, 1 << 12) if rng.random() < 0.3 else rng.getrandbits(64) or 1
        assert fs.add(x) == (x not in ref)
        ref.add(x)
    assert len(fs) == len(ref) and set(fs) == ref
    probes = [rng.getrandbits(64) or 1 for _ in range(2000)] + list(ref)[:500]
    assert [p in fs for p in probes] == [p in ref for p in probes]
    back = FingerprintSet.from_bytes(fs.to_bytes())
    assert set(back) == ref and len(back) == len(ref)


def test_fingerprint_set_is_at_most_half_full_and_at_least_a_quarter():
    fs = FingerprintSet()
    for x in range(1, 20001):
        fs.add(x * 0x9E3779B97F4A7C15 % (1 << 64) or 1)
    per_state = fs.nbytes / len(fs)
    assert 16 <= per_state < 32   # 8-byte slots, grown by doubling at half full


def test_fingerprint_is_nonzero_and_keys_that_marshal_apart_differ():
    assert fingerprint(b"") != 0 and fingerprint(b"a") != fingerprint(b"b")
    assert fingerprint(("not", "bytes")) == fingerprint(("not", "bytes"))


def test_collision_odds_as_tlc_reports_them():
    n = 1000
    assert collision_odds(n)["optimistic"] == pytest.approx(n * (n - 1) / 2 / 2 ** 64)
    odds = collision_odds(3, [10, 1000, 1 << 40])
    assert odds["actual"] == pytest.approx(1 / 990)   # the smallest gap between sorted fingerprints


# -- the files ----------------------------------------------------------------------------
def test_disk_frontier_gives_records_back_in_order(tmp_path):
    f = DiskFrontier(str(tmp_path))
    recs = [(("ref", bytes([i % 256]) * (i % 7)), (i, "x" * (i % 3)), {"k": i}, i) for i in range(300)]
    for r in recs:
        f.append(r)
    assert len(f) == 300 and list(f) == recs
    f.close()
    assert not list(tmp_path.iterdir())


def test_parent_log_walks_back_across_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(trace, "_FLUSH", 5)   # most records in the file, the newest in memory
    log = trace.ParentLog(str(tmp_path))
    parent = [-1]
    rng = random.Random(3)
    for i in range(1, 40):
        p = rng.randrange(i)
        assert log.append(p, 100 + i) == i
        parent.append(p)
    assert log.on_disk > 0 and len(log) == 40
    for i in (0, 7, 39):
        want, j = [], i
        while j > 0:
            want.append(100 + j)
            j = parent[j]
        assert log.indices(i) == want[::-1]
    log.close()
    assert not list(tmp_path.iterdir())


# -- the search ---------------------------------------------------------------------------
CONFIGS = [
    ("pool-sym", pool(4), 6, Bounds()),
    ("pool-nosym", pool(3), 6, Bounds(symmetry=False)),
    ("cache", cache(3), 5, Bounds()),
    ("hybrid", cache(3, kv_groups="full,swa:4"), 4, Bounds()),
]


@pytest.mark.parametrize("name, cfg, depth, bounds", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_fingerprints_and_disk_levels_change_no_count(impl, tmp_path, name, cfg, depth, bounds):
    exact = model_check(impl, cfg, depth, bounds, seen="exact", frontier="memory")
    fp = model_check(impl, cfg, depth, bounds, seen="fingerprint", frontier="disk", spill_dir=str(tmp_path))
    assert exact.verdict == fp.verdict == "pass"
    assert (fp.states, fp.transitions, fp.levels) == (exact.states, exact.transitions, exact.levels)
    assert fp.disk_from == 1 and fp.disk_bytes > 0 and exact.disk_from is None
    assert fp.collision["fingerprints"] == fp.states and fp.collision["optimistic"] < 1e-9
    assert fp.seen_bytes / fp.states <= 64
    assert not list(tmp_path.iterdir())   # the level files and the trace are removed


@pytest.mark.parametrize("bug, cfg", [("no_evict", pool(3)), ("touch_no_remove", pool(3)),
                                      ("full_prompt_hit", cache(3)), ("free_forward", cache(3))])
def test_counterexample_rebuilt_from_the_trace_is_the_same(bug, cfg, tmp_path):
    t = load_target("impl", patch=str(CORPUS / f"{bug}.diff"))
    exact = model_check(t, cfg, 6, seen="exact", frontier="memory")
    fp = model_check(t, cfg, 6, seen="fingerprint", frontier="disk", spill_dir=str(tmp_path))
    assert exact.verdict == fp.verdict == "violation" and fp.invariant == exact.invariant
    assert fp.counterexample == exact.counterexample and fp.states == exact.states
    assert confirm(t, cfg, fp)


def test_parallel_search_keeps_fingerprints_and_counts(impl):
    one = model_check(impl, pool(4), 6, seen="exact", frontier="memory")
    two = model_check(impl, pool(4), 6, workers=2)
    assert (two.states, two.levels) == (one.states, one.levels) and two.collision is not None


def test_unknown_modes_are_refused(impl):
    with pytest.raises(ValueError):
        model_check(impl, pool(2), 2, seen="bloom")


def test_auto_goes_to_disk_past_disk_at_with_the_same_counts(impl, monkeypatch):
    from kvspec.mc import search
    plain = model_check(impl, pool(3), 6, frontier="memory")
    monkeypatch.setattr(search, "PACK_AT", -1.0)   # packed, then on disk, as soon as asked
    monkeypatch.setattr(search, "DISK_AT", -1.0)
    auto = model_check(impl, pool(3), 6)
    assert auto.packed_from is not None and auto.disk_from is not None and plain.disk_from is None
    assert (auto.states, auto.transitions, auto.levels) == (plain.states, plain.transitions, plain.levels)

"""The engine level on nano-vllm-style packages (kvspec/engine/nano_engine.py): each
package's own Scheduler drives its own BlockManager.

The checks here are a small, self-contained reading of issue 21's engine invariants
(``EngineChecks``: every scheduled token has a slot, a prefill computes at least one token,
preempted and finished requests hold nothing, block refs match the tables, the index
names blocks with that hash, and KV_INTEGRITY through the scheduled slot mapping), run
after every engine step of seeded random programs (arrivals with shared prefixes,
steps, aborts), bounded by example count. They test the driver; the engine-level machine
(kvspec/engine, vllm-engine's) runs the whole catalogue.

- tests/data/nano_engine/nanotiny: a tiny package written for kvspec (scheduler + block
  manager), loaded as a FILE target; its scheduler bugs are diffs beside it.
- nano-vllm-fork, -voxcpm, -npu (installed upstream packages): each one's known bug
  (reports/upstream-findings.md, reports/nanovllm.md) searched for through its own
  scheduler, and each fix diff checked to pass the same search.
"""
from __future__ import annotations

import importlib.util
import random
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Optional

import pytest

from kvspec.engine.nano_engine import (EngineParts, NanoEngineDriver, config_reads, load_file_engine,
                                       load_package_engine)
from kvspec.engine.protocol import EngineDriver, StepFacts
from kvspec.errors import TargetError

DATA = Path(__file__).parent / "data" / "nano_engine"
TINY = DATA / "nanotiny" / "engine" / "block_manager.py"
ROOT = Path(__file__).resolve().parent.parent


# -- the checks ------------------------------------------------------------------------------
class EngineChecks:
    """Issue 21's engine-level checks on an EngineDriver, after every step (see the module doc)."""

    def __init__(self, drv: Any, whole_prompt_hits: bool = False, ignore: tuple[str, ...] = ()) -> None:
        self.drv, self.whole, self.ignore = drv, whole_prompt_hits, ignore
        self.known: dict[str, tuple[int, ...]] = {}   # req -> its tokens as of before the step
        self.shadow: dict[int, tuple[int, ...]] = {}  # slot -> the token prefix whose KV it holds

    def arrived(self, req: str, prompt: tuple[int, ...]) -> None:
        self.known[req] = tuple(prompt)

    def after_step(self, f: StepFacts) -> list[str]:
        d, bs, out = self.drv, self.drv.block_size, []
        for r, n in f.scheduled.items():
            slots = f.slots.get(r, ())
            if n == 0 and not self.whole:
                out.append(f"MAX_HIT: {r} is in the batch with no token to compute (its whole prompt was a hit)")
            if len(slots) != n:
                out.append(f"SLOTS: {r} has {n} scheduled tokens but {len(slots)} slots")
            s = f.start.get(r, 0)
            for p, slot in zip(range(s, s + n), slots):
                self.shadow[slot] = self.known[r][:p + 1]
        tables, computed, tokens = d.tables(), d.computed(), d.tokens()
        for r in f.preempted:
            if tables.get(r):
                out.append(f"HOLDS: {r} was preempted but holds blocks {list(tables[r])}")
        for r in f.finished:
            if r in tables:
                out.append(f"HOLDS: {r} finished but is still live")
        obs = d.observe()
        holders = Counter(b for t in tables.values() for b in t)
        for b, st in enumerate(obs.blocks):
            if st.ref != holders.get(b, 0):
                out.append(f"ACCOUNTING: block {b} has ref {st.ref} but {holders.get(b, 0)} tables hold it")
                break
            if st.queued != (st.ref == 0):
                out.append(f"I1: block {b} ref {st.ref}, queued={st.queued}")
                break
        for h, ids in obs.index.items():
            bad = [b for b in ids if obs.blocks[b].hash != h]
            if bad:
                out.append(f"INDEX_CONSISTENT: the index maps {obs.short_hash(h)} to block {bad[0]}, whose hash "
                           f"is {obs.short_hash(obs.blocks[bad[0]].hash)}")
                break
        out += [f"I1: {p}" for p in obs.queue_problems]
        for r, table in tables.items():
            for p in range(computed.get(r, 0)):
                if p // bs >= len(table):
                    out.append(f"KV_INTEGRITY: {r}'s computed token {p} has no block")
                    break
                slot = table[p // bs] * bs + p % bs
                if self.shadow.get(slot) != tokens[r][:p + 1]:
                    out.append(f"KV_INTEGRITY: {r} reads position {p} from slot {slot}, which holds the KV of "
                               f"{self.shadow.get(slot)}, not of {tokens[r][:p + 1]}")
                    break
        self.known = {**{r: t for r, t in self.known.items() if r not in f.finished}, **tokens}
        return [v for v in out if v.split(":", 1)[0] not in self.ignore]


# -- seeded random programs ---------------------------------------------------------------------
def program(rng: random.Random, bs: int, max_len: int, aborts: bool = True, n_ops: int = 14) -> list[tuple]:
    """Arrivals (prompts over a two-token alphabet, so prefixes are shared), steps, and
    aborts where the package's scheduler has an abort (nano-vllm's engines have none)."""
    ops, n = [], 0
    for _ in range(n_ops):
        x = rng.random()
        if x < 0.35 and n < 4:
            prompt = tuple(rng.choice((1, 2)) for _ in range(rng.randint(1, min(3 * bs, max_len - 1))))
            ops.append(("arrive", f"r{n}", prompt, rng.randint(1, min(3, max_len - len(prompt)))))
            n += 1
        elif x < 0.92 or n == 0 or not aborts:
            ops.append(("step", rng.choice((1, 2))))
        else:
            ops.append(("abort", f"r{rng.randrange(n)}"))
    return ops


def run_program(parts: EngineParts, ops: list[tuple], num_blocks: int, bs: int,
                **check: Any) -> tuple[Optional[str], int]:
    """(the first violation, engine steps run): the ops, then steps until the engine is idle."""
    drv = NanoEngineDriver(parts, num_blocks, bs)
    checks, steps = EngineChecks(drv, **check), 0
    tail = [("step", 3)] * 40
    for op in ops + tail:
        if op[0] == "arrive":
            drv.arrive(op[1], op[2], op[3])
            checks.arrived(op[1], op[2])
            continue
        if op[0] == "abort":
            drv.abort(op[1])
            continue
        if op in tail and drv.sched.is_finished():
            break
        try:
            facts = drv.step(lambda req, pos, t=op[1]: t)
        except Exception as e:  # the package's scheduler or manager raised on a valid event
            return f"NO_CRASH: {type(e).__name__}: {e}", steps
        steps += 1
        found = checks.after_step(facts)
        if found:
            return found[0], steps
    return None, steps


def search(parts: EngineParts, examples: int, seed: int = 0, num_blocks: int = 5, bs: int = 2,
           **check: Any) -> tuple[Optional[str], Optional[list], int, int]:
    """(violation, its program, examples run, steps run) over ``examples`` seeded programs."""
    rng, total = random.Random(seed), 0
    aborts = any(callable(getattr(parts.scheduler_cls, m, None)) for m in ("abort", "cancel", "abort_request"))
    for i in range(examples):
        ops = program(rng, bs, num_blocks * bs, aborts)
        v, steps = run_program(parts, ops, num_blocks, bs, **check)
        total += steps
        if v is not None:
            return v, ops, i + 1, total
    return None, None, examples, total


# -- the tiny package (always runs) ---------------------------------------------------------------
def test_driver_follows_the_protocol():
    drv = NanoEngineDriver(load_file_engine(TINY), 5, 2)
    assert isinstance(drv, EngineDriver)


def test_file_target_loads_without_the_package_init_and_reads_only_what_its_scheduler_reads():
    parts = load_file_engine(TINY)
    assert parts.scheduler_cls.__module__ == "nanotiny.engine.scheduler"
    assert "nanotiny" not in sys.modules or not hasattr(sys.modules["nanotiny"], "LLM")
    assert config_reads(parts.scheduler_cls) == ["max_num_seqs", "max_num_batched_tokens", "eos",
                                                 "num_kvcache_blocks", "kvcache_block_size"]
    drv = NanoEngineDriver(parts, 5, 2)
    # max_num_seqs is the package's own Config default; the pool is the run's.
    assert vars(drv.config) == {"max_num_seqs": 3, "max_num_batched_tokens": 10, "eos": -1,
                                "num_kvcache_blocks": 5, "kvcache_block_size": 2}


def test_a_block_manager_without_a_scheduler_beside_it_is_one_line(tmp_path):
    f = tmp_path / "pkg" / "block_manager.py"
    f.parent.mkdir()
    f.write_text("class BlockManager: pass\n")
    with pytest.raises(TargetError, match="no scheduler.py beside it"):
        load_file_engine(f)


def test_facts_of_a_prefill_a_decode_and_a_finish():
    drv = NanoEngineDriver(load_file_engine(TINY), 5, 2)
    drv.arrive("a", (1, 2, 1), 2)
    f = drv.step(lambda r, p: 7)
    assert f.scheduled == {"a": 3} and f.start == {"a": 0} and len(f.slots["a"]) == 3
    assert drv.computed() == {"a": 3} and drv.tokens() == {"a": (1, 2, 1, 7)}
    f = drv.step(lambda r, p: 7)
    assert f.scheduled == {"a": 1} and f.start == {"a": 3} and f.finished == ("a",)
    assert drv.tables() == {} and drv.observe().free_count == 5


def test_tiny_scheduler_passes():
    v, ops, n, steps = search(load_file_engine(TINY), 60)
    assert v is None, (v, ops)
    assert steps > 300


@pytest.mark.parametrize("diff,invariant", [("preempt_keeps_blocks.diff", "HOLDS"),
                                            ("decode_without_may_append.diff", "SLOTS")])
def test_tiny_scheduler_bug_is_found(diff, invariant):
    parts = load_file_engine(TINY, (DATA / diff).read_text())
    v, ops, n, _ = search(parts, 60)
    assert v is not None and v.startswith(invariant), (v, ops)


CHUNK = DATA / "nanochunk" / "engine" / "block_manager.py"


def test_chunked_prefill_chunks_are_the_schedulers():
    """nanochunk computes prompts in chunks of its Config's chunk_size (3), next to decodes:
    the facts and the manager calls are its decisions."""
    drv = NanoEngineDriver(load_file_engine(CHUNK), 6, 2)
    drv.arrive("a", (1, 2, 1, 2, 1), 2)
    drv.arrive("b", (2, 2, 2, 2), 2)
    f = drv.step(lambda r, p: 9)
    assert f.scheduled == {"a": 3} and f.start == {"a": 0}
    assert [(c.kind, c.req, c.new) for c in drv.manager_calls()] == [("admit", "a", 3)]
    f = drv.step(lambda r, p: 9)
    assert f.scheduled == {"a": 2, "b": 1} and f.start == {"a": 3, "b": 0}
    assert [(c.kind, c.req, c.new) for c in drv.manager_calls()] == [("grow", "a", 2), ("admit", "b", 1)]
    assert drv.computed() == {"a": 5, "b": 1} and drv.tokens()["a"] == (1, 2, 1, 2, 1, 9)


@pytest.mark.parametrize("blocks", [5, 3])
def test_chunked_scheduler_passes(blocks):
    v, ops, n, steps = search(load_file_engine(CHUNK), 60, num_blocks=blocks)
    assert v is None, (v, ops)
    assert steps > 300


def test_chunked_manager_bug_is_found():
    parts = load_file_engine(CHUNK, (DATA / "chunk_room_forgets_computed.diff").read_text())
    v, ops, n, _ = search(parts, 60)
    assert v is not None and v.startswith("SLOTS"), (v, ops)


def test_abort_of_a_package_without_one_frees_like_its_finish():
    drv = NanoEngineDriver(load_file_engine(TINY), 5, 2)
    assert drv.native_abort is None
    drv.arrive("a", (1, 2, 1), 3)
    drv.arrive("b", (2,), 3)
    drv.step(lambda r, p: 1)
    drv.abort("a")
    drv.abort("zzz")
    assert set(drv.tables()) == {"b"} and drv.observe().free_count == 4


def test_manager_calls_report_admissions_growth_preemption_and_finish():
    """What the scheduler asked of its manager, in order, with the state after each call. On
    3 blocks: both prompts are admitted; a's decode takes the last block, b's is refused and
    b preempts itself; b's re-admission (with its sampled token) is refused until a finishes."""
    drv = NanoEngineDriver(load_file_engine(TINY), 3, 2)
    drv.arrive("a", (1, 2, 1), 3)
    drv.arrive("b", (2, 1), 3)
    seen = []
    for _ in range(6):
        drv.step(lambda r, p: 5)
        calls = drv.manager_calls()
        seen.append([(c.kind, c.req, c.ok, c.new, c.hit) for c in calls])
        assert all(c.obs is not None for c in calls)
    assert seen[:5] == [
        [("admit", "a", True, 3, 0), ("admit", "b", True, 2, 0)],
        [("grow", "a", True, 1, 0), ("grow", "b", False, 1, 0), ("preempt", "b", True, 0, 0)],
        [("admit", "b", False, 3, 0), ("grow", "a", True, 1, 0), ("finish", "a", True, 0, 0)],
        [("admit", "b", True, 3, 0)],
        [("grow", "b", True, 1, 0), ("finish", "b", True, 0, 0)],
    ]
    assert drv.manager_calls() == []  # forgotten once read


def test_engine_driver_for_a_file_target():
    from kvspec.engine.nano_engine import engine_driver_for, has_scheduler
    from kvspec.spec.config import Config
    from kvspec.targets.user_target import load_user_target

    target = load_user_target(f"{TINY}:BlockManager")
    assert has_scheduler(target)
    drv = engine_driver_for(target, Config(level="engine", num_blocks=4, block_size=2))
    assert drv.parts.scheduler_cls.__name__ == "Scheduler" and drv.num_blocks == 4
    with pytest.raises(TargetError, match="always caches"):
        engine_driver_for(target, Config(level="engine", num_blocks=4, block_size=2, caching=False))


# -- the installed nano-vllm derivatives -------------------------------------------------------------
def _needs(package: str, dist: str):
    return pytest.mark.skipif(importlib.util.find_spec(package) is None,
                              reason=f"{dist} is not installed: pip install --no-deps -r requirements/upstream.txt")


FORK_FIX = ROOT / "kvspec" / "corpus" / "nanovllm" / "fix_full_prompt_hit.diff"
VOXCPM_FIX = ROOT / "reports" / "upstream_fixes" / "nanovllm_voxcpm_stale_index.diff"
NPU_FIX = ROOT / "reports" / "upstream_fixes" / "nanovllmnpu_stale_index_and_whole_prompt.diff"


@pytest.mark.upstream
@_needs("nanovllm", "nano-vllm-fork")
def test_fork_known_bug_through_its_own_scheduler():
    """nano-vllm-fork's whole-prompt hit (nano-vllm#144): its scheduler puts the request in
    the prefill batch with nothing to compute."""
    v, ops, n, _ = search(load_package_engine("nanovllm"), 100)
    assert v is not None and v.startswith("MAX_HIT"), (v, ops)


@pytest.mark.upstream
@_needs("nanovllm", "nano-vllm-fork")
def test_fork_scheduler_bug_behind_it():
    """With the whole-prompt hit fixed, the fork's own scheduler crashes: its decode loop
    preempts another sequence from a copy of ``running`` and leaves it in ``running`` as
    well as ``waiting``, so the next step calls may_append on an empty block table."""
    v, ops, n, _ = search(load_package_engine("nanovllm", FORK_FIX.read_text()), 100)
    assert v is not None and v.startswith("NO_CRASH: IndexError"), (v, ops)


@pytest.mark.upstream
@_needs("nanovllm", "nano-vllm-fork")
def test_fork_with_both_fixes_passes_engine_steps():
    fixes = FORK_FIX.read_text() + (DATA / "fork_preempt_leaves_running.diff").read_text()
    v, ops, n, steps = search(load_package_engine("nanovllm", fixes), 60)
    assert v is None, (v, ops)
    assert steps > 300


# The shortest programs found (seeded search, then one op at a time removed while the finding
# stays): arrivals only, then engine steps until the engine is idle. Block size 2.
MINIMAL = [
    ("nanovllm", None, 3, [("arrive", "r1", (2, 1, 1, 1), 2), ("arrive", "r2", (2, 1), 2)], {}, "MAX_HIT"),
    ("nanovllm", FORK_FIX, 3, [("arrive", "r1", (1, 1, 2), 3), ("arrive", "r2", (1,), 3)], {},
     "NO_CRASH: IndexError"),
    ("nanovllm_voxcpm", None, 4, [("arrive", "r0", (1, 1, 1, 2, 1), 2), ("arrive", "r1", (1, 2, 1, 1, 1, 2), 1),
                                  ("arrive", "r2", (1, 1, 1, 2, 1, 2), 2)],
     {"whole_prompt_hits": True, "ignore": ("INDEX_CONSISTENT",)}, "KV_INTEGRITY"),
    ("nanovllmnpu", None, 3, [("arrive", "r0", (2,), 2), ("arrive", "r1", (1, 2, 2, 1), 1),
                              ("arrive", "r2", (1, 1, 1, 2), 1), ("arrive", "r3", (1, 2, 1), 2)],
     {"ignore": ("MAX_HIT", "INDEX_CONSISTENT")}, "KV_INTEGRITY"),
]


@pytest.mark.upstream
@pytest.mark.parametrize("package,patch,blocks,ops,check,invariant", MINIMAL,
                         ids=["fork-max-hit", "fork-preempt-crash", "voxcpm-wrong-kv", "npu-wrong-kv"])
def test_minimal_programs(package, patch, blocks, ops, check, invariant):
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed: pip install --no-deps -r requirements/upstream.txt")
    parts = load_package_engine(package, patch.read_text() if patch else None)
    v, _ = run_program(parts, ops, blocks, 2, **check)
    assert v is not None and v.startswith(invariant), v


@pytest.mark.upstream
@_needs("nanovllm_voxcpm", "nano-vllm-voxcpm")
def test_voxcpm_known_bug_through_its_own_scheduler():
    """voxcpm's stale hash_to_block_id entry (nano-vllm#163) through its own scheduler: the
    entry (INDEX_CONSISTENT), and a later prompt reading another prefix's KV through it
    (KV_INTEGRITY, with the first check set aside). voxcpm runs a whole-prompt hit as a
    decode step (declared), so that is no MAX_HIT."""
    parts = load_package_engine("nanovllm_voxcpm")
    v, ops, n, _ = search(parts, 100, whole_prompt_hits=True)
    assert v is not None and v.startswith("INDEX_CONSISTENT"), (v, ops)
    v, ops, n, _ = search(parts, 300, seed=1, whole_prompt_hits=True, ignore=("INDEX_CONSISTENT",))
    assert v is not None and v.startswith("KV_INTEGRITY"), (v, ops)


@pytest.mark.upstream
@_needs("nanovllm_voxcpm", "nano-vllm-voxcpm")
def test_voxcpm_with_its_fix_passes():
    v, ops, n, steps = search(load_package_engine("nanovllm_voxcpm", VOXCPM_FIX.read_text()), 60,
                              whole_prompt_hits=True)
    assert v is None, (v, ops)
    assert steps > 300


@pytest.mark.upstream
@_needs("nanovllmnpu", "nano-vllm-npu")
def test_npu_known_bugs_through_its_own_scheduler():
    """nano-vllm-npu: the whole-prompt hit (nano-vllm#144) and the stale entry (#163), each
    with the other's checks set aside; the stale entry up to a wrong KV read."""
    parts = load_package_engine("nanovllmnpu")
    v, ops, n, _ = search(parts, 100, ignore=("INDEX_CONSISTENT", "KV_INTEGRITY"))
    assert v is not None and v.startswith("MAX_HIT"), (v, ops)
    v, ops, n, _ = search(parts, 100, ignore=("MAX_HIT",))
    assert v is not None and v.startswith("INDEX_CONSISTENT"), (v, ops)
    v, ops, n, _ = search(parts, 300, seed=1, ignore=("MAX_HIT", "INDEX_CONSISTENT"))
    assert v is not None and v.startswith("KV_INTEGRITY"), (v, ops)


@pytest.mark.upstream
@_needs("nanovllmnpu", "nano-vllm-npu")
def test_npu_with_its_fix_passes():
    v, ops, n, steps = search(load_package_engine("nanovllmnpu", NPU_FIX.read_text()), 60)
    assert v is None, (v, ops)
    assert steps > 300


# -- through the engine-level session (the cache-level model and the whole catalogue) ---------------
def session_run(package: str, patch: Optional[str], programs: list[list[tuple]], blocks: int = 5):
    """(the first finding, its program) of ``programs`` through kvspec.engine.session.EngineSession."""
    from kvspec.engine.nano_engine import engine_driver_for
    from kvspec.check.session import Session
    from kvspec.engine.session import EngineSession
    from kvspec.spec.config import Config
    from kvspec.spec.ops import Abort, Arrive, EngineStep
    from kvspec.targets.nanovllm_target import NanoVllmTarget

    target = NanoVllmTarget(package)
    target.patch_text = patch
    target.engine_driver = lambda config: engine_driver_for(target, config)
    for prog in programs:
        s = Session(target, Config(level="engine", num_blocks=blocks, block_size=2, caching=True))
        assert isinstance(s, EngineSession)  # an engine-level config builds the engine's session
        ops = [Arrive(o[1], o[2], o[3]) if o[0] == "arrive" else Abort(o[1]) if o[0] == "abort"
               else EngineStep(token=o[1]) for o in prog]
        for op in ops + [EngineStep(token=3)] * 30:
            found = s.apply(op)
            if found:
                return found[0], prog
            if isinstance(op, EngineStep) and s.engine.sched.is_finished() and len(s.steps) > len(ops):
                break
    return None, None


def _programs(n: int, seed: int = 0, aborts: bool = False) -> list[list[tuple]]:
    rng = random.Random(seed)
    return [program(rng, 2, 10, aborts) for _ in range(n)]


@pytest.mark.upstream
@_needs("nanovllm", "nano-vllm-fork")
def test_session_fork_findings_and_both_fixes():
    v, prog = session_run("nanovllm", None, [MINIMAL[0][3]], blocks=3)
    assert v is not None and v.invariant == "MAX_HIT" and "scheduler's call Admit" in v.message, v
    v, prog = session_run("nanovllm", FORK_FIX.read_text(), [MINIMAL[1][3]], blocks=3)
    assert v is not None and v.invariant == "NO_CRASH" and "IndexError" in v.message, v
    fixes = FORK_FIX.read_text() + (DATA / "fork_preempt_leaves_running.diff").read_text()
    v, prog = session_run("nanovllm", fixes, _programs(40))
    assert v is None, (v, prog)


@pytest.mark.upstream
@_needs("nanovllmnpu", "nano-vllm-npu")
def test_session_npu_stale_entry_and_fix():
    v, prog = session_run("nanovllmnpu", None, _programs(20))
    assert v is not None and v.invariant in ("INDEX_CONSISTENT", "MAX_HIT", "KV_INTEGRITY"), v
    v, prog = session_run("nanovllmnpu", NPU_FIX.read_text(), _programs(40))
    assert v is None, (v, prog)


@pytest.mark.upstream
@_needs("nanovllm_voxcpm", "nano-vllm-voxcpm")
def test_session_voxcpm_stale_entry():
    v, prog = session_run("nanovllm_voxcpm", None, _programs(20, aborts=True))
    assert v is not None and v.invariant == "INDEX_CONSISTENT", v


@pytest.mark.upstream
@_needs("nanovllm", "nano-vllm-fork")
def test_fork_scheduler_fix_is_a_real_patch(tmp_path):
    """The fork's scheduler fix applies to the installed package with ``patch --dry-run -p1``
    (no fuzz), alone and after the whole-prompt-hit fix."""
    import shutil
    import subprocess
    import sysconfig

    if shutil.which("patch") is None:
        pytest.skip("GNU patch is not installed")
    root = sysconfig.get_paths()["purelib"]
    fix = DATA / "fork_preempt_leaves_running.diff"
    for text in (fix.read_text(), FORK_FIX.read_text() + fix.read_text()):
        (tmp_path / "fix.diff").write_text(text)
        r = subprocess.run(["patch", "--dry-run", "-p1", "-F0", "-d", root, "-i", str(tmp_path / "fix.diff")],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr


def test_snapshot_and_restore_fork_an_independent_engine():
    drv = NanoEngineDriver(load_file_engine(TINY), 4, 2)
    drv.arrive("a", (1, 2, 1), 3)
    drv.arrive("b", (1, 2, 2), 3)
    drv.step(lambda r, p: 5)
    snap = drv.snapshot()
    first = [drv.step(lambda r, p: 6) for _ in range(4)]
    copy = drv.restore(snap)
    again = [copy.step(lambda r, p: 6) for _ in range(4)]
    assert again == first and copy.tables() == drv.tables() and copy.tokens() == drv.tokens()
    assert copy.sched.block_manager._mgr is copy.view.mgr and copy.view.mgr is not drv.view.mgr


# -- kvspec check --level engine (the registered path: machine, session, repro) --------------------------
@pytest.mark.upstream
@_needs("nanovllm", "nano-vllm-fork")
def test_check_level_engine_on_the_fork(tmp_path):
    """`kvspec check --target nanovllm --level engine --max-examples N --seed 0`: the release
    fails through its own scheduler and its repro is engine events; with both fixes (the
    whole-prompt hit and the scheduler's preemption) it passes."""
    from kvspec.check.replay import run_steps
    from kvspec.check.search import run_check
    from kvspec.targets.registry import load_target

    report = run_check(load_target("nanovllm"), "nanovllm", level="engine", seed=0, max_examples=100,
                       report_dir=str(tmp_path))
    assert report.violations, "the fork's known bugs are not reached in 100 examples"
    f = report.violations[0]
    assert f.level == "engine" and f.invariant in ("MAX_HIT", "NO_CRASH"), f.to_dict()
    assert all(type(op).__name__ in ("Arrive", "EngineStep", "Abort") for op in f.steps)
    assert run_steps(load_target("nanovllm"), f.config, f.steps).failed
    both = tmp_path / "both.diff"
    both.write_text(FORK_FIX.read_text() + (DATA / "fork_preempt_leaves_running.diff").read_text())
    report = run_check(load_target("nanovllm", patch=str(both)), "nanovllm", level="engine", seed=0,
                       max_examples=40, report_dir=str(tmp_path), patch=str(both), patch_text=both.read_text())
    assert report.verdict == "pass", [v.to_dict()["message"] for v in report.violations]
    assert report.examples >= 40

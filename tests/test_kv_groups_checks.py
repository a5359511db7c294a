"""KV-cache groups at the cache level: the op vocabulary, the group-aware model, and
the checks HIT_AGREEMENT, WINDOW, SLOTS, HASH_CHAIN over extra keys and the
window-aware KV_INTEGRITY, each shown to catch its corpus bug and to stop catching
it when switched off."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import get_state_machine_test

import kvspec.spec.invariants as inv
from kvspec.impl.kv_cache_groups import parse_kv_groups
from kvspec.spec import group_checks
from kvspec.spec.config import Config
from kvspec.spec.model.groups import parse_groups
from kvspec.spec.ops import Admit, Op, Prefill, Preempt, Step, Verify, op_from_dict
from kvspec.check.session import Session, run_steps
from kvspec.targets.registry import load_target

CORPUS = Path(__file__).resolve().parents[1] / "kvspec" / "corpus" / "impl"


def cache(groups: str = "full", blocks: int = 8, bs: int = 2, **kw) -> Config:
    return Config(level="cache", num_blocks=blocks, block_size=bs, kv_groups=groups, **kw)


# Short failing sequences of the corpus bugs, each with the invariant that names it.
CASES = {
    "swa_free_off_by_one": ("WINDOW", cache("full,swa:2", 5),
                            [Admit("r1", (1, 2)), Admit("r2", (1, 2, 11))]),
    "lookahead_no_slots": ("SLOTS", cache("full,swa:4", 10),
                           [Admit("r1", (1, 2, 3)), Step("r1", 4, (5, 6, 7))]),
    "hybrid_hit_not_truncated": ("HIT_AGREEMENT", cache("full,swa:4", 6, 3),
                                 [Admit("r1", (1, 2, 3, 11, 12, 13)), Step("r1", 11), Preempt("r1"),
                                  Admit("r2", (1, 2, 3, 11))]),
    "lora_not_hashed": ("HASH_CHAIN", cache("full", 8),
                        [Admit("r1", (1, 2, 3), extra="lora:A"), Admit("r2", (1, 2, 3), extra="lora:B")]),
    "max_model_len_ignored": ("SLOTS", cache("full", 8, max_model_len=4),
                              [Admit("r1", (1, 2, 3)), Step("r1", 4), Step("r1", 5)]),
}


def _found(patch_id: str, config: Config, steps: list[Op]) -> set[str]:
    target = load_target("impl", patch=str(CORPUS / f"{patch_id}.diff"))
    session = Session(target, config)
    found: set[str] = set()
    for op in steps:
        found |= {v.invariant for v in session.apply(op)}
    return found


@pytest.mark.parametrize("patch_id", sorted(CASES))
def test_corpus_bug_is_named_by_its_check(patch_id):
    invariant, config, steps = CASES[patch_id]
    out = run_steps(load_target("impl", patch=str(CORPUS / f"{patch_id}.diff")), config, steps)
    assert out.failed and out.invariant == invariant, out.violations
    # the same steps pass on the unpatched allocator
    assert not run_steps(load_target("impl"), config, steps).failed


@pytest.mark.parametrize("patch_id,fn", [
    ("swa_free_off_by_one", group_checks.window),
    ("lookahead_no_slots", group_checks.slots),
    ("hybrid_hit_not_truncated", group_checks.hit_agreement),
    ("lora_not_hashed", group_checks.hit_content),
])
def test_switching_a_check_off_loses_its_finding(monkeypatch, patch_id, fn):
    invariant, config, steps = CASES[patch_id]
    assert invariant in _found(patch_id, config, steps)
    monkeypatch.setattr(inv, "CHECKS", [c for c in inv.CHECKS if c is not fn])
    assert invariant not in _found(patch_id, config, steps)


def test_kv_integrity_reads_through_the_window(monkeypatch):
    """A slot the next query reads that holds foreign KV is found; with the check off, not."""
    def run() -> set[str]:
        s = Session(load_target("impl"), cache("full,swa:4", 10))
        assert not s.apply(Admit("r1", (1, 2, 3, 4, 5, 6)))
        swa_table = s.obs.requests["r1"].groups[0]
        s.shadow.slots[(swa_table[2], 1)] = ("someone", "else")   # position 5: read by the query at 6
        return {v.invariant for v in s.apply(Step("r1", 7))}
    assert "KV_INTEGRITY" in run()
    monkeypatch.setattr(inv, "CHECKS", [c for c in inv.CHECKS if c is not inv.kv_integrity])
    assert "KV_INTEGRITY" not in run()


def test_window_left_behind_is_not_read():
    """Foreign KV in a slot behind every window is never read: no finding."""
    s = Session(load_target("impl"), cache("full,swa:2", 12))
    assert not s.apply(Admit("r1", (1, 2, 3, 4, 5, 6)))
    assert not s.apply(Step("r1", 7))
    swa_table = s.obs.requests["r1"].groups[0]
    assert swa_table[0] == 0                      # freed: positions 0, 1 are behind the window
    s.shadow.slots[(s.obs.requests["r1"].table[0], 0)] = ("x",)  # full group's slot: still read
    assert "KV_INTEGRITY" in {v.invariant for v in s.apply(Step("r1", 8))}


def test_new_ops_on_impl_agree_with_the_model():
    steps = [Admit("a", (1, 2, 3, 4, 5, 6, 7), chunk=3, extra="salt:s"), Prefill("a", 2), Prefill("a", 9),
             Step("a", 8, (9, 10)), Verify("a", 1), Step("a", 11), Admit("b", (1, 2, 3, 4, 5), external=2),
             Admit("c", (1, 2, 3, 4, 5, 6, 7), extra="salt:s")]
    for groups in ("full", "full,swa:3", "full,chunked:4", "swa:2,full"):
        for mml in (None, 12):
            out = run_steps(load_target("impl"), cache(groups, 16, max_model_len=mml), steps)
            assert not out.failed, (groups, mml, out.violations)


def test_hits_agree_through_the_window():
    """c's salted prompt hits a's blocks in both groups (same salt); the window group
    takes only the blocks its window needs."""
    s = Session(load_target("impl"), cache("full,swa:3", 32))
    s.apply(Admit("a", (1, 2, 3, 4, 5, 6, 7), extra="salt:s"))
    assert not s.apply(Admit("c", (1, 2, 3, 4, 5, 6, 7, 8), extra="salt:s"))
    assert s.last_result == 6
    a, c = s.obs.requests["a"], s.obs.requests["c"]
    assert c.table[:3] == a.table[:3]
    # the query at 6 reads positions 4..6: of the hit only block 2 is needed, 0 and 1 are null
    assert c.groups[0][:2] == (0, 0) and c.groups[0][2] == a.groups[0][2]
    assert not s.apply(Admit("d", (1, 2, 3, 4, 5, 6, 7, 8), extra="salt:t"))
    assert s.last_result == 0


def test_old_ops_and_configs_still_construct():
    assert Admit("r1", (1, 2)) == Admit(req="r1", prompt=(1, 2), chunk=None, extra=None, external=0)
    assert Step("r1", 3) == Step("r1", 3, ())
    assert repr(Admit("r1", (1, 2))) == "Admit(req='r1', prompt=(1, 2))"
    assert repr(Step("r1", 3, (4,))) == "Step(req='r1', token=3, drafts=(4,))"
    for op in (Admit("r", (1,), chunk=2, extra="lora:A", external=1), Prefill("r", 2), Verify("r", 0),
               Step("r", 1, (2, 3))):
        assert op_from_dict(op.to_dict()) == op and eval(repr(op)) == op
    assert op_from_dict({"op": "Admit", "req": "r", "prompt": [1, 2]}) == Admit("r", (1, 2))
    old = {"level": "cache", "num_blocks": 8, "block_size": 2, "caching": True}
    assert Config(**old).kv_groups == "full" and Config(**old).max_model_len is None


def test_spec_and_impl_parse_groups_alike():
    for spec in ("full", "full,swa:4", "swa:1,chunked:8", "full, swa:3,full"):
        assert [str(g) for g in parse_groups(spec)] == [str(g) for g in parse_kv_groups(spec)]
    for bad in ("", "mamba", "swa:0", "full:2", "chunked"):
        with pytest.raises(ValueError):
            parse_groups(bad)
        with pytest.raises(ValueError):
            parse_kv_groups(bad)


def test_cache_machine_with_pinned_groups_passes_on_impl():
    from kvspec.stateful import cache_machine
    machine = cache_machine(load_target("impl"), kv_groups="full,swa:4")
    test = get_state_machine_test(machine, settings=settings(
        max_examples=30, stateful_step_count=30, deadline=None, database=None, phases=(Phase.generate,),
        derandomize=True, suppress_health_check=list(HealthCheck)))
    test()
    assert machine.counters["examples"] >= 30


def test_kv_groups_flag_errors_are_one_line(capsys):
    from kvspec.cli import main
    assert main(["check", "--kv-groups", "full,bogus", "--budget", "1"]) == 2
    assert main(["check", "--target", "nanovllm", "--level", "cache", "--kv-groups", "full,swa:4",
                 "--budget", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "kv group" in err[0] and "does not support KV-cache groups" in err[1]


def test_pytest_plugin_pins_the_groups():
    """--kvspec-kv-groups reaches the cache machine: its configs carry the groups, and a
    window bug is caught through the plugin's runner."""
    from kvspec.pytest_plugin import KvspecFailure, RunOptions, run_machine
    opts = RunOptions(level="cache", profile="ci", max_examples=40, kv_groups="full,swa:2", repro_dir="/tmp/kvspec-test-repros")
    seen: list[str] = []
    target = load_target("impl")
    orig = Session.__init__

    def spy(self, target, config, *a, **kw):
        seen.append(config.kv_groups)
        orig(self, target, config, *a, **kw)

    import kvspec.stateful.base as base
    old = base.Session
    base.Session = type("SpySession", (Session,), {"__init__": spy})
    try:
        run_machine(target, "impl", "cache", opts)
    finally:
        base.Session = old
    assert seen and set(seen) == {"full,swa:2"}
    with pytest.raises(KvspecFailure) as e:
        run_machine(load_target("impl", patch=str(CORPUS / "swa_free_off_by_one.diff")), "impl", "cache", opts)
    assert "WINDOW" in str(e.value)


@pytest.mark.slow
@pytest.mark.parametrize("groups", ["full,swa:4", "full,chunked:8", "full,swa:4,swa:8"])
def test_check_passes_on_impl_with_groups(groups, tmp_path):
    """``kvspec check --level cache --kv-groups G --max-examples 100`` on unmodified impl."""
    from kvspec.check.search import run_check
    report = run_check(load_target("impl"), "impl", level="cache", kv_groups=groups, max_examples=100,
                       report_dir=str(tmp_path))
    assert report.verdict == "pass", [v.to_dict() for v in report.violations]
    assert report.examples >= 100

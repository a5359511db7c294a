"""Policies as declared traits (issue 12): the reference model implements every free-queue
order, impl carries each as a patchable variant (kvspec/corpus/impl/policy_*.diff, code and
declaration changed together), a variant passes under its own declaration, and
EVICTION_ORDER catches a target that declares one order and implements another. Caching
off is drawn by the machines and taken by ``kvspec mc --caching``; declarations of user
classes are validated (one line, exit 2) and never inferred from the code.

Every search is bounded by an example count, never by seconds."""
import dataclasses
import json
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from kvspec.cli import main
from kvspec.spec.config import Config
from kvspec.spec.misuse import MISUSE_KINDS, documented_errors, misuse_kind
from kvspec.spec.model import PoolModel
from kvspec.spec.ops import Admit, Alloc, Cache, CachePartial, Finish, Free, FreeForeign, Preempt, Step, Touch
from kvspec.stateful import InvariantViolation, cache_machine, pool_machine
from kvspec.targets.base import Traits
from kvspec.targets.registry import load_target

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "kvspec" / "corpus" / "impl"
# Each declared order on impl: None is impl itself (vLLM's LRU, a request's tail first).
VARIANTS = {"lru_tail_first": None, "mru": "policy_mru.diff", "fifo": "policy_fifo.diff",
            "sorted": "policy_sorted.diff", "unhashed_first": "policy_unhashed_first.diff"}
ORDERS = ("lru_tail_first", "mru", "fifo", "sorted")
PASS = settings(max_examples=25, stateful_step_count=25, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))
FIND = settings(PASS, max_examples=150, phases=(Phase.generate,))


def _policy(variant: str) -> dict:
    """What a variant declares: its order, and where its unhashed blocks go."""
    if variant == "unhashed_first":
        return {"free_order": "lru_tail_first", "unhashed_free_first": True}
    return {"free_order": variant, "unhashed_free_first": False}


def _impl(variant: str):
    diff = VARIANTS[variant]
    return load_target("impl", patch=None if diff is None else str(CORPUS / diff))


# -- the model ---------------------------------------------------------------------------------
def _queue_after_free(order: str, unhashed_first: bool = False, caching: bool = True) -> list[int]:
    """Blocks 1..5 usable (0 is null); hold 1, 2, 3; cache 1; free them as (3, 1, 2)."""
    m = PoolModel(Config(level="pool", num_blocks=6, caching=caching),
                  Traits(free_order=order, unhashed_free_first=unhashed_first))
    assert m.apply(Alloc(3)) == (1, 2, 3)
    m.apply(Cache((1,), ("a",)))
    m.apply(Free((3, 1, 2)))
    return m.queue


def test_the_model_implements_every_order():
    # From each order's definition: the still-free 4, 5, and the freed 3, 1, 2 in that order.
    assert _queue_after_free("lru_tail_first") == [4, 5, 3, 1, 2]     # to the back, in order
    assert _queue_after_free("fifo") == [4, 5, 3, 1, 2]               # the same at pool level
    assert _queue_after_free("mru") == [3, 1, 2, 4, 5]                # to the front, in order
    assert _queue_after_free("sorted") == [1, 2, 3, 4, 5]             # by id
    assert _queue_after_free("lru_tail_first", unhashed_first=True) == [3, 2, 4, 5, 1]  # only 1 is cached
    # caching off: nothing is hashed, so vLLM's traits send every freed block to the front
    assert _queue_after_free("lru_tail_first", unhashed_first=True, caching=False) == [3, 1, 2, 4, 5]


def test_release_order_at_cache_level():
    from kvspec.spec.model import CacheModel

    def released(order: str) -> list[int]:
        m = CacheModel(Config(level="cache", num_blocks=5, block_size=2), Traits(free_order=order))
        m.apply(Admit("r1", (1, 2, 3, 4, 5)))  # blocks 1, 2, 3
        m.apply(Finish("r1"))
        return m.pool.queue

    assert released("lru_tail_first") == [4, 3, 2, 1]  # the tail is evicted first
    assert released("fifo") == [4, 1, 2, 3]            # the head is
    assert released("mru") == [3, 2, 1, 4]             # this release leads, tail first


def test_traits_validate_their_policies():
    with pytest.raises(ValueError, match="free_order 'lifo'"):
        Traits(free_order="lifo")
    with pytest.raises(ValueError, match="prefix_caching"):
        Traits(prefix_caching="sometimes")
    assert Traits(prefix_caching="off").caching_modes == (False,)


# -- impl's variants -------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_each_declared_order_on_impl_passes(variant):
    t = _impl(variant)
    declared = {"free_order": t.traits.free_order, "unhashed_free_first": t.traits.unhashed_free_first}
    assert declared == _policy(variant)  # the patch changed the declaration with the code
    for make in (pool_machine, cache_machine):
        machine = make(t)
        run_state_machine_as_test(machine, settings=PASS)
        assert machine.counters["steps"] > 150


MISMATCHES = [(impl, declared) for impl in VARIANTS for declared in ORDERS + ("unhashed_first",)
              if _policy(impl) != _policy(declared)]


@pytest.mark.parametrize("implemented, declared", MISMATCHES, ids=[f"{a}-declared-{b}" for a, b in MISMATCHES])
def test_eviction_order_catches_a_declared_order_the_code_does_not_follow(implemented, declared):
    t = _impl(implemented)
    t.traits = dataclasses.replace(t.traits, **_policy(declared))
    with pytest.raises(InvariantViolation) as e:
        run_state_machine_as_test(cache_machine(t), settings=FIND)
    assert e.value.invariant == "EVICTION_ORDER", e.value


# -- caching on and off ------------------------------------------------------------------------------
def test_the_machines_draw_both_caching_modes():
    seen = set()
    t = _impl("lru_tail_first")
    real = t.driver

    def spy(config):
        seen.add(config.caching)
        return real(config)

    t.driver = spy
    run_state_machine_as_test(pool_machine(t), settings=settings(PASS, max_examples=30))
    assert seen == {True, False}
    nano_like = dataclasses.replace(t.traits, prefix_caching="on")
    t.traits, seen = nano_like, set()
    run_state_machine_as_test(pool_machine(t), settings=settings(PASS, max_examples=30))
    assert seen == {True}


def test_mc_takes_caching_on_or_off(tmp_path, capsys):
    vllm_order = str(CORPUS / VARIANTS["unhashed_first"])
    argv = ["mc", "--blocks", "3", "--depth", "4", "--json", "--report-dir", str(tmp_path)]
    assert main(argv + ["--caching", "off", "--patch", vllm_order]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"] == "pass" and out["caching"] is False
    # impl itself keeps freed blocks at the back with caching off; declared as vLLM's
    # caching-off policy (to the front), mc finds the difference in two steps
    t = load_target("impl")
    t.traits = dataclasses.replace(t.traits, unhashed_free_first=True)
    from kvspec.mc.enumerate_ops import Bounds
    from kvspec.mc.search import model_check
    r = model_check(t, Config(level="pool", num_blocks=4, caching=False), 3, Bounds())
    assert r.verdict == "violation" and r.violations[0].invariant == "EVICTION_ORDER" and len(r.counterexample) == 2
    r = model_check(t, Config(level="pool", num_blocks=4, caching=True), 3, Bounds())
    assert r.verdict == "violation"  # with caching on too: a freed unhashed block


def test_mc_refuses_a_caching_mode_the_target_does_not_declare(capsys):
    pytest.importorskip("xxhash")
    import importlib.util
    if importlib.util.find_spec("nanovllm") is None:
        pytest.skip("nano-vllm-fork is not installed: pip install --no-deps -r requirements/upstream.txt")
    assert main(["mc", "--target", "nanovllm", "--level", "cache", "--caching", "off"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not support prefix caching off" in err[0]


# -- whole-prompt hits: MAX_HIT relaxed, KV_INTEGRITY still checks the read ---------------------------
def _whole_prompt_manager(tmp_path: Path, source: Path, decl: str) -> str:
    """The README's nano-style manager, its hit allowed to cover the whole prompt."""
    src = source.read_text()
    assert src.count("(len(seq) - 1) // self.block_size") == 1
    src = src.replace("(len(seq) - 1) // self.block_size", "len(seq) // self.block_size")
    src = src.replace("class BlockManager:\n", f"class BlockManager:\n    kvspec_traits = {decl}\n", 1)
    f = tmp_path / f"whole_{source.stem}_{'declared' if 'True' in decl else 'not'}.py"  # one module per file
    f.write_text(src)
    return f"{f}:BlockManager"


def test_whole_prompt_hits_are_checked_through_kv_integrity(tmp_path):
    good, buggy = ROOT / "examples" / "my_block_manager.py", ROOT / "examples" / "my_block_manager_buggy.py"
    t = load_target(_whole_prompt_manager(tmp_path, good, '{"whole_prompt_hits": False}'))
    with pytest.raises(InvariantViolation) as e:
        run_state_machine_as_test(cache_machine(t), settings=FIND)
    assert e.value.invariant == "MAX_HIT" and "at least the last must be computed" in str(e.value)
    t = load_target(_whole_prompt_manager(tmp_path, good, '{"whole_prompt_hits": True}'))
    machine = cache_machine(t)
    run_state_machine_as_test(machine, settings=PASS)  # its whole-prompt hits read the right KV
    assert machine.counters["steps"] > 150
    # a stale hit is still wrong KV under the same declaration
    bad = load_target(_whole_prompt_manager(tmp_path, buggy, '{"whole_prompt_hits": True}'))
    with pytest.raises(InvariantViolation) as e:
        run_state_machine_as_test(cache_machine(bad), settings=FIND)
    assert "at least the last must be computed" not in str(e.value), e.value


# -- misuse kinds and the documented class for each ---------------------------------------------------
def test_every_misuse_reason_has_a_kind():
    m = PoolModel(Config(level="pool", num_blocks=4), Traits())
    m.apply(Alloc(2))  # blocks 1, 2 held
    m.apply(Cache((1,), ("a",)))
    ops = [Alloc(-1), Alloc(9), Free((0,)), Free((7,)), Free((1, 1)), Free((3,)), FreeForeign(1), Touch((3,)),
           CachePartial((2,), ()), Cache((3,), ("b",)), Cache((1,), ("b",)), Cache((2, 2), ("b", "c"))]
    kinds = [misuse_kind(m.misuse_reason(op)) for op in ops]
    assert kinds == ["bad_count", "over_alloc", "null_block", "no_such_block", "double_free", "free_unheld",
                     "foreign_free", "touch_unheld", "cache_partial", "cache_unheld", "cache_rehash", "cache_rehash"]
    from kvspec.spec.model import CacheModel
    c = CacheModel(Config(level="cache", num_blocks=4, block_size=2), Traits())
    c.apply(Admit("r1", (1, 2)))
    ops = [Admit("r1", (1,)), Admit("r2", ()), Admit("r9"), Step("r9", 1), Preempt("r9"), Finish("r9")]
    assert [misuse_kind(c.misuse_reason(op)) for op in ops] == \
        ["duplicate_request", "empty_prompt", "not_waiting", "not_running", "not_running", "unknown_request"]
    assert set(kinds) <= set(MISUSE_KINDS)


def test_atomic_reject_holds_each_kind_to_its_declared_class():
    class A(Exception):
        pass

    class B(Exception):
        pass

    t = Traits(misuse_error_map=(("double_free", A), ("*", B)))
    assert t.misuse_errors == (A, B)
    assert documented_errors(t, "double free of block 3") == (A,)
    assert documented_errors(t, "negative count -1") == (B,)
    # impl raises DoubleFreeError for a double free; declared as another class, it is a finding
    impl = load_target("impl")
    from kvspec.check.session import Session
    s = Session(impl, Config(level="pool", num_blocks=4))
    s.apply(Alloc(1))
    assert s.apply(Free((1, 1))) == []
    s.traits = dataclasses.replace(impl.traits, misuse_error_map=(("double_free", A),))
    found = s.apply(Free((1, 1)))
    assert found and found[0].invariant == "ATOMIC_REJECT" and "not one of the documented errors" in found[0].message


# -- user classes declare their policies --------------------------------------------------------------
ALLOC = (ROOT / "examples" / "my_block_manager.py").read_text()


def _user(tmp_path: Path, attr: str = "", pyproject: str = "") -> str:
    d = tmp_path / "proj"
    d.mkdir(exist_ok=True)
    src = ALLOC.replace("class BlockManager:\n", f"class BlockManager:\n{textwrap.indent(attr, '    ')}\n", 1) \
        if attr else ALLOC
    (d / "bm.py").write_text(src)
    if pyproject:
        (d / "pyproject.toml").write_text(pyproject)
    return f"{d / 'bm.py'}:BlockManager"


def test_a_class_attribute_declares_policies(tmp_path, capsys):
    spec = _user(tmp_path, 'kvspec_traits = {"free_order": "lru_tail_first", "null_block": "none"}')
    t = load_target(spec)
    assert t.traits.free_order == "lru_tail_first" and not t.traits.null_block
    assert "declares no policies" not in capsys.readouterr().err


def test_pyproject_tool_kvspec_declares_policies(tmp_path):
    spec = _user(tmp_path, pyproject='[tool.kvspec]\nfree_order = "mru"\nadmit_all_blocks = true\n')
    t = load_target(spec)
    assert (t.traits.free_order, t.traits.admit_all_blocks) == ("mru", True)
    # declared mru, implemented LRU: EVICTION_ORDER
    with pytest.raises(InvariantViolation) as e:
        run_state_machine_as_test(cache_machine(t), settings=FIND)
    assert e.value.invariant in ("EVICTION_ORDER", "NO_LEAK", "ACCOUNTING"), e.value  # symptoms of the mismatch


def test_undeclared_gets_vllm_defaults_with_one_note(tmp_path, capsys):
    spec = _user(tmp_path)
    load_target(spec)
    load_target(spec)
    err = capsys.readouterr().err
    assert err.count("declares no policies") == 1 and "vLLM's defaults" in err


@pytest.mark.parametrize("decl, message", [
    ('{"free_order": "lifo"}', "free_order 'lifo' is not one of lru_tail_first, mru, fifo, sorted"),
    ('{"evict": "lru"}', "unknown policy 'evict'"),
    ('{"whole_prompt_hits": "yes"}', "whole_prompt_hits must be true or false"),
    ('{"misuse_errors": {"double_free": "NoSuchError"}}', "not an exception class kvspec can find"),
    ('{"misuse_errors": {"typo": "ValueError"}}', "unknown misuse kind 'typo'"),
    ('{"null_block": 0}', "a nano-vllm BlockManager has no null block"),
])
def test_bad_declarations_are_one_line_and_exit_2(tmp_path, capsys, decl, message):
    spec = _user(tmp_path, f"kvspec_traits = {decl}")
    assert main(["check", "--target", spec, "--budget", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "Traceback" not in err[0], err

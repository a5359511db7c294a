"""`kvspec check` reports every distinct bug, not only the first (signatures, --max-findings),
and a value only a caller bug can produce is reported as a bug of the caller (kvspec.spec.blame)."""
import json
import xml.etree.ElementTree as ET
from pathlib import Path

from kvspec.cli import main
from kvspec.check.session import run_steps
from kvspec.spec.blame import blame
from kvspec.spec.config import Config
from kvspec.spec.ops import Admit, Alloc, Free, Step, op_from_dict
from kvspec.spec.violation import Violation, signature
from kvspec.targets.registry import load_target

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "kvspec" / "corpus" / "impl"
CALLER_BUG = ROOT / "tests" / "data" / "caller_negative_count.diff"


def run_json(args, capsys):
    rc = main(args + ["--json"])
    return rc, json.loads(capsys.readouterr().out)


def _expected(bug: str) -> str:
    return {b["id"]: b for b in json.loads((CORPUS / "bugs.json").read_text())}[bug]["invariants"][0]


# -- a target with two planted bugs ---------------------------------------------------------
def test_two_planted_bugs_are_both_reported_each_cut_down_with_its_own_repro(capsys, tmp_path):
    # two independent corpus bugs in one target: the index never learns a cached block,
    # and the free queue's count misses appended blocks
    bugs = ["cache_no_index", "append_n_no_count"]
    patch = tmp_path / "two.diff"
    patch.write_text("".join((CORPUS / f"{b}.diff").read_text() for b in bugs))
    rc, d = run_json(["check", "--patch", str(patch), "--level", "pool", "--max-examples", "300",
                      "--report-dir", str(tmp_path / "out")], capsys)
    assert rc == 1 and d["verdict"] == "violation"
    found = {v["invariant"] for v in d["violations"]}
    assert {_expected(b) for b in bugs} <= found, [v["message"] for v in d["violations"]]
    assert len({v["signature"] for v in d["violations"]}) == len(d["violations"])  # distinct, each once
    repros = [v["repro"] for v in d["violations"]]
    assert len(set(repros)) == len(repros) and all(Path(r).is_file() for r in repros)
    target = load_target("impl", patch=str(patch))
    for v in d["violations"]:
        assert v["num_steps"] <= v["shrunk_steps"]  # cut down on its own
        steps = [op_from_dict(s) for s in v["steps"]]
        out = run_steps(target, Config(**v["config"]), steps)
        assert out.invariant == v["invariant"] and out.index == len(steps) - 1  # and it replays as itself
    assert d["max_findings"] == 5 and d["examples"] <= 300
    junit = ET.parse(tmp_path / "out" / "kvspec-check.junit.xml").getroot()
    assert int(junit.get("failures")) == len(d["violations"])
    md = (tmp_path / "out" / "kvspec-check.md").read_text()
    assert all(f"signature: {v['signature']}" in md for v in d["violations"])

    # --max-findings 1: the first finding only, the same one, found at the same example
    rc1, d1 = run_json(["check", "--patch", str(patch), "--level", "pool", "--max-examples", "300",
                        "--max-findings", "1", "--report-dir", str(tmp_path / "one")], capsys)
    assert rc1 == 1 and len(d1["violations"]) == 1
    first, only = d["violations"][0], d1["violations"][0]
    assert (only["signature"], only["steps"], only["examples_to_failure"]) == \
        (first["signature"], first["steps"], first["examples_to_failure"])


def test_distinct_findings_are_deterministic_by_example_count(capsys, tmp_path):
    patch = tmp_path / "two.diff"
    patch.write_text((CORPUS / "cache_no_index.diff").read_text() + (CORPUS / "append_n_no_count.diff").read_text())
    runs = [run_json(["check", "--patch", str(patch), "--level", "pool", "--max-examples", "120",
                      "--report-dir", str(tmp_path / str(i))], capsys)[1] for i in range(2)]
    keys = [[(v["signature"], v["steps"], v["examples_to_failure"]) for v in r["violations"]] for r in runs]
    assert keys[0] == keys[1] and len(keys[0]) >= 2
    assert runs[0]["examples"] == runs[1]["examples"]


# -- signatures -----------------------------------------------------------------------------
def test_signature_is_invariant_op_kind_and_code_location():
    a = Violation("ACCOUNTING", "the free count is 0 but the queue holds 1")
    b = Violation("ACCOUNTING", "the free count is 2 but the queue holds 3")  # same bug, other numbers
    assert signature(a, Free(blocks=(1,))) == signature(b, Free(blocks=(2, 3))) == ("ACCOUNTING", "Free", "")
    assert signature(a, Free(blocks=(1,))) != signature(a, Alloc(n=1))  # another operation broke it
    assert signature(a, None) == ("ACCOUNTING", "construction", "")
    c1 = Violation("NO_CRASH", "x", where="BlockPool.get_new_blocks (block_pool.py:84)")
    c2 = Violation("NO_CRASH", "x", where="BlockPool.free_blocks (block_pool.py:120)")
    assert signature(c1, Step("r1", 1)) != signature(c2, Step("r1", 1))  # two crash sites: two bugs
    assert c1 == Violation("NO_CRASH", "x")  # the location is not part of a violation's equality


def _through_kvspec(fn, *args):
    """Call ``fn`` from a frame that blame counts as kvspec's own (a driver's call)."""
    ns = {"__name__": "kvspec.targets.fake_driver"}
    exec("def call(fn, *a):\n    try:\n        fn(*a)\n    except Exception as e:\n        return e\n", ns)
    e = ns["call"](fn, *args)
    assert e is not None
    return e


class _Pool:
    def get(self, n):
        return self._check(n)

    def _check(self, n):
        if n < 0:
            raise ValueError(f"negative count {n}")
        if n > 4:
            raise KeyError(n)  # not a rejection of an argument's value class
        return [0] * n


class _Manager:
    def __init__(self):
        self.pool = _Pool()

    def allocate(self, need, have):
        return self.pool.get(need - have)


def test_blame_names_the_caller_that_passed_a_rejected_value():
    b = blame(_through_kvspec(_Manager().allocate, 1, 3))
    assert b.raised_at.function == "_Pool._check"
    assert b.callee.function == "_Pool.get"  # the pool's own helper is part of the callee
    assert b.caller.function == "_Manager.allocate" and b.caller.file == "test_distinct_findings.py"
    # the call kvspec made rejected it: the target refused a valid op, no caller in the target
    direct = blame(_through_kvspec(_Pool().get, -1))
    assert direct.raised_at.function == "_Pool._check" and direct.caller is None
    # not a rejection class: a crash site, no caller bug
    other = blame(_through_kvspec(_Manager().allocate, 9, 0))
    assert other.raised_at.function == "_Pool._check" and other.caller is None
    # a documented misuse error of the target is a rejection too
    assert blame(_through_kvspec(_Manager().allocate, 9, 0), documented=(KeyError,)).caller is not None


# -- a caller bug is a bug ------------------------------------------------------------------
def test_negative_count_from_the_manager_is_a_caller_bug_on_a_valid_sequence():
    # block size 3: a 4-token prompt holds 2 blocks; one more token still fits in them, so the
    # patched manager's count is 2 - 2 - 1 = -1, which it passes to BlockPool.get_new_blocks
    target = load_target("impl", patch=str(CALLER_BUG))
    cfg = Config(level="cache", num_blocks=4, block_size=3, caching=True)
    out = run_steps(target, cfg, [Admit("r1", (1, 2, 3, 4)), Step("r1", 5)])
    assert out.index == 1 and out.invariant == "NO_CRASH"
    v = out.violations[0]
    assert v.caller.startswith("KVCacheManager.allocate_slots (kv_cache_manager.py:")
    assert v.where.startswith("BlockPool.get_new_blocks (block_pool.py:")
    assert "a caller bug, not a misuse" in v.message and "KVCacheManager.allocate_slots" in v.message


def test_caller_bug_is_reported_as_a_bug_at_the_cache_level(capsys, tmp_path):
    rc, d = run_json(["check", "--patch", str(CALLER_BUG), "--level", "cache", "--max-examples", "100",
                      "--report-dir", str(tmp_path)], capsys)
    assert rc == 1 and d["robustness"] == []
    crash = [v for v in d["violations"] if v["invariant"] == "NO_CRASH"]
    assert crash, [v["message"] for v in d["violations"]]
    # The negative count breaks the pool wherever it lands first (get_new_blocks, or a
    # cache_full_blocks after it): which comes first depends on the draws, and every one
    # is the caller's bug.
    assert all(v["label"] == "bug" and v["caller_bug"].startswith("KVCacheManager.allocate_slots") for v in crash), crash
    v = next((v for v in crash if v["signature"].startswith("NO_CRASH on Step at BlockPool.get_new_blocks")), None)
    assert v is not None, [v["signature"] for v in crash]
    assert Path(v["repro"]).is_file()


def test_whole_budget_searches_the_whole_example_count_after_a_finding(tmp_path):
    """By default the search after a finding goes on only while fruitful; with
    ``whole_budget`` (``--whole-budget``, the release sweep's way) through the whole of
    ``max_examples``, keeping every finding the default run made, at the same examples."""
    from kvspec.check.search import run_check

    target = load_target("impl", patch=str(CORPUS / "cache_no_index.diff"))
    kw = dict(level="pool", seed=0, max_examples=300, max_findings=5, report_dir=str(tmp_path))
    fruitful = run_check(target, "impl", **kw)
    whole = run_check(target, "impl", whole_budget=True, **kw)
    assert fruitful.violations and fruitful.examples < 300   # it stopped early after its finding(s)
    assert whole.examples >= 300 and whole.to_dict()["whole_budget"] is True
    first = [(f.signature, f.examples_to_failure) for f in fruitful.violations]
    assert [(f.signature, f.examples_to_failure) for f in whole.violations][:len(first)] == first

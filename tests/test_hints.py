"""Policy hints, never silent relaxing (issue 20, item 2): a finding whose minimal repro
passes under another value of an undeclared policy says which declaration accepts it;
the search then goes on under that value and reports what it finds under its own
heading; a finding no policy explains is labelled a bug; a declared policy is never
second-guessed; kvspec never adopts a hint and the exit code stays 1.

The managers are written here, from examples/my_block_manager.py. Every search is
bounded by an example count, never by seconds."""
import json
import subprocess
import sys
from pathlib import Path

from kvspec.check.hints import BUG, Hint, assuming, explain, label
from kvspec.check.search import Finding
from kvspec.cli import main
from kvspec.spec.config import Config
from kvspec.spec.ops import Admit
from kvspec.targets.registry import load_target

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = (ROOT / "examples" / "my_block_manager.py").read_text()
BUGGY = (ROOT / "examples" / "my_block_manager_buggy.py").read_text()

RELEASE = '''            if block.ref_count == 0:
                self.used_block_ids.remove(block_id)
                self.free_block_ids.append(block_id)'''
# Evicts a block when its last holder frees it (a policy: free_evicts = true), and has a
# real bug: it drops the hash's entry even where the index gives it to another block
# that holds the same content (the latest cached), so that block can no longer be hit.
EVICTS_WITH_BUG = EXAMPLE.replace(RELEASE, RELEASE + '''
                if block.hash != -1:
                    self.hash_to_block_id.pop(block.hash, None)  # BUG: maybe another block's entry
                    block.hash, block.token_ids = -1, []''')
# The same policy, done right: the only difference from vLLM's is the declared one.
EVICTS_RIGHT = EXAMPLE.replace(RELEASE, RELEASE + '''
                if block.hash != -1:
                    if self.hash_to_block_id.get(block.hash) == block_id:
                        del self.hash_to_block_id[block.hash]
                    block.hash, block.token_ids = -1, []''')
CAN_ALLOCATE = '''        hits = self._hits(seq)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return len(self.free_block_ids) >= seq.num_blocks - len(hits) + revived'''
# nano-vllm's boolean can_allocate: every block of the prompt must be free. kvspec reads that
# policy from a gate that reads no hash (kvspec.targets.nano_reading); this gate looks the hits
# up and then does not count them, which a reading of names cannot settle: the hint's case.
ADMITS_ALL = EXAMPLE.replace(CAN_ALLOCATE, "        self._hits(seq)  # looked up, not counted\n"
                                           "        return len(self.free_block_ids) >= seq.num_blocks")


def _write(tmp_path: Path, name: str, source: str, attr: str = "") -> str:
    d = tmp_path / "proj"
    d.mkdir(exist_ok=True)
    if attr:
        source = source.replace("class BlockManager:\n", f"class BlockManager:\n    {attr}\n", 1)
    (d / f"{name}.py").write_text(source)
    return f"{d / name}.py:BlockManager"


def _check(capsys, spec: str, tmp_path: Path, n: int = 300) -> tuple[int, dict]:
    rc = main(["check", "--target", spec, "--json", "--max-examples", str(n), "--report-dir", str(tmp_path / "r")])
    return rc, json.loads(capsys.readouterr().out)


def test_the_templates_differ_as_intended():
    assert EVICTS_WITH_BUG != EXAMPLE and EVICTS_RIGHT != EXAMPLE and ADMITS_ALL != EXAMPLE


# -- explain: the repro replayed under each undeclared value ------------------------------------
def test_a_policy_finding_gets_the_declaration_that_accepts_it(tmp_path):
    t = load_target(_write(tmp_path, "admits_all", ADMITS_ALL))
    # r2 hits r1's held block and needs one new block: vLLM admits, this manager counts both
    steps = [Admit("r1", (1, 2, 3)), Admit("r2", (1, 2, 5))]
    f = Finding("violation", "cache", Config(level="cache", num_blocks=3, block_size=2), steps, [], 2)
    from kvspec.check.session import run_steps
    out = run_steps(t, f.config, steps)
    assert out.failed and out.invariant == "NO_LEAK"
    f.violations = out.violations
    assert explain(t, f) == [Hint("admit_all_blocks", True)]
    label(t, f)
    assert f.label == "policy"
    assert f.hints[0].text == ("if your engine admits a prompt only when all its blocks are free (its cached ones "
                               "too), declare `admit_all_blocks = true` ([tool.kvspec] in pyproject.toml or "
                               "kvspec_traits)")
    # the hint is an assumption on a copy: the target's own traits are untouched
    hinted = assuming(t, {"admit_all_blocks": True})
    assert hinted.traits.admit_all_blocks and hinted.traits.assumed == (("admit_all_blocks", True),)
    assert not t.traits.admit_all_blocks and t.traits.assumed == ()
    assert not run_steps(hinted, f.config, steps).failed


def test_a_policy_finding_and_the_bug_underneath(tmp_path, capsys):
    spec = _write(tmp_path, "evicts_with_bug", EVICTS_WITH_BUG)
    rc, d = _check(capsys, spec, tmp_path)
    assert rc == 1 and d["declaration"] == "none: vLLM's defaults"
    v = d["violations"][0]
    assert v["label"] == "policy" and [h["declare"] for h in v["hints"]] == ["free_evicts = true"]
    # the search went on under the hint and found the real bug, under its own heading
    (a,) = d["assuming"]
    assert a["assume"] == {"free_evicts": True} and a["verdict"] == "violation"
    w = a["violations"][0]
    assert w["invariant"] == "INDEX_CONSISTENT" and w["num_steps"] <= 3 and w["label"] == "bug" and not w["hints"]
    assert a["heading"] == f"assuming `free_evicts = true`: INDEX_CONSISTENT in {w['num_steps']} steps"
    # its repro replays under the same assumption (ASSUME), and fails
    src = Path(w["repro"]).read_text()
    assert "ASSUME = {'free_evicts': True}" in src and "not the declaration" in src
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", w["repro"]],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 1 and "INDEX_CONSISTENT" in r.stdout, r.stdout[-2000:]


def test_the_text_report_shows_hint_heading_and_bug(tmp_path, capsys):
    spec = _write(tmp_path, "evicts_with_bug", EVICTS_WITH_BUG)
    assert main(["check", "--target", spec, "--max-examples", "300", "--report-dir", str(tmp_path / "r")]) == 1
    text = capsys.readouterr().out
    assert "  policy hint: if a block leaves your prefix cache when its last holder frees it, declare " \
           "`free_evicts = true`" in text
    assert "\nassuming `free_evicts = true`: INDEX_CONSISTENT in " in text
    assert f"  {BUG}" in text and text.rstrip().endswith("verdict: violation")
    md = (tmp_path / "r" / "kvspec-check.md").read_text()
    assert "## assuming `free_evicts = true`: INDEX_CONSISTENT in" in md and "policy hint:" in md


def test_the_right_policy_alone_is_a_policy_finding_and_nothing_underneath(tmp_path, capsys):
    rc, d = _check(capsys, _write(tmp_path, "evicts_right", EVICTS_RIGHT), tmp_path, n=100)
    assert rc == 1  # never adopted: the finding stands
    assert d["violations"][0]["label"] == "policy"
    assert d["violations"][0]["hints"][0]["declare"] == "free_evicts = true"
    (a,) = d["assuming"]
    assert a["verdict"] == "pass" and a["heading"].startswith("assuming `free_evicts = true`: nothing found in ")


def test_a_pure_bug_is_labelled_a_bug_with_no_hint(tmp_path, capsys):
    rc, d = _check(capsys, _write(tmp_path, "buggy", BUGGY), tmp_path, n=1000)
    v = d["violations"][0]
    assert rc == 1 and v["invariant"] == "INDEX_CONSISTENT"
    assert v["label"] == "bug" and v["hints"] == [] and d["assuming"] == []


def test_a_declared_policy_is_not_second_guessed(tmp_path, capsys):
    spec = _write(tmp_path, "declared", EVICTS_RIGHT, 'kvspec_traits = {"free_evicts": False}')
    assert main(["check", "--target", spec, "--max-examples", "300", "--report-dir", str(tmp_path / "r")]) == 1
    text = capsys.readouterr().out
    assert "declared, so not second-guessed by hints: free_evicts" in text
    assert "free_evicts = true" not in text and "assuming" not in text
    assert BUG in text


def test_kvspecs_own_targets_get_no_hints(tmp_path, capsys):
    # impl declares its policies in code: a bug found in it is not second-guessed
    patch = str(ROOT / "kvspec" / "corpus" / "impl" / "no_evict.diff")
    assert not load_target("impl", patch=patch).traits.hintable
    assert main(["check", "--target", "impl", "--patch", patch, "--level", "pool", "--json", "--max-examples",
                 "300", "--report-dir", str(tmp_path)]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["declaration"] == f"impl+{patch}: KVCacheManager.kvspec_traits"
    assert d["violations"] and all(v["label"] is None and v["hints"] == [] for v in d["violations"])
    assert d["assuming"] == []


def test_an_unstated_free_order_is_followed_and_a_stated_one_is_checked(tmp_path, capsys):
    # the free queue kept sorted: which free block is reused first is the allocator's choice
    # while it states no order (free_order "any": kvspec follows it), a finding once it does
    release = "                self.free_block_ids.append(block_id)\n        seq.num_cached_tokens = 0"
    assert release in EXAMPLE
    src = EXAMPLE.replace(release, "                self.free_block_ids.append(block_id)\n"
                                   "        self.free_block_ids = deque(sorted(self.free_block_ids))\n"
                                   "        seq.num_cached_tokens = 0")
    rc, d = _check(capsys, _write(tmp_path, "sorted_queue", src), tmp_path, n=150)
    assert rc == 0 and d["verdict"] == "pass", d["violations"][:1]
    stated = src.replace("class BlockManager:\n", "class BlockManager:\n    kvspec_traits = {'free_order': 'lru_tail_first'}\n", 1)
    assert stated != src
    rc, d = _check(capsys, _write(tmp_path, "sorted_queue_lru", stated), tmp_path, n=150)
    v = d["violations"][0]
    assert rc == 1 and v["invariant"] == "EVICTION_ORDER" and v["label"] == "bug" and not v["hints"]  # stated: no hint


def test_the_readme_strict_example_gets_its_hint_and_a_clean_continued_search(capsys, tmp_path):
    """The README's strict example as shipped: its gate reads no hash, so kvspec reads its admission
    from the code (admit_all_blocks = true, named in the declaration) and checks it against it:
    no NO_LEAK, no hint (before issue 36 it reported NO_LEAK with this hint). The hint and the
    continued search, on a gate kvspec cannot read (it looks the hits up and does not count them)."""
    rc, out = _check(capsys, str(ROOT / "examples" / "my_block_manager_strict.py") + ":BlockManager", tmp_path)
    assert rc == 0 and out["verdict"] == "pass" and not out["violations"], out["violations"][:1]
    assert "read from its code: admit_all_blocks = true" in out["declaration"]
    rc, out = _check(capsys, _write(tmp_path, "admits_all", ADMITS_ALL), tmp_path)
    assert rc == 1 and out["violations"][0]["invariant"] == "NO_LEAK"
    assert [h["declare"] for h in out["violations"][0]["hints"]] == ["admit_all_blocks = true"]
    assert [a["verdict"] for a in out["assuming"]] == ["pass"]


def _lazy_free_deque(src: str) -> str:
    """A lazily cleaned free deque (a set holds the truth): a revived block's entry stays in
    the deque, so when it is freed again it is reused from its old place."""
    edits = [
        ("        self.used_block_ids: set[int] = set()\n",
         "        self.used_block_ids: set[int] = set()\n        self.free_block_set = set(range(num_blocks))\n"),
        ("        block_id = self.free_block_ids.popleft()\n",
         "        block_id = self.free_block_ids.popleft()\n        while block_id not in self.free_block_set:\n"
         "            block_id = self.free_block_ids.popleft()\n        self.free_block_set.discard(block_id)\n"),
        ("                self.free_block_ids.remove(block_id)\n", "                self.free_block_set.discard(block_id)\n"),
        ("                self.free_block_ids.append(block_id)\n        seq.num_cached_tokens = 0",
         "                self.free_block_ids.append(block_id)\n                self.free_block_set.add(block_id)\n"
         "        seq.num_cached_tokens = 0"),
        ("        return len(self.free_block_ids) >= seq.num_blocks", "        return len(self.free_block_set) >= seq.num_blocks"),
        ("        return len(self.free_block_ids) >= (len(seq)", "        return len(self.free_block_set) >= (len(seq)"),
    ]
    for old, new in edits:
        assert old in src, old
        src = src.replace(old, new)
    return src


def test_a_lazy_free_deque_is_read_and_its_order_no_policy_explains_is_a_bug(tmp_path, capsys):
    # not a false I1 (the set holds the truth): with no order stated, the order is followed and it passes
    rc, d = _check(capsys, _write(tmp_path, "lazy_deque", _lazy_free_deque(EXAMPLE)), tmp_path, n=150)
    assert rc == 0 and d["verdict"] == "pass", d["violations"][:1]
    # with vLLM's order stated, no declarable free order fits its order: a bug
    stated = _lazy_free_deque(EXAMPLE).replace(
        "class BlockManager:\n", "class BlockManager:\n    kvspec_traits = {'free_order': 'lru_tail_first'}\n", 1)
    rc, d = _check(capsys, _write(tmp_path, "lazy_deque_lru", stated), tmp_path, n=150)
    first = d["violations"][0]
    assert rc == 1 and first["invariant"] == "EVICTION_ORDER" and first["label"] == "bug"
    assert not first["hints"]


def test_a_hint_the_continued_search_disproves_turns_the_finding_into_a_bug():
    from types import SimpleNamespace as NS
    from kvspec.check.hints import disprove
    mru, fifo = Hint("free_order", "mru"), Hint("free_order", "fifo")
    first = NS(label="policy", invariant="EVICTION_ORDER", hints=[mru, fifo], disproved=None)
    other = NS(label="policy", invariant="NO_LEAK", hints=[Hint("admit_all_blocks", True)], disproved=None)
    again = NS(label="bug", invariant="EVICTION_ORDER", steps=[1, 2], hints=[])
    disprove(NS(violations=[first, other]), mru, NS(violations=[again]))
    assert first.label == "bug" and '`free_order = "mru"` passes this repro' in first.disproved
    assert other.label == "policy" and other.disproved is None  # another invariant: untouched
    explained = NS(label="policy", invariant="EVICTION_ORDER", hints=[mru], disproved=None)
    disprove(NS(violations=[explained]), mru, NS(violations=[NS(label="policy", invariant="EVICTION_ORDER",
                                                                   steps=[1], hints=[fifo])]))
    assert explained.label == "policy"  # the next finding has a hint of its own: nothing disproved

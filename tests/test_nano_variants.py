"""nano-vllm variants kvspec drives without a shim (issue 20, items 5 and 6): the chunked
prefill generation, defaulted parameters and other spellings, a Sequence that needs
sampling parameters, a manager without prefix caching, one that insists on its own block
size, and declared extra protocol calls.

Every manager here is this project's own code, written for these tests: one small manager
per variant, each derived from ``BASE`` (a correct nano-vllm-style manager with vLLM's
policies) by textual edits, so a test differs from the base in exactly the variant."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from kvspec.check.search import run_check
from kvspec.check.session import Session
from kvspec.spec.config import Config
from kvspec.spec.ops import Admit, Finish, Preempt, Step
from kvspec.targets.nanovllm_target import BOOLEAN, CHUNKED, COUNTED, LAYOUT, NANO_CALLS, Scale
from kvspec.targets.registry import load_target

BASE = '''
from collections import deque
import hashlib


def cdiv(a, b):
    return -(-a // b)


class Block:
    def __init__(self, block_id):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids = []


class BlockManager:
    def __init__(self, num_blocks, block_size):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id = {}
        self.free_block_ids = deque(range(num_blocks))
        self.used_block_ids = set()

    @staticmethod
    def compute_hash(token_ids, prefix=-1):
        h = hashlib.sha256(repr((prefix, list(token_ids))).encode())
        return int.from_bytes(h.digest()[:8], "little")

    def _hits(self, seq):
        hits, h = [], -1
        for i in range((len(seq) - 1) // self.block_size):
            h = self.compute_hash(seq.block(i), h)
            b = self.hash_to_block_id.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def _take(self):
        b = self.free_block_ids.popleft()
        blk = self.blocks[b]
        if blk.hash != -1 and self.hash_to_block_id.get(blk.hash) == b:
            del self.hash_to_block_id[blk.hash]
        blk.hash, blk.token_ids, blk.ref_count = -1, [], 1
        self.used_block_ids.add(b)
        return b

    def _revive(self, b):
        if self.blocks[b].ref_count == 0:
            self.free_block_ids.remove(b)
            self.used_block_ids.add(b)
        self.blocks[b].ref_count += 1

    def _cache(self, b, token_ids, prefix):
        blk = self.blocks[b]
        blk.hash, blk.token_ids = self.compute_hash(token_ids, prefix), list(token_ids)
        self.hash_to_block_id[blk.hash] = b

    def can_allocate(self, seq):
        hits = self._hits(seq)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return len(self.free_block_ids) >= seq.num_blocks - len(hits) + revived

    def allocate(self, seq):
        hits = self._hits(seq)
        for b in hits:
            self._revive(b)
            seq.block_table.append(b)
        seq.num_cached_tokens = len(hits) * self.block_size
        prefix = self.blocks[hits[-1]].hash if hits else -1
        for i in range(len(hits), seq.num_blocks):
            b = self._take()
            seq.block_table.append(b)
            if len(seq.block(i)) == self.block_size:
                self._cache(b, seq.block(i), prefix)
                prefix = self.blocks[b].hash

    def can_append(self, seq):
        return len(self.free_block_ids) >= (len(seq) % self.block_size == 1)

    def may_append(self, seq):
        table = seq.block_table
        if len(seq) % self.block_size == 1:
            table.append(self._take())
        elif len(seq) % self.block_size == 0:
            prefix = self.blocks[table[-2]].hash if len(table) > 1 else -1
            self._cache(table[-1], seq.block(len(table) - 1), prefix)

    def deallocate(self, seq):
        for b in reversed(seq.block_table):
            blk = self.blocks[b]
            blk.ref_count -= 1
            if blk.ref_count == 0:
                self.used_block_ids.remove(b)
                self.free_block_ids.append(b)
        seq.num_cached_tokens = 0
        seq.block_table.clear()
'''

# The chunked-prefill generation: can_allocate(seq, num_tokens) / allocate(seq, num_tokens)
# grow the table to hold num_cached_tokens + num_tokens; the prefix is matched when the
# table is empty; hash_blocks after each forward; decode is a one-token chunk.
CHUNKED_METHODS = '''
    def can_allocate(self, seq, num_tokens):
        if not seq.block_table:
            hits = self._hits(seq)
            revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
            return len(self.free_block_ids) >= cdiv(num_tokens, self.block_size) - len(hits) + revived
        need = cdiv(seq.num_cached_tokens + num_tokens, self.block_size) - len(seq.block_table)
        return len(self.free_block_ids) >= need

    def allocate(self, seq, num_tokens):
        if not seq.block_table:
            for b in self._hits(seq):
                self._revive(b)
                seq.block_table.append(b)
            seq.num_cached_tokens = len(seq.block_table) * self.block_size
        while len(seq.block_table) < cdiv(seq.num_cached_tokens + num_tokens, self.block_size):
            seq.block_table.append(self._take())

    def HASH_METHOD(self, seq):
        start = seq.num_cached_tokens // self.block_size
        end = (seq.num_cached_tokens + seq.num_scheduled_tokens) // self.block_size
        h = self.blocks[seq.block_table[start - 1]].hash if start > 0 else -1
        for i in range(start, end):
            self._cache(seq.block_table[i], seq.block(i), PREFIX(h))
            h = self.blocks[seq.block_table[i]].hash
'''


DECODE_METHODS = '''
    def can_append(self, seq):
        return len(self.free_block_ids) >= (len(seq) % self.block_size == 1)

    def may_append(self, seq):
        if len(seq) % self.block_size == 1:
            seq.block_table.append(self._take())
'''


def _chunked_src(prefix: str = "h", hash_method: str = "hash_blocks", decode: bool = True) -> str:
    """The chunked manager; ``decode``: with can_append/may_append (else decode is a
    one-token chunk)."""
    src = BASE.split("    def can_allocate(self, seq):")[0]  # the helpers, then the chunked API
    tail = BASE[BASE.index("    def deallocate(self, seq):"):]
    body = CHUNKED_METHODS.replace("PREFIX(h)", prefix).replace("HASH_METHOD", hash_method)
    return src + body + (DECODE_METHODS if decode else "") + "\n" + tail


def _nano_target(path: Path, name: str = "BlockManager"):
    """A NanoTarget built directly from a file (the class, kvspec's Sequence)."""
    import importlib.util

    from kvspec.targets.nano_sequence import Sequence
    from kvspec.targets.nanovllm_target import NanoTarget

    spec = importlib.util.spec_from_file_location(f"_nano_variant_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return NanoTarget(getattr(mod, name), Sequence, str(path))


def _write(tmp_path: Path, name: str, text: str) -> Path:
    f = tmp_path / f"{name}.py"
    f.write_text(textwrap.dedent(text))
    return f


def _run(session: Session, op):
    """The target's answer to ``op``, which must expose no violation."""
    assert session.apply(op) == []
    return session.last_result


def _check(target, tmp_path, n: int = 150):
    return run_check(target, "variant", level="cache", seed=0, max_examples=n, report_dir=str(tmp_path))


# -- the generations -------------------------------------------------------------------------
def test_the_call_table_names_every_generation():
    assert set(NANO_CALLS) == {BOOLEAN, COUNTED, CHUNKED, LAYOUT}
    chunked = {c.method: c for c in NANO_CALLS[CHUNKED]}
    assert chunked["can_allocate"].args == ("seq", "num_tokens") and not chunked["may_append"].required


def test_the_chunked_generation_is_detected_and_prefilled_chunk_by_chunk(tmp_path):
    f = _write(tmp_path, "chunked", _chunked_src())
    t = load_target(f"{f}:BlockManager")
    assert t.api == CHUNKED
    calls = []
    s = Session(t, Config(level="cache", num_blocks=8, block_size=2))
    mgr = s.driver.mgr
    orig = mgr.allocate
    mgr.allocate = lambda seq, n: (calls.append(n), orig(seq, n))[1]
    assert _run(s, Admit("r1", (1, 2, 3, 4, 5))) == 0
    assert calls == [2, 2, 1]  # one block of tokens per chunk, the last one partial
    assert _run(s, Step("r1", 6)) is True and _run(s, Finish("r1")) is None
    assert _run(s, Admit("r2", (1, 2, 3, 4, 9))) == 4  # the chunks' hashes were indexed
    assert _check(t, tmp_path).verdict == "pass"


def test_a_chunked_manager_without_may_append_decodes_one_token_chunks(tmp_path):
    f = _write(tmp_path, "chunked_nodecode", _chunked_src(decode=False))
    t = load_target(f"{f}:BlockManager")  # as the command line loads it: detected without can_append
    assert t.api == CHUNKED
    s = Session(t, Config(level="cache", num_blocks=4, block_size=2))
    assert _run(s, Admit("r1", (1, 2, 3))) == 0 and s.driver.seqs["r1"].block_table == [0, 1]
    assert _run(s, Step("r1", 4)) is True and _run(s, Step("r1", 5)) is True
    assert s.driver.seqs["r1"].block_table == [0, 1, 2]
    assert _check(t, tmp_path, 100).verdict == "pass"


def test_a_chunked_manager_with_a_real_bug_is_reported(tmp_path):
    f = _write(tmp_path, "chunked_bug", _chunked_src(prefix="-1"))  # hashes without the parent's hash
    report = _check(load_target(f"{f}:BlockManager"), tmp_path, 300)
    assert report.verdict == "violation" and report.violations[0].invariant == "HASH_CHAIN"


# -- defaulted parameters and spellings ----------------------------------------------------
def test_a_defaulted_parameter_is_not_required_and_other_spellings_are_accepted(tmp_path, capsys):
    src = BASE.replace("def allocate(self, seq):", "def allocate(self, seq, plan=None):")
    src += '''

class Sequence:
    block_size = 256

    def __init__(self, token_ids):
        self.token_ids = list(token_ids)
        self.block_table, self.num_cached_tokens = [], 0

    def __len__(self):
        return len(self.token_ids)

    @property
    def num_blocks(self):
        return -(-len(self) // self.block_size)

    def block(self, i):
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append(self, token):  # spelled append, not append_token
        self.token_ids.append(token)
'''
    f = _write(tmp_path, "defaulted", src)
    t = load_target(f"{f}:BlockManager")
    assert t.api == BOOLEAN
    assert _check(t, tmp_path, 80).verdict == "pass"
    assert "Sequence.append is read as kvspec's 'append_token'" in capsys.readouterr().err

    counted = _chunked_src(hash_method="hash_block")  # the counted generation, hash_block spelling
    counted = counted.replace("def can_allocate(self, seq, num_tokens):\n        if not seq.block_table:",
                              "def can_allocate(self, seq):\n        num_tokens = len(seq)\n        if True:")
    counted = counted.replace(
        "return len(self.free_block_ids) >= cdiv(num_tokens, self.block_size) - len(hits) + revived",
        "return len(hits) if len(self.free_block_ids) >= cdiv(num_tokens, self.block_size) - len(hits) + revived "
        "else -1")
    counted = counted.replace("def allocate(self, seq, num_tokens):", "def allocate(self, seq, num_cached_blocks):\n"
                              "        num_tokens = len(seq) - num_cached_blocks * self.block_size")
    f = _write(tmp_path, "counted_hash_block", counted)
    t = load_target(f"{f}:BlockManager")
    assert t.api == COUNTED and _check(t, tmp_path, 80).verdict == "pass"


# -- a Sequence that needs sampling parameters -----------------------------------------------
def test_a_sequence_is_built_with_the_packages_own_sampling_params(tmp_path, monkeypatch):
    pkg = tmp_path / "spkg"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('heavy package init: never run')\n")
    (pkg / "engine" / "__init__.py").write_text("")
    (pkg / "sampling_params.py").write_text(textwrap.dedent('''
        from dataclasses import dataclass


        @dataclass
        class SamplingParams:
            temperature: float = 1.0
            max_tokens: int = 64
            ignore_eos: bool = False
        '''))
    (pkg / "engine" / "sequence.py").write_text(textwrap.dedent('''
        from kvspec.targets.nano_sequence import Sequence as _Base


        class Sequence(_Base):
            def __init__(self, token_ids, sampling_params):
                super().__init__(token_ids)
                self.max_tokens = sampling_params.max_tokens  # reads the package's fields
                self.sampling_params = sampling_params
        '''))
    (pkg / "engine" / "block_manager.py").write_text(BASE.replace("import hashlib", "import hashlib\n"
                                                                  "from spkg.engine.sequence import Sequence"))
    monkeypatch.syspath_prepend(str(tmp_path))
    t = load_target("spkg.engine.block_manager:BlockManager")
    s = Session(t, Config(level="cache", num_blocks=6, block_size=2))
    _run(s, Admit("r1", (1, 2, 3)))
    seq = s.driver.seqs["r1"]
    assert type(seq.sampling_params).__name__ == "SamplingParams" and seq.max_tokens == 64


# -- no prefix caching -------------------------------------------------------------------------
NO_CACHING = '''
from collections import deque


class Block:
    def __init__(self, block_id):
        self.block_id, self.ref_count = block_id, 0


class BlockManager:
    def __init__(self, num_blocks, block_size):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids = deque(range(num_blocks))
        self.used_block_ids = set()

    def _take(self):
        b = self.free_block_ids.popleft()
        self.blocks[b].ref_count = 1
        self.used_block_ids.add(b)
        return b

    def can_allocate(self, seq):
        return len(self.free_block_ids) >= seq.num_blocks

    def allocate(self, seq):
        for _ in range(seq.num_blocks):
            seq.block_table.append(self._take())

    def can_append(self, seq):
        return len(self.free_block_ids) >= (len(seq) % self.block_size == 1)

    def may_append(self, seq):
        if len(seq) % self.block_size == 1:
            seq.block_table.append(self._take())

    def deallocate(self, seq):
        for b in reversed(seq.block_table):
            self.blocks[b].ref_count -= 1
            if self.blocks[b].ref_count == 0:
                self.used_block_ids.remove(b)
                self.free_block_ids.append(FREED)
        seq.block_table.clear()
'''


@pytest.mark.parametrize("freed, verdict", [("b", "pass"), ("0", "violation")], ids=["correct", "frees_block_0"])
def test_a_manager_without_prefix_caching_is_checked_with_caching_off(tmp_path, freed, verdict):
    f = _write(tmp_path, f"nocache_{verdict}", NO_CACHING.replace("FREED", freed))
    t = load_target(f"{f}:BlockManager")
    assert t.traits.prefix_caching == "off" and t.traits.caching_modes == (False,)
    assert _check(t, tmp_path, 100).verdict == verdict


# -- a manager that insists on its own block size ------------------------------------------------
def test_scale_maps_blocks_to_blocks():
    s = Scale(3, 256)
    assert s.copies == [86, 85, 85] and s.to_real(3) == 256 and s.to_real(4) == 342
    assert [s.to_run(s.to_real(n)) for n in range(10)] == list(range(10))
    assert len(s.expand([1, 2, 3, 4])) == 342 and s.expand([7], 1) == [7] * 85


@pytest.mark.parametrize("where", ["constructor", "sequence"])
def test_a_manager_that_insists_on_block_size_256(tmp_path, where):
    src = BASE.replace("        self.block_size = block_size\n",
                       "        assert block_size == 256\n        self.block_size = block_size\n")
    if where == "constructor":
        src = src.replace("def __init__(self, num_blocks, block_size):", "def __init__(self, num_blocks, block_size=256):")
    else:
        src += '''

from kvspec.targets.nano_sequence import Sequence as _Base


class Sequence(_Base):
    block_size = 256
'''
    f = _write(tmp_path, f"bs256_{where}", src)
    t = load_target(f"{f}:BlockManager")
    s = Session(t, Config(level="cache", num_blocks=6, block_size=2))
    assert s.driver.bs == 256 and _run(s, Admit("r1", (1, 2, 3, 4, 5))) == 0
    assert len(s.driver.seqs["r1"]) == 640 and s.driver.seqs["r1"].block_table == [0, 1, 2]
    assert _run(s, Step("r1", 6)) is True and _run(s, Preempt("r1")) is None
    assert _run(s, Admit("r2", (1, 2, 3, 4, 7))) == 4  # two of the manager's blocks hit
    assert _check(t, tmp_path, 40).verdict == "pass"


# -- extra protocol calls ------------------------------------------------------------------------
MAY_PREFILL = '''
    def may_prefill(self, seq):
        """The fork's scheduler calls this after each prefill chunk and decode step: it
        hashes and indexes every computed full block not hashed yet."""
        h = -1
        for i in range(seq.num_cached_tokens // self.block_size):
            b = seq.block_table[i]
            if self.blocks[b].hash == -1:
                self._cache(b, seq.block(i), h)
            h = self.blocks[b].hash
'''


@pytest.mark.parametrize("declared", [False, True], ids=["undeclared", "declared"])
def test_a_declared_protocol_call_is_driven(tmp_path, declared):
    src = _chunked_src().replace("    def hash_blocks(self, seq):", "    def _unused(self, seq):")
    src = src.replace("    def deallocate", MAY_PREFILL.lstrip("\n") + "\n    def deallocate")
    if declared:
        src = src.replace("class BlockManager:\n", "class BlockManager:\n    kvspec_protocol = "
                          "{'after_prefill_chunk': 'may_prefill', 'after_step': 'may_prefill'}\n\n")
    f = _write(tmp_path, f"may_prefill_{declared}", src)
    t = load_target(f"{f}:BlockManager")
    assert t.api == CHUNKED
    report = _check(t, tmp_path, 150)
    assert report.verdict == ("pass" if declared else "violation")


def test_a_protocol_declaration_in_pyproject_and_its_mistakes(tmp_path):
    from kvspec.errors import UsageError
    from kvspec.targets.names import read_protocol

    src = _chunked_src().replace("    def deallocate", MAY_PREFILL.lstrip("\n") + "\n    def deallocate")
    f = _write(tmp_path, "proto", src)
    (tmp_path / "pyproject.toml").write_text('[tool.kvspec.protocol]\nafter_prefill_chunk = "may_prefill"\n')
    t = load_target(f"{f}:BlockManager")
    assert t.protocol == {"after_prefill_chunk": ("may_prefill",)}
    (tmp_path / "pyproject.toml").write_text('[tool.kvspec.protocol]\nafter_prefil = "may_prefill"\n')
    with pytest.raises(UsageError, match="unknown hook point 'after_prefil'"):
        read_protocol(t.manager_cls, f)
    (tmp_path / "pyproject.toml").write_text('[tool.kvspec.protocol]\nafter_append = "nope"\n')
    with pytest.raises(UsageError, match="has no method 'nope'"):
        read_protocol(t.manager_cls, f)


# -- stale index entries: observed where the manager's own lookup still takes them ------------
STALE = BASE.replace("        if blk.hash != -1 and self.hash_to_block_id.get(blk.hash) == b:\n"
                     "            del self.hash_to_block_id[blk.hash]\n", "")  # reuse keeps the old entry
# A lookup that checks the block still holds that hash makes a stale entry harmless. (Comparing
# the block's tokens, as nano-vllm does, is not enough: equal tokens behind another prefix.)
HASH_CHECK = ("            if b is None:\n                break\n",
              "            if b is None or self.blocks[b].hash != h:\n                break\n")


def test_a_stale_index_entry_the_lookup_takes_is_index_consistent(tmp_path):
    assert STALE != BASE and HASH_CHECK[0] in STALE
    f = _write(tmp_path, "stale", STALE)
    report = _check(load_target(f"{f}:BlockManager"), tmp_path, 200)
    assert report.verdict == "violation" and report.violations[0].invariant == "INDEX_CONSISTENT"
    # stale entries stay, and the lookup checks the block's hash: nothing wrong is ever hit
    f = _write(tmp_path, "stale_checked", STALE.replace(*HASH_CHECK))
    assert _check(load_target(f"{f}:BlockManager"), tmp_path, 200).verdict == "pass"

"""Sliding-window paged attention (issue 11), on the CPU under TRITON_INTERPRET=1.

Convention (vLLM's): with ``sliding_window=W`` a query at position p sees the keys k
with p - W < k <= p. The inputs are laid out the way an allocator with a
sliding-window group leaves them: every table entry of a block that holds no key the
sequence's earliest query can see is the null block 0, and block 0 (like every slot
no sequence owns) is filled with NaN. A kernel that reads such a block, or any
unowned slot, yields NaN and fails. ``poison_hidden`` goes further and also fills
with NaN the hidden keys *inside* retained blocks (positions before the earliest
query's window), which this kernel promises not to load either.
"""
from __future__ import annotations

import difflib
import importlib
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import kvspec.kernels as kernels  # noqa: E402
from kvspec.kernels import reference, tolerance  # noqa: E402

pa_module = importlib.import_module("kvspec.kernels.paged_attention")


@dataclass(frozen=True)
class WinCase:
    seq_lens: tuple[int, ...]
    window: Optional[int]
    q_lens: Optional[tuple[int, ...]] = None  # None: decode
    block_size: int = 4
    num_kv_heads: int = 1
    group: int = 1
    head_dim: int = 32
    dtype: str = "float32"
    softcap: Optional[float] = None
    num_splits: Optional[int] = None
    poison_hidden: bool = False
    q_gain: float = 2.0
    seed: int = 0

    def label(self) -> str:
        mode = "decode" if self.q_lens is None else f"extend q={list(self.q_lens)}"
        return (f"W={self.window} {mode} lens={list(self.seq_lens)} bs={self.block_size} "
                f"kv={self.num_kv_heads}x{self.group} {self.dtype} softcap={self.softcap} "
                f"splits={self.num_splits}{' poison_hidden' if self.poison_hidden else ''}")


def first_visible(n: int, q_len: int, window: Optional[int]) -> int:
    """The first key position the sequence's earliest query can see."""
    if window is None:
        return 0
    if q_len == 0:
        return n  # no query: no key is needed at all
    return max(0, n - q_len - window + 1)


def build(case: WinCase) -> dict:
    dtype = getattr(torch, case.dtype)
    g = torch.Generator().manual_seed(case.seed)
    rng = random.Random(case.seed)
    bs, hkv, dim = case.block_size, case.num_kv_heads, case.head_dim
    q_lens = case.q_lens if case.q_lens is not None else tuple(1 if n else 0 for n in case.seq_lens)
    pages = [-(-n // bs) for n in case.seq_lens]
    num_blocks = 1 + 2 * sum(pages) + 2
    pool = list(range(1, num_blocks))  # block 0 is the null block: NaN, shared, never owned
    rng.shuffle(pool)
    k_cache = torch.full((num_blocks, bs, hkv, dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    width = max(pages + [1]) + 1
    tables = torch.full((len(case.seq_lens), width), -1, dtype=torch.int32)
    nulled = 0
    for i, n in enumerate(case.seq_lens):
        lo = first_visible(n, q_lens[i], case.window)
        for b in range(pages[i]):
            if (b + 1) * bs <= lo:  # wholly before the window: the allocator freed it
                tables[i, b] = 0
                nulled += 1
                continue
            blk = pool.pop()
            tables[i, b] = blk
            for s in range(bs):
                p = b * bs + s
                if p >= n or (case.poison_hidden and p < lo):
                    continue  # stays NaN
                k_cache[blk, s] = torch.randn(hkv, dim, generator=g).to(dtype)
                v_cache[blk, s] = torch.randn(hkv, dim, generator=g).to(dtype)
    total_q = sum(q_lens) if case.q_lens is not None else len(case.seq_lens)
    cu = None
    if case.q_lens is not None:
        cu = torch.tensor([0] + [sum(case.q_lens[: i + 1]) for i in range(len(case.q_lens))], dtype=torch.int32)
    q = (torch.randn(total_q, hkv * case.group, dim, generator=g) * case.q_gain).to(dtype)
    return {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": tables,
            "seq_lens": torch.tensor(case.seq_lens, dtype=torch.int32), "cu": cu, "nulled": nulled}


def run(case: WinCase, attention=None, window="case"):
    """(ok, kernel error, bound, inputs, output); ``window`` overrides the kernel's window."""
    attention = attention or kernels.paged_attention
    t = build(case)
    args = (t["q"], t["k_cache"], t["v_cache"], t["block_tables"], t["seq_lens"])
    w = case.window if window == "case" else window
    out = torch.full_like(t["q"], float("nan"))  # poison: an unwritten element fails
    res = attention(*args, cu_seqlens_q=t["cu"], softcap=case.softcap, sliding_window=w,
                    num_splits=case.num_splits, out=out)
    kw = dict(cu_seqlens_q=t["cu"], softcap=case.softcap, sliding_window=case.window)
    ref64 = reference.paged_attention(*args, **kw)
    ref_lowp = reference.paged_attention(*args, **kw, compute_dtype=t["q"].dtype)
    ok, err, allowed = tolerance.check_close(res, ref64, ref_lowp, t["q"].dtype)
    return ok, err, allowed, t, res


def assert_passes(case: WinCase, want_nulled: bool = True) -> dict:
    ok, err, allowed, t, _ = run(case)
    assert ok, f"{case.label()}: error {err:.3g} > bound {allowed:.3g}"
    if want_nulled:  # the case must really exercise null entries pointing at NaN
        assert t["nulled"] > 0, f"{case.label()}: no table entry lies outside the window"
    return t


DECODE = [
    WinCase(seq_lens=(23, 9, 40), window=6, block_size=4, seed=1),
    WinCase(seq_lens=(23, 0, 37), window=5, block_size=3, num_kv_heads=2, group=4, seed=2),  # GQA, seq_len 0
    WinCase(seq_lens=(30, 17), window=7, block_size=5, num_kv_heads=1, group=8, seed=3),  # MQA
    WinCase(seq_lens=(20, 3, 33), window=4, block_size=1, num_kv_heads=2, group=2, seed=4),  # block_size 1
    WinCase(seq_lens=(64, 50), window=17, block_size=16, num_kv_heads=2, group=1, softcap=3.0, seed=5),
    WinCase(seq_lens=(45, 28), window=20, block_size=3, num_kv_heads=2, group=2, num_splits=3, seed=6),  # splits
    WinCase(seq_lens=(45, 28), window=9, block_size=2, group=3, num_splits=5, poison_hidden=True, seed=7),
    WinCase(seq_lens=(40, 12), window=11, block_size=4, num_kv_heads=2, group=2, dtype="float16", seed=8),
    WinCase(seq_lens=(40, 12), window=11, block_size=5, num_kv_heads=1, group=4, dtype="bfloat16", seed=9),
]

EXTEND = [
    # extend over a cached prefix; prefill (q == seq_len); a sequence with no new token
    WinCase(seq_lens=(30, 12, 25), q_lens=(5, 12, 0), window=6, block_size=4, seed=11),
    WinCase(seq_lens=(41, 19), q_lens=(9, 19), window=5, block_size=3, num_kv_heads=2, group=4, seed=12),  # GQA
    WinCase(seq_lens=(33, 26), q_lens=(3, 26), window=8, block_size=1, num_kv_heads=1, group=2, seed=13),  # bs 1
    WinCase(seq_lens=(37,), q_lens=(20,), window=7, block_size=5, group=8, softcap=2.0, seed=14),  # MQA, softcap
    WinCase(seq_lens=(50, 44), q_lens=(14, 6), window=10, block_size=3, num_kv_heads=2, group=2, num_splits=3,
            seed=15),  # forced splits in extend
    WinCase(seq_lens=(48, 30), q_lens=(7, 30), window=9, block_size=4, group=2, poison_hidden=True, seed=16),
    WinCase(seq_lens=(29, 40), q_lens=(29, 11), window=6, block_size=2, num_kv_heads=2, group=2, dtype="float16",
            seed=17),
    WinCase(seq_lens=(29, 40), q_lens=(10, 40), window=6, block_size=3, num_kv_heads=1, group=2, dtype="bfloat16",
            seed=18),
]


def random_window_cases(seed: int, count: int) -> list[WinCase]:
    """A seeded spread: both modes, every dtype, MHA/GQA/MQA, splits, softcap, odd head dims."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        bs = rng.choice([1, 2, 3, 5, 16])
        window = rng.choice([1, 2, rng.randint(3, 20), 33])
        lens = tuple(rng.choice([0, 1, rng.randint(2, 60), window + rng.randint(bs, 3 * bs + 8)])
                     for _ in range(rng.randint(1, 3)))
        extend = i % 2 == 1
        q_lens = tuple(rng.choice([0, n, rng.randint(0, n)]) for n in lens) if extend else None
        hkv, group = rng.choice([(1, 1), (2, 1), (1, 4), (2, 3), (1, 8)])
        out.append(WinCase(seq_lens=lens, window=window, q_lens=q_lens, block_size=bs, num_kv_heads=hkv, group=group,
                           head_dim=rng.choice([32, 80, 64]), dtype=("float32", "float16", "bfloat16")[i % 3],
                           softcap=rng.choice([None, None, 4.0]), num_splits=rng.choice([None, 1, 2, 3]),
                           poison_hidden=rng.random() < 0.5, seed=seed * 100 + i))
    return out


@pytest.mark.parametrize("case", DECODE, ids=lambda c: c.label())
def test_decode_window_matches_oracle(case):
    assert_passes(case)


@pytest.mark.parametrize("case", EXTEND, ids=lambda c: c.label())
def test_extend_window_matches_oracle(case):
    assert_passes(case)


@pytest.mark.parametrize("case", random_window_cases(seed=11, count=16), ids=lambda c: c.label())
def test_random_window_cases_match_oracle(case):
    assert_passes(case, want_nulled=False)


def test_extend_query_tiles_each_start_their_own_window():
    # 100 new tokens with group 1: two 64-row query tiles on the CPU, the second with a
    # later window start; the null entries cover only the first query's hidden blocks.
    assert_passes(WinCase(seq_lens=(130,), q_lens=(100,), window=12, block_size=4, seed=19))


def test_long_context_decode_with_window_does_not_split_over_the_whole_context():
    # 1100 tokens, window 40: one program covers the window; the default must not split
    # the whole context (the old choice for 1100 tokens) and must still be right.
    assert pa_module._num_splits(2, 1, 40, 16, on_gpu=False) == 1
    t = assert_passes(WinCase(seq_lens=(1100, 70), window=40, block_size=16, group=2, seed=20))
    assert t["nulled"] >= 1100 // 16 - 4


@pytest.mark.parametrize("extend", [False, True], ids=["decode", "extend"])
def test_window_at_least_seq_len_is_no_window(extend):
    lens = (17, 0, 9, 30)
    q_lens = (6, 0, 9, 1) if extend else None
    base = WinCase(seq_lens=lens, q_lens=q_lens, window=None, block_size=3, num_kv_heads=2, group=2, seed=21)
    t = build(base)  # no window: nothing is nulled
    args = (t["q"], t["k_cache"], t["v_cache"], t["block_tables"], t["seq_lens"])
    plain = kernels.paged_attention(*args, cu_seqlens_q=t["cu"])
    for w in (30, 31, 1000):
        assert torch.equal(kernels.paged_attention(*args, cu_seqlens_q=t["cu"], sliding_window=w), plain), w
        assert torch.equal(reference.paged_attention(*args, cu_seqlens_q=t["cu"], sliding_window=w),
                           reference.paged_attention(*args, cu_seqlens_q=t["cu"])), w
    # ... while a window one short of the longest context changes the result.
    assert not torch.equal(kernels.paged_attention(*args, cu_seqlens_q=t["cu"], sliding_window=29), plain)


@pytest.mark.parametrize("extend", [False, True], ids=["decode", "extend"])
@pytest.mark.parametrize("block_size", [1, 4])
def test_window_one_sees_only_its_own_key(extend, block_size):
    case = WinCase(seq_lens=(13, 1, 8), q_lens=(5, 1, 8) if extend else None, window=1, block_size=block_size,
                   num_kv_heads=2, group=3, poison_hidden=True, seed=22)
    t = assert_passes(case)
    out = kernels.paged_attention(t["q"], t["k_cache"], t["v_cache"], t["block_tables"], t["seq_lens"],
                                  cu_seqlens_q=t["cu"], sliding_window=1)
    q_lens = case.q_lens or (1, 1, 1)
    row = 0
    for i, n in enumerate(case.seq_lens):
        for p in range(n - q_lens[i], n):
            blk = int(t["block_tables"][i, p // block_size])
            v = t["v_cache"][blk, p % block_size].repeat_interleave(case.group, dim=0)
            assert torch.equal(out[row], v), (i, p)  # softmax over one key: exactly V (fp32)
            row += 1


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # the no-window run reads the NaN block
def test_null_block_really_is_nan_and_really_is_referenced():
    case = DECODE[0]
    t = build(case)
    assert torch.isnan(t["k_cache"][0]).all() and torch.isnan(t["v_cache"][0]).all()
    assert (t["block_tables"] == 0).sum().item() == t["nulled"] > 0
    out = kernels.paged_attention(t["q"], t["k_cache"], t["v_cache"], t["block_tables"], t["seq_lens"],
                                  sliding_window=case.window)
    assert torch.isfinite(out).all()
    # Without the window the same inputs must read the null block: NaN (the trap works).
    no_window = kernels.paged_attention(t["q"], t["k_cache"], t["v_cache"], t["block_tables"], t["seq_lens"])
    assert not torch.isfinite(no_window).all()


@pytest.mark.parametrize("extend", [False, True], ids=["decode", "extend"])
def test_entries_outside_the_window_may_hold_anything(extend):
    # The null block 0, -1 or an index far past the pool: bit-identical output, so
    # those entries are not even used as addresses.
    case = WinCase(seq_lens=(29, 40, 6), q_lens=(5, 1, 6) if extend else None, window=7, block_size=3,
                   num_kv_heads=2, group=2, seed=24)
    t = build(case)
    null = t["block_tables"] == 0
    assert null.any()
    outs = []
    for fill in (0, -1, 10**6):
        tables = t["block_tables"].masked_fill(null, fill)
        outs.append(kernels.paged_attention(t["q"], t["k_cache"], t["v_cache"], tables, t["seq_lens"],
                                            cu_seqlens_q=t["cu"], sliding_window=case.window, num_splits=2))
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_bad_windows_are_rejected():
    t = build(WinCase(seq_lens=(5,), window=None, seed=23))
    args = (t["q"], t["k_cache"], t["v_cache"], t["block_tables"], t["seq_lens"])
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="sliding_window"):
            kernels.paged_attention(*args, sliding_window=bad)
    with pytest.raises(ValueError, match="sliding_window"):
        reference.paged_attention(*args, sliding_window=0)


# --- the checks above can fail: window bugs planted in a copy of the kernel ---------

MUTANTS = {
    # the window mask dropped: every hidden key counts (and the null block's NaN is read)
    "window_ignored": ("            visible = visible & (kv_pos[None, :] > q_pos[:, None] - window)",
                       "            visible = visible"),
    # off by one: W + 1 keys visible
    "window_off_by_one": ("            visible = visible & (kv_pos[None, :] > q_pos[:, None] - window)",
                          "            visible = visible & (kv_pos[None, :] >= q_pos[:, None] - window)"),
    # correct mask, but the key range starts at 0: the blocks before the window are loaded
    "loads_before_window": ("        kv_start = tl.maximum(seq_len - q_len + q_start - window + 1, 0)",
                            "        kv_start = 0"),
    # the range starts at the *last* row's window: keys the earliest rows need are skipped
    "range_from_last_row": ("        kv_start = tl.maximum(seq_len - q_len + q_start - window + 1, 0)",
                            "        kv_start = tl.maximum(kv_end - window, 0)"),
}


def _load_patched(diff_text: str, tmp_path: Path):
    from kvspec.kernels.sweep import load_patched_kernels, unload_patched

    return load_patched_kernels(diff_text, tmp_path), unload_patched


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # the interpreter's max over NaN traps
@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_window_bugs_are_caught(mutant, tmp_path):
    old, new = MUTANTS[mutant]
    src = Path(pa_module.__file__).read_text()
    assert src.count(old + "\n") == 1, f"{mutant}: the line to mutate is gone; update MUTANTS"
    diff = "".join(difflib.unified_diff(src.splitlines(True), src.replace(old + "\n", new + "\n").splitlines(True),
                                        "a/kernels/paged_attention.py", "b/kernels/paged_attention.py"))
    mod, unload = _load_patched(diff, tmp_path)
    try:
        assert mod.paged_attention.__module__.startswith(mod.__name__ + "."), "the copy runs the unpatched kernel"
        results = []
        for case in (EXTEND[0], DECODE[0], DECODE[6]):
            ok, err, allowed, _, _ = run(case, mod.paged_attention)
            results.append((case.label(), err))
            if not ok:
                break
    finally:
        unload(mod)
    assert not ok, f"{mutant} was not caught: {results}"

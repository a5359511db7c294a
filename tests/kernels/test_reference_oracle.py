"""An oracle for the oracle (issue 13): ``kernels/reference.py`` against independent maths.

Every kernel test trusts the float64 reference. Here it is checked against
``torch.nn.functional.scaled_dot_product_attention`` on dense float64 tensors that this
file builds itself: K/V gathered position by position through the block table (not
with ``reference.gather_kv``), KV heads repeated with ``repeat_interleave`` for
GQA/MQA, and causal-with-prefix and sliding-window masks written out as explicit
boolean masks. SDPA has no softcap, so softcapped cases are checked against a plain
dense implementation written here instead (tanh-capped scores, ``torch.softmax``).

Inputs are float64 throughout, so both sides agree to rounding (~1e-15); the bound is
1e-10. The last test perturbs the reference (scale, softcap, window, head mapping,
causal offset) and shows each perturbation is detected, i.e. this check can fail.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from kvspec.kernels import reference  # noqa: E402

TOL = 1e-10


@dataclass(frozen=True)
class OracleCase:
    seq_lens: tuple[int, ...]
    q_lens: Optional[tuple[int, ...]]  # None: decode
    block_size: int
    num_kv_heads: int
    group: int
    head_dim: int
    softcap: Optional[float] = None
    window: Optional[int] = None
    scale: Optional[float] = None
    null_outside: bool = False  # table entries wholly before the window -> NaN block 0
    seed: int = 0

    def label(self) -> str:
        mode = "decode" if self.q_lens is None else f"extend q={list(self.q_lens)}"
        return (f"{mode} lens={list(self.seq_lens)} bs={self.block_size} kv={self.num_kv_heads}x{self.group} "
                f"d={self.head_dim} softcap={self.softcap} W={self.window} scale={self.scale}"
                f"{' null' if self.null_outside else ''} seed={self.seed}")


def q_lens_of(case: OracleCase) -> tuple[int, ...]:
    return case.q_lens if case.q_lens is not None else tuple(1 for _ in case.seq_lens)


def build(case: OracleCase) -> dict:
    """Float64 paged caches (NaN in every unowned slot), a shuffled table, queries, and
    the table as it was before any entry was nulled (for the dense gather)."""
    g = torch.Generator().manual_seed(case.seed)
    rng = random.Random(case.seed)
    bs, hkv, dim = case.block_size, case.num_kv_heads, case.head_dim
    pages = [-(-n // bs) for n in case.seq_lens]
    num_blocks = 1 + 2 * sum(pages) + 1
    pool = list(range(1, num_blocks))  # block 0 stays NaN: the null block
    rng.shuffle(pool)
    k_cache = torch.full((num_blocks, bs, hkv, dim), float("nan"), dtype=torch.float64)
    v_cache = torch.full_like(k_cache, float("nan"))
    tables = torch.full((len(case.seq_lens), max(pages + [1]) + 1), -1, dtype=torch.int32)
    for i, n in enumerate(case.seq_lens):
        for b in range(pages[i]):
            tables[i, b] = pool.pop()
        for p in range(n):
            blk, off = int(tables[i, p // bs]), p % bs
            k_cache[blk, off] = torch.randn(hkv, dim, generator=g, dtype=torch.float64)
            v_cache[blk, off] = torch.randn(hkv, dim, generator=g, dtype=torch.float64)
    full_tables = tables.clone()
    if case.null_outside and case.window is not None:
        for i, (n, ql) in enumerate(zip(case.seq_lens, q_lens_of(case))):
            first = max(0, n - ql - case.window + 1) if ql else n
            for b in range(pages[i]):
                if (b + 1) * bs <= first:
                    tables[i, b] = 0
    ql = q_lens_of(case)
    cu = None if case.q_lens is None else torch.tensor([0] + [sum(ql[: i + 1]) for i in range(len(ql))],
                                                       dtype=torch.int32)
    q = torch.randn(sum(ql), hkv * case.group, dim, generator=g, dtype=torch.float64) * 2.0
    return {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": tables, "full_tables": full_tables,
            "seq_lens": torch.tensor(case.seq_lens, dtype=torch.int32), "cu": cu}


def dense(cache: "torch.Tensor", table_row: "torch.Tensor", n: int) -> "torch.Tensor":
    """[n, kv_heads, dim], one position at a time through the table."""
    bs = cache.shape[1]
    rows = [cache[int(table_row[p // bs]), p % bs] for p in range(n)]
    return torch.stack(rows) if rows else cache.new_zeros((0, *cache.shape[2:]))


def allowed_mask(n_q: int, n: int, window: Optional[int]) -> "torch.Tensor":
    """[n_q, n] True where query (absolute position n - n_q + i) may see key j."""
    qp = torch.arange(n - n_q, n)[:, None]
    kp = torch.arange(n)[None, :]
    ok = kp <= qp
    if window is not None:
        ok &= kp > qp - window
    return ok


def independent(case: OracleCase, t: dict) -> "torch.Tensor":
    """SDPA (no softcap) or a plain dense softcapped softmax, per sequence."""
    scale = case.scale if case.scale is not None else case.head_dim ** -0.5
    out = torch.zeros_like(t["q"])
    row = 0
    for i, (n, ql) in enumerate(zip(case.seq_lens, q_lens_of(case))):
        if ql == 0:
            continue
        if n == 0:  # an empty sequence attends to nothing: zeros (SDPA would give NaN)
            row += ql
            continue
        k = dense(t["k_cache"], t["full_tables"][i], n).repeat_interleave(case.group, dim=1).transpose(0, 1)
        v = dense(t["v_cache"], t["full_tables"][i], n).repeat_interleave(case.group, dim=1).transpose(0, 1)
        q = t["q"][row:row + ql].transpose(0, 1)  # [H, n_q, D]
        mask = allowed_mask(ql, n, case.window)
        if case.softcap is None:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        else:  # SDPA cannot express a softcap: the same attention, written out here
            s = (q @ k.transpose(-1, -2)) * scale
            s = case.softcap * torch.tanh(s / case.softcap)
            o = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1) @ v
        out[row:row + ql] = o.transpose(0, 1)
        row += ql
    return out


def ref_of(case: OracleCase, t: dict) -> "torch.Tensor":
    return reference.paged_attention(t["q"], t["k_cache"], t["v_cache"], t["block_tables"], t["seq_lens"],
                                     cu_seqlens_q=t["cu"], scale=case.scale, softcap=case.softcap,
                                     sliding_window=case.window)


def error(case: OracleCase) -> float:
    t = build(case)
    ref = ref_of(case, t)
    assert ref.dtype == torch.float64 and ref.shape == t["q"].shape
    diff = (ref - independent(case, t)).abs()
    return float("inf") if not torch.isfinite(diff).all() else (diff.max().item() if diff.numel() else 0.0)


def random_cases(seed: int, count: int) -> list[OracleCase]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        bs = rng.choice([1, 2, 3, 5, 16])
        lens = tuple(rng.choice([0, 1, rng.randint(2, 40), bs * rng.randint(1, 4)]) for _ in range(rng.randint(1, 4)))
        mode = i % 3  # decode, extend over a cached prefix, prefill
        q_lens = None if mode == 0 else tuple(rng.randint(0, n) if mode == 1 else n for n in lens)
        hkv, group = rng.choice([(1, 1), (2, 1), (1, 4), (2, 3), (3, 2), (1, 8)])  # MHA, GQA, MQA
        window = rng.choice([None, None, 1, rng.randint(2, 12), 64])
        out.append(OracleCase(
            seq_lens=lens, q_lens=q_lens, block_size=bs, num_kv_heads=hkv, group=group,
            head_dim=rng.choice([8, 16, 20, 64]), softcap=rng.choice([None, None, 1.5, 30.0]), window=window,
            scale=rng.choice([None, 0.1, 0.7]), null_outside=window is not None and rng.random() < 0.7,
            seed=seed * 1000 + i))
    return out


CASES = random_cases(seed=13, count=60) + [
    OracleCase((0, 5, 0), None, 2, 2, 2, 16, seed=1),  # empty sequences in decode
    OracleCase((0, 9, 4), (0, 3, 4), 3, 1, 4, 16, softcap=2.0, seed=2),  # empty, extend, prefill, MQA
    OracleCase((7, 3), (0, 3), 4, 2, 1, 8, seed=3),  # a sequence with no new token
    OracleCase((40, 33), (6, 33), 1, 2, 2, 16, window=5, null_outside=True, seed=4),  # bs 1, window
    OracleCase((40, 33), None, 4, 1, 3, 16, window=1, null_outside=True, seed=5),  # window 1
    OracleCase((12, 30), (4, 30), 5, 2, 2, 16, window=30, seed=6),  # window >= seq_len
    OracleCase((50,), (9,), 3, 2, 4, 32, softcap=5.0, window=7, null_outside=True, seed=7),  # everything at once
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label())
def test_reference_matches_independent_attention(case):
    err = error(case)
    assert err <= TOL, f"{case.label()}: reference vs independent max error {err:.3g} > {TOL}"


def test_cases_cover_every_feature():
    # The random spread must reach what the docstring promises, or the test proves less.
    assert any(c.q_lens is None for c in CASES) and any(c.q_lens and 0 < min(c.q_lens) for c in CASES)
    assert any(c.q_lens and any(0 < q < n for q, n in zip(c.q_lens, c.seq_lens)) for c in CASES)  # prefix + new
    assert any(c.group > 1 and c.num_kv_heads > 1 for c in CASES) and any(c.num_kv_heads == 1 < c.group for c in CASES)
    assert sum(c.softcap is not None for c in CASES) >= 10 and sum(c.window is not None for c in CASES) >= 10
    assert any(c.softcap is not None and c.window is not None for c in CASES)
    assert sum(c.null_outside for c in CASES) >= 5 and any(0 in c.seq_lens for c in CASES)


def test_empty_sequences_give_exact_zeros():
    case = CASES[-6]  # (0, 9, 4) with q (0, 3, 4)
    t = build(case)
    out = ref_of(case, t)
    assert out.shape == (7, 4, 16) and torch.isfinite(out).all()
    case = CASES[-7]  # decode (0, 5, 0)
    out = ref_of(case, build(case))
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[2], torch.zeros_like(out[2]))
    assert out[1].abs().sum() > 0


def test_null_entries_are_really_there_and_never_read():
    case = CASES[-4]
    t = build(case)
    assert (t["block_tables"] == 0).any() and torch.isnan(t["k_cache"][0]).all()
    assert torch.isfinite(ref_of(case, t)).all()


# --- the check can fail: perturbed references are detected ---------------------------

def _wrap_attention(monkeypatch, change):
    real = reference.attention

    def perturbed(q, k, v, scale, softcap, sliding_window=None):
        return real(*change(q, k, v, scale, softcap, sliding_window))

    monkeypatch.setattr(reference, "attention", perturbed)


PERTURBATIONS = {
    "scale_x1.001": lambda q, k, v, sc, cap, w: (q, k, v, sc * 1.001, cap, w),
    "softcap_dropped": lambda q, k, v, sc, cap, w: (q, k, v, sc, None, w),
    "window_one_wider": lambda q, k, v, sc, cap, w: (q, k, v, sc, cap, None if w is None else w + 1),
    "kv_heads_reversed": lambda q, k, v, sc, cap, w: (q, k.flip(1), v.flip(1), sc, cap, w),
    "causal_shifted_by_one": lambda q, k, v, sc, cap, w: (q, k[:-1], v[:-1], sc, cap, w) if len(k) > len(q)
    else (q, k, v, sc, cap, w),
}


@pytest.mark.parametrize("name", sorted(PERTURBATIONS))
def test_a_perturbed_reference_is_detected(name, monkeypatch):
    clean = max(error(c) for c in CASES[:30])
    assert clean <= TOL
    _wrap_attention(monkeypatch, PERTURBATIONS[name])
    worst = max(error(c) for c in CASES[:30])
    assert worst > 1e-6, f"perturbation {name} went unnoticed (max error {worst:.3g})"

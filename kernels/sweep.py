"""``kvspec kernels``: the paged-attention kernel against the float64 oracle.

A ``KernelCase`` describes one call; ``build_inputs`` turns it into tensors laid out
the way an allocator would leave them: each sequence's blocks drawn at random from a
pool about three times larger than needed, the table padded past the last block with
-1 or 0, and every cache slot no sequence owns (and the tail of each last block)
filled with NaN, so an unmasked read poisons the output. The output tensor is
NaN-poisoned too, so an element the kernel never writes fails. The tests, the kernel
bug corpus and the CLI all run cases through ``run_case``.
"""
from __future__ import annotations

import importlib.util
import itertools
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Optional

DTYPES = ("float32", "float16", "bfloat16")
HEAD_DIMS = (64, 80, 96, 128, 256)
_PATCHED_IDS = itertools.count()


@dataclass(frozen=True)
class KernelCase:
    seq_lens: tuple[int, ...]
    q_lens: Optional[tuple[int, ...]] = None  # None: decode (one query per sequence)
    dtype: str = "float32"
    num_kv_heads: int = 1
    group: int = 1  # query heads per KV head: 1 MHA, >1 GQA; num_kv_heads 1 with group > 1 is MQA
    head_dim: int = 64
    block_size: int = 16
    pad: int = -1  # what the block table holds past a sequence's last block
    softcap: Optional[float] = None
    scale: Optional[float] = None
    num_splits: Optional[int] = None  # None: the kernel's own choice
    q_gain: float = 1.0  # larger -> peakier softmax, so split maxima differ a lot
    seed: int = 0
    device: str = "cpu"

    def label(self) -> str:
        mode = "decode" if self.q_lens is None else f"extend q={list(self.q_lens)}"
        return (f"{mode} lens={list(self.seq_lens)} {self.dtype} kv={self.num_kv_heads}x{self.group} d={self.head_dim} "
                f"bs={self.block_size} pad={self.pad} softcap={self.softcap} splits={self.num_splits} seed={self.seed}")


@dataclass
class CaseResult:
    case: KernelCase
    ok: bool
    err: float
    bound: float
    seconds: float
    error: Optional[str] = None  # the kernel raised
    ref_err: float = math.nan  # error of the same maths in the input dtype (what the bound scales)

    def to_dict(self) -> dict:
        return {"case": self.case.label(), "ok": self.ok, "err": _num(self.err), "bound": self.bound,
                "ref_lowp_err": _num(self.ref_err), "seconds": round(self.seconds, 3),
                **({"error": self.error} if self.error else {})}


def _num(x: float) -> Any:
    """JSON has no inf or NaN: say them as strings."""
    return x if math.isfinite(x) else str(x)


def build_inputs(case: KernelCase) -> dict[str, Any]:
    """Tensors for ``case``: paged caches with NaN traps, a shuffled table, queries."""
    import torch

    dtype = getattr(torch, case.dtype)
    g = torch.Generator().manual_seed(case.seed)
    rng = random.Random(case.seed)
    bs, hkv, dim = case.block_size, case.num_kv_heads, case.head_dim
    pages = [-(-n // bs) for n in case.seq_lens]
    num_blocks = max(3 * sum(pages), 4)
    pool = list(range(num_blocks))
    rng.shuffle(pool)  # non-contiguous, out-of-order blocks
    k_cache = torch.full((num_blocks, bs, hkv, dim), float("nan"), dtype=dtype)
    v_cache = torch.full((num_blocks, bs, hkv, dim), float("nan"), dtype=dtype)
    width = max(pages + [1]) + rng.randint(0, 2)  # padding columns past the longest sequence too
    tables = torch.full((len(case.seq_lens), width), case.pad, dtype=torch.int32)
    for i, n in enumerate(case.seq_lens):
        blocks = [pool.pop() for _ in range(pages[i])]
        tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(n)], dtype=torch.long)
        k_cache.view(-1, hkv, dim)[slots] = torch.randn(n, hkv, dim, generator=g).to(dtype)
        v_cache.view(-1, hkv, dim)[slots] = torch.randn(n, hkv, dim, generator=g).to(dtype)
    if case.q_lens is None:
        total_q, cu = len(case.seq_lens), None
    else:
        total_q = sum(case.q_lens)
        cu = torch.tensor([0] + [sum(case.q_lens[: i + 1]) for i in range(len(case.q_lens))], dtype=torch.int32)
    q = (torch.randn(total_q, hkv * case.group, dim, generator=g) * case.q_gain).to(dtype)
    seq_lens = torch.tensor(case.seq_lens, dtype=torch.int32)
    out = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": tables, "seq_lens": seq_lens, "cu": cu}
    if case.device != "cpu":
        out = {k: (v.to(case.device) if v is not None else None) for k, v in out.items()}
    return out


def default_attention() -> Callable[..., Any]:
    from kvspec.kernels import paged_attention

    return paged_attention


def run_case(case: KernelCase, attention: Optional[Callable[..., Any]] = None) -> CaseResult:
    """Run the kernel (``attention``, default kvspec.kernels) on ``case`` and judge it."""
    import torch

    from kvspec.kernels import reference, tolerance

    attention = attention or default_attention()
    t = build_inputs(case)
    kw = dict(cu_seqlens_q=t["cu"], scale=case.scale, softcap=case.softcap)
    out = torch.full_like(t["q"], float("nan"))  # poison: an unwritten element fails
    start = time.perf_counter()
    try:
        res = attention(t["q"], t["k_cache"], t["v_cache"], t["block_tables"], t["seq_lens"],
                        num_splits=case.num_splits, out=out, **kw)
        if case.device != "cpu":
            torch.cuda.synchronize()
    except Exception as e:  # a kernel that crashes on a valid case is a finding too
        return CaseResult(case, False, math.inf, 0.0, time.perf_counter() - start, f"{type(e).__name__}: {e}")
    seconds = time.perf_counter() - start
    if res is not out or res.dtype != t["q"].dtype:
        return CaseResult(case, False, math.inf, 0.0, seconds, "output is not the given out tensor in q's dtype")
    args = (t["q"], t["k_cache"], t["v_cache"], t["block_tables"], t["seq_lens"])
    ref64 = reference.paged_attention(*args, **kw)
    ref_lowp = reference.paged_attention(*args, **kw, compute_dtype=t["q"].dtype)
    ok, err, allowed = tolerance.check_close(res, ref64, ref_lowp, t["q"].dtype)
    return CaseResult(case, ok, err, allowed, seconds, ref_err=tolerance.max_abs_err(ref_lowp, ref64))


def _lens(rng: random.Random, n: int, bs: int, longest: int) -> tuple[int, ...]:
    """Sequence lengths mixing 0, 1, exact multiples of the block size and ragged ones."""
    kinds = [0, 1, bs * rng.randint(1, max(1, longest // bs)), rng.randint(2, longest)]
    return tuple(rng.choice(kinds) for _ in range(n))


def sweep_cases(seed: int = 0, count: int = 24, large: bool = False, device: str = "cpu") -> list[KernelCase]:
    """A deterministic spread of cases: every dtype, head_dim, both modes, splits, softcap."""
    rng = random.Random(seed)
    longest = 700 if large else 80
    out: list[KernelCase] = []
    for i in range(count):
        bs = rng.choice([1, 3, 5, 16, 12] if not large else [16, 5, 32, 1])
        n = rng.randint(1, 8 if large else 4)
        lens = _lens(rng, n, bs, longest)
        extend = i % 2 == 1
        q_lens = tuple(rng.randint(0, ln) if rng.random() < 0.7 else ln for ln in lens) if extend else None
        hkv = rng.choice([1, 2, 4] if large else [1, 2])
        group = rng.choice([1, 2, 3, 4, 8])
        out.append(KernelCase(
            seq_lens=lens, q_lens=q_lens, dtype=DTYPES[i % 3], num_kv_heads=hkv, group=group,
            head_dim=HEAD_DIMS[i % len(HEAD_DIMS)], block_size=bs, pad=rng.choice([-1, 0]),
            softcap=rng.choice([None, None, 10.0, 2.0]), scale=rng.choice([None, 0.3]),
            num_splits=rng.choice([None, 1, 2, 3, 5]), q_gain=rng.choice([1.0, 4.0]), seed=seed * 1000 + i,
            device=device))
    return out


KERNELS_DIR = Path(__file__).resolve().parent  # this package: the kernels a patch applies to
CORPUS_DIR = Path(importlib.util.find_spec("kvspec.corpus").origin).parent / "kernels"


def load_patched_kernels(diff_text: str, workdir: Path) -> ModuleType:
    """A copy of the kernels package with ``diff_text`` applied, imported under a fresh
    name from ``workdir`` (the installed kernels are never touched).

    Diff paths are relative to the repository root (``kernels/paged_attention.py``).
    The caller removes ``workdir`` and calls ``unload_patched`` when done.
    """
    import importlib.util
    import shutil
    import sys

    from kvspec.patching import PatchError, apply_unified_diff

    name = f"_kvspec_patched_kernels_{next(_PATCHED_IDS)}_{abs(hash(diff_text)) % 10**8}"
    pkg = Path(workdir) / name
    shutil.copytree(KERNELS_DIR, pkg, ignore=shutil.ignore_patterns("__pycache__"))

    def read(rel: str) -> str:
        if not rel.startswith("kernels/"):
            raise FileNotFoundError(rel)
        return (pkg / rel[len("kernels/"):]).read_text()

    for rel, text in apply_unified_diff(diff_text, read).items():
        if not rel.startswith("kernels/"):
            raise PatchError(f"{rel}: a kernel patch may only touch kernels/")
        (pkg / rel[len("kernels/"):]).write_text(text)
    spec = importlib.util.spec_from_file_location(name, pkg / "__init__.py", submodule_search_locations=[str(pkg)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # relative imports inside the package need it registered
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def unload_patched(module: ModuleType) -> None:
    import sys

    for key in [k for k in sys.modules if k == module.__name__ or k.startswith(module.__name__ + ".")]:
        del sys.modules[key]


def summarize(results: list[CaseResult]) -> dict[str, Any]:
    """Per dtype: cases, the largest kernel error, reference error and bound, and the
    worst error/bound ratio (above 1 is a failure)."""
    per: dict[str, dict[str, Any]] = {}
    for r in results:
        d = per.setdefault(r.case.dtype, {"cases": 0, "max_err": 0.0, "max_ref_lowp_err": 0.0, "max_bound": 0.0,
                                          "worst_ratio": 0.0, "passed": True})
        d["cases"] += 1
        d["max_err"] = max(d["max_err"], r.err)
        if not math.isnan(r.ref_err):
            d["max_ref_lowp_err"] = max(d["max_ref_lowp_err"], r.ref_err)
        d["max_bound"] = max(d["max_bound"], r.bound)
        d["worst_ratio"] = max(d["worst_ratio"], r.err / r.bound if r.bound else math.inf)
        d["passed"] = d["passed"] and r.ok
    for d in per.values():
        d["max_err"], d["worst_ratio"] = _num(d["max_err"]), _num(d["worst_ratio"])
    return per


def _benchmark() -> dict[str, Any]:
    """The GPU benchmark script (benchmarks/bench_kernels_gpu.py), when this is a checkout."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_kernels_gpu.py"
    if not path.exists():
        return {"skipped": f"{path} is not here (not a source checkout)"}
    spec = importlib.util.spec_from_file_location("kvspec_bench_kernels_gpu", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.run_benchmark()


def run_sweep(device: str = "cpu", seed: int = 0, count: Optional[int] = None,
              bench: bool = True) -> dict[str, Any]:
    """Run the sweep on ``device``; the result has ``cases``, ``per_dtype`` and ``failures``."""
    import torch

    from kvspec.errors import UsageError

    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"kvspec kernels: --device cuda needs a CUDA GPU, and torch {torch.__version__} sees none "
                         "(use --device cpu for the interpreter run)")
    large = device == "cuda"
    cases = sweep_cases(seed, count or (48 if large else 30), large=large, device=device)
    start = time.perf_counter()
    results = [run_case(c) for c in cases]
    res: dict[str, Any] = {
        "device": device,
        "mode": "compiled" if large else "TRITON_INTERPRET=1 (Triton interpreter)",
        "seed": seed,
        "cases": len(results),
        "seconds": round(time.perf_counter() - start, 2),
        "rule": "max |kernel - float64 oracle| <= 2 x max |same maths in input dtype - oracle| + floor[dtype]",
        "floor": {str(k).replace("torch.", ""): v for k, v in _floors().items()},
        "per_dtype": summarize(results),
        "passed": all(r.ok for r in results),
        "failures": [r.to_dict() for r in results if not r.ok],
    }
    if large and bench:
        res["benchmark"] = _benchmark()
    return res


def sweep_text(res: dict[str, Any]) -> str:
    """The sweep result for a terminal: one line per dtype, then each failing case."""
    lines = [f"kvspec kernels: {res['cases']} cases on {res['device']} ({res['mode']}), seed {res['seed']}, "
             f"{res['seconds']}s",
             f"  rule: {res['rule']}"]
    for dtype, d in res["per_dtype"].items():
        lines.append(f"  {dtype:9} {d['cases']:3} cases  max err {d['max_err']:.3g}  max bound {d['max_bound']:.3g}  "
                     f"worst err/bound {d['worst_ratio']:.2f}  {'ok' if d['passed'] else 'FAILED'}")
    for f in res["failures"]:
        lines.append(f"  FAILED {f}")
    if "benchmark" in res:
        lines.append(f"  benchmark: {res['benchmark']}")
    lines.append(f"verdict: {'pass' if res['passed'] else 'violation'}")
    return "\n".join(lines)


def _floors() -> dict:
    from kvspec.kernels.tolerance import FLOOR

    return FLOOR


__all__ = ["KernelCase", "CaseResult", "build_inputs", "run_case", "sweep_cases", "summarize", "run_sweep", "sweep_text"]


def cmd_kernels(a) -> int:
    """``kvspec kernels``: exit code 1 when a case fails its tolerance."""
    import json

    from kvspec.errors import UsageError

    if a.cases is not None and a.cases < 1:
        raise UsageError("kvspec kernels: --cases must be at least 1")
    res = run_sweep(device=a.device, seed=a.seed, count=a.cases)
    print(json.dumps(res, default=str) if a.json else sweep_text(res))
    return 1 if res.get("failures") else 0

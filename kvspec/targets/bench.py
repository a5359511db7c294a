"""``kvspec bench``: operations per second of one fixed-seed, mixed, pool-level trace
run through a target's public API, with nothing checked.

The trace
---------
A serving-like mix on a pool of ``BENCH_BLOCKS`` blocks, prefix caching on, held at
about 75% occupancy:

* a request arrives: ``Alloc(n)`` with n in 1..8, then ``Cache`` of all its blocks
  (every block of a request is full; most hold new content, some repeat recent
  content, so one hash can name several blocks);
* a request finishes: ``Free`` of all its blocks, tail first (the prefix stays
  cached longest);
* a prefix hit: ``Lookup`` of a recently cached hash and, on a hit, ``Touch`` of the
  block it returned (a new holder, freed later like a request).

Because every block is cached before it is freed, the trace never frees an unhashed
block, so targets that put unhashed blocks first (vLLM) and targets that do not (impl)
follow one and the same eviction order: the trace is the same trace on both.

How it is built so that any target can run it
---------------------------------------------
The reference model plans the trace *symbolically* ("the blocks of request 17"),
which decides every op and keeps the occupancy. A target may hand out other block
ids than the model would, so the plan is then *resolved* on the target itself: one
untimed run on a fresh allocator turns "the blocks of request 17" into the ids that
target really returned (a planned hit that misses there is dropped). The result is a
list of concrete ``kvspec.spec.ops``; the timed runs replay it on fresh allocators and time
nothing but the ``driver.apply(op)`` calls. Targets are deterministic, so the replay
allocates exactly as the resolving run did; the final state is compared to make sure.
"""
from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from kvspec.spec.config import Config
from kvspec.spec.model import PoolModel
from kvspec.spec.ops import Alloc, Cache, Free, Lookup, Op, Touch
from kvspec.targets.base import Driver, Target, TargetError

BENCH_BLOCKS = 1024        # the pool every `kvspec bench` run uses, null block included
# Tokens per block. Only the vllm adapter reads it: it stands for a hash label by a
# block of the label's bytes repeated to fill it, so a block must be at least as long
# as the longest label ("c" + the label number) or labels that share a prefix collide.
BENCH_BLOCK_SIZE = 16
OCCUPANCY = 0.75           # held / usable blocks the trace keeps near
MAX_ALLOC = 8
RUNS = 3                   # timed replays; the median is reported
RECENT_LABELS = 2048       # lookups pick among the most recently cached contents


# -- planning ------------------------------------------------------------------------
# Symbolic ops: ("alloc", k, n) ("cache", k, labels) ("free", k) ("lookup", label, k or None)
Sym = tuple


def plan_trace(num_ops: int, seed: int = 0, num_blocks: int = BENCH_BLOCKS, null_block: bool = True) -> list[Sym]:
    """The symbolic trace: about ``num_ops`` ops, decided with the reference model."""
    from kvspec.targets.base import Traits

    rng = random.Random(seed)
    model = PoolModel(Config(level="pool", num_blocks=num_blocks), Traits(null_block=null_block))
    usable = len(model.usable())
    goal = int(OCCUPANCY * usable)
    live: dict[int, list[int]] = {}   # request -> its blocks in the model (planning only)
    order: list[int] = []             # live requests, oldest first
    recent: list[str] = []
    next_req = next_label = 0
    out: list[Sym] = []
    count = 0  # concrete ops: a request is Alloc + Cache, a hit is Lookup + Touch
    while count < num_ops:
        held = usable - model.free_count()
        r = rng.random()
        if not order or (held < goal and r < 0.55) or (held >= goal and r < 0.25):
            n = min(rng.randint(1, MAX_ALLOC), model.free_count())
            if n == 0:
                continue
            k, next_req = next_req, next_req + 1
            blocks = model.alloc(n)
            labels = []
            for _ in blocks:
                if recent and rng.random() < 0.2:
                    labels.append(rng.choice(recent[-256:]))   # repeated content
                else:
                    labels.append(f"c{next_label}")
                    next_label += 1
            for b, h in zip(blocks, labels):
                model.cache(b, h)
            recent.extend(labels)
            if len(recent) > 2 * RECENT_LABELS:
                del recent[:-RECENT_LABELS]
            live[k] = blocks
            order.append(k)
            out += [("alloc", k, n), ("cache", k, tuple(labels))]
            count += 2
        elif held >= goal or r < 0.8:
            # finish a request: mostly an old one, sometimes any
            i = 0 if rng.random() < 0.5 else rng.randrange(len(order))
            k = order.pop(i)
            model.free(list(reversed(live.pop(k))))
            out.append(("free", k))
            count += 1
        else:
            # a hit: a recently cached content that is still cached (a few tries)
            label, b = "c0", None
            for _ in range(4):
                label = rng.choice(recent[-RECENT_LABELS:]) if recent else "c0"
                b = model.lookup(label)
                if b is not None:
                    break
            if b is None:
                out.append(("lookup", label, None))
                count += 1
                continue
            k, next_req = next_req, next_req + 1
            model.touch([b])
            live[k] = [b]
            order.append(k)
            out.append(("lookup", label, k))
            count += 2
    return out


@dataclass
class Trace:
    ops: list[Op]
    num_blocks: int
    seed: int
    mix: dict[str, int] = field(default_factory=dict)
    dropped_hits: int = 0          # planned hits that missed on this target
    final: Any = None              # the resolving run's final observation


def resolve(target: Target, plan: Sequence[Sym], num_blocks: int = BENCH_BLOCKS, seed: int = 0) -> Trace:
    """Turn the symbolic plan into concrete ops for ``target`` by running it once (untimed)."""
    drv = target.driver(_config(num_blocks))
    blocks_of: dict[int, tuple[int, ...]] = {}
    ops: list[Op] = []
    dropped = 0
    for s in plan:
        kind = s[0]
        if kind == "alloc":
            op: Op = Alloc(s[2])
            got = drv.apply(op)
            blocks_of[s[1]] = tuple(got)
            ops.append(op)
        elif kind == "cache":
            op = Cache(blocks_of[s[1]], s[2])
            drv.apply(op)
            ops.append(op)
        elif kind == "free":
            blocks = blocks_of.pop(s[1], ())
            if blocks:
                op = Free(tuple(reversed(blocks)))
                drv.apply(op)
                ops.append(op)
        else:  # lookup, maybe followed by a touch of what it found
            op = Lookup(s[1])
            b = drv.apply(op)
            ops.append(op)
            if s[2] is not None:
                if b is None:
                    dropped += 1
                    continue
                t = Touch((b,))
                drv.apply(t)
                ops.append(t)
                blocks_of[s[2]] = (b,)
    mix: dict[str, int] = {}
    for op in ops:
        mix[type(op).__name__] = mix.get(type(op).__name__, 0) + 1
    return Trace(ops, num_blocks, seed, mix, dropped, _final(drv))


def _config(num_blocks: int) -> Config:
    return Config(level="pool", num_blocks=num_blocks, block_size=BENCH_BLOCK_SIZE, caching=True)


def _final(drv: Driver) -> Any:
    try:
        return drv.observe()
    except Exception:  # a target without observation still benches
        return None


def build_trace(target: Target, num_ops: int, seed: int = 0, num_blocks: int = BENCH_BLOCKS) -> Trace:
    null = getattr(target.traits, "null_block", True)
    return resolve(target, plan_trace(num_ops, seed, num_blocks, null_block=null), num_blocks, seed)


# -- timing --------------------------------------------------------------------------
def replay_times(target: Target, trace: Trace) -> tuple[float, float]:
    """(wall-clock seconds, CPU seconds of this process) for one replay of ``trace`` on a
    fresh allocator: only the apply calls are timed."""
    drv = target.driver(_config(trace.num_blocks))
    apply = drv.apply
    ops = trace.ops
    c0, t0 = time.process_time(), time.perf_counter()
    for op in ops:
        apply(op)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    if trace.final is not None and _final(drv) != trace.final:
        raise TargetError(f"target {target.name} is not deterministic: replaying the trace ended in another state")
    return wall, cpu


def time_trace(target: Target, trace: Trace, clock=time.perf_counter) -> float:
    """Seconds for one replay of ``trace``: wall clock, or with ``clock=time.process_time``
    this process's CPU time (which other processes on a shared machine do not inflate)."""
    wall, cpu = replay_times(target, trace)
    return cpu if clock is time.process_time else wall


def bench(target: Target, num_ops: int = 200_000, seed: int = 0, num_blocks: int = BENCH_BLOCKS,
          runs: int = RUNS, trace: Optional[Trace] = None) -> dict:
    if "pool" not in target.traits.levels:
        raise TargetError(f"target {target.name} has no pool-level API to bench")
    trace = trace or build_trace(target, num_ops, seed, num_blocks)
    times = [replay_times(target, trace) for _ in range(runs)]
    sec = statistics.median(t[0] for t in times)
    cpu = statistics.median(t[1] for t in times)
    return {
        "target": target.name, "ops": len(trace.ops), "seconds": round(sec, 4),
        "ops_per_second": round(len(trace.ops) / sec, 1) if sec > 0 else None,
        "cpu_seconds": round(cpu, 4), "cpu_ops_per_second": round(len(trace.ops) / cpu, 1) if cpu > 0 else None,
        "num_blocks": num_blocks, "seed": seed, "runs": runs, "occupancy": OCCUPANCY,
        "mix": trace.mix, "dropped_hits": trace.dropped_hits,
    }


def bench_text(r: dict) -> str:
    mix = ", ".join(f"{k} {v}" for k, v in sorted(r["mix"].items()))
    return (f"kvspec bench: target {r['target']}, {r['num_blocks']} blocks, seed {r['seed']}\n"
            f"  {r['ops']} ops ({mix})\n"
            f"  {r['ops_per_second']:,.0f} ops/s (median of {r['runs']} runs, {r['seconds']:.3f}s each, nothing checked)"
            + (f"\n  {r['cpu_ops_per_second']:,.0f} ops per CPU second of this process"
               if r.get("cpu_ops_per_second") else ""))


def cmd_bench(args) -> int:
    from kvspec.errors import UsageError
    from kvspec.targets.registry import load_target

    if args.ops <= 0:
        raise UsageError("kvspec bench: --ops must be positive")
    target = load_target(args.target, patch=getattr(args, "patch", None), api=getattr(args, "api", None))
    r = bench(target, args.ops, args.seed, getattr(args, "blocks", None) or BENCH_BLOCKS)
    r["target"] = args.target
    print(json.dumps(r) if args.json else bench_text(r))
    return 0

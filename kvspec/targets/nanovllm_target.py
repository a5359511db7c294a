"""Adapter for nano-vllm-style block managers (``nanovllm[:PACKAGE]``, and user classes
with that API): a ``BlockManager`` driven through ``Sequence`` objects.

Loading. ``PACKAGE.engine.block_manager`` and ``PACKAGE.engine.sequence`` are imported
by their real names without running ``PACKAGE/__init__.py`` (which pulls in torch and
transformers): for the import, lightweight stub modules stand in for ``PACKAGE`` and
``PACKAGE.engine``, with ``__path__`` set to the real directories; they are removed
again afterwards, so a later ``import PACKAGE`` runs the real ``__init__``. A patch is
applied to temporary copies and served under the real names for one import window by
a meta-path finder (``import_overlay``); the installed files are never written.

Driving (cache level only: nano-vllm has no pool-level API). The driver plays
nano-vllm's own scheduler (``engine/scheduler.py``): prefill = ``can_allocate`` then
``allocate`` (the hit is ``seq.num_cached_tokens``); decode = ``append_token`` then
``can_append`` / ``may_append``; preemption and finish = ``deallocate`` (also of a
waiting request, which holds nothing: a no-op); re-admission allocates again with
every token. Sequences get the manager's ``block_size`` (an instance attribute: the
class default is 256). The manager is built as ``BlockManager(num_blocks, block_size)``,
or by a user's factory with that convention (``user_target``). For the model checker
the driver forks itself (``snapshot``/``restore``, deep copies), never by pickling.
Two API generations are detected:

- boolean (nano-vllm 2025, nano-vllm-fork): ``can_allocate(seq) -> bool``, ``allocate(seq)``
  hashes full blocks itself, ``may_append`` hashes a block when it fills;
- counted (later nano-vllm): ``can_allocate(seq)`` returns the number of cached blocks
  or -1, ``allocate(seq, n)``, and the scheduler calls ``hash_blocks(seq)`` after each
  step with ``seq.num_scheduled_tokens`` set.

Observation. nano-vllm's state is a ``free_block_ids`` deque, a ``used_block_ids`` set
and a ``hash_to_block_id`` dict that may keep entries for blocks since reused (lookups
check the block's ``token_ids``). It is normalized so the generic invariants mean the
same as for vLLM: ``queue`` is ``free_block_ids`` in order; a block's hash is reported
while it is held, or while it is free and the dict can still hit it (otherwise nothing
can ever hit it: it is not cached); the index holds the dict entries the manager's own
lookup would accept, and nothing of the adapter's own (a held block whose entry a later
duplicate replaced is absent, as in the dict: ``Traits.index_latest_wins`` allows that).
"""
from __future__ import annotations

import copy
import inspect
from typing import Any, Callable, Optional

from kvspec.spec.config import Config
from kvspec.spec.observation import BlockState, Observation, RequestState
from kvspec.spec.ops import Admit, Finish, Op, Preempt, Step
from kvspec.targets.base import Driver, Target, TargetError, Traits
from kvspec.targets.nano_loader import load_nano
from kvspec.targets.nano_sequence import sequence_factory

BOOLEAN, COUNTED = "boolean", "counted"  # the two can_allocate/allocate generations
NANO_METHODS = ("can_allocate", "allocate", "deallocate", "can_append", "may_append")


# -- API detection ---------------------------------------------------------------------
def _positional(fn) -> int:
    """Positional parameters of a method, ``self`` excluded."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 1
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in kinds for p in params) - 1


def missing_nano_methods(cls: type) -> list[str]:
    return [m for m in NANO_METHODS if not callable(getattr(cls, m, None))]


def detect_nano_api(cls: type) -> str:
    """BOOLEAN or COUNTED (see the module doc); raises TargetError for neither."""
    missing = missing_nano_methods(cls)
    if missing:
        raise TargetError(f"{cls.__name__} lacks the nano-vllm BlockManager methods {', '.join(missing)}")
    n = _positional(cls.allocate)
    if n >= 2 and callable(getattr(cls, "hash_blocks", None)):
        return COUNTED
    if n == 1:
        return BOOLEAN
    raise TargetError(f"{cls.__name__}.allocate takes {n} arguments: expected allocate(seq) "
                      f"or allocate(seq, num_cached_blocks) with hash_blocks(seq)")


# -- the driver ------------------------------------------------------------------------
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# What the observation reads off a manager and its blocks (nano-vllm's own names).
MANAGER_FIELDS = ("blocks", "free_block_ids", "used_block_ids", "hash_to_block_id")
BLOCK_FIELDS = ("ref_count", "hash", "token_ids")


def missing_internals(mgr: Any) -> list[str]:
    """The nano-vllm internals the observation needs that ``mgr`` does not have."""
    out = [f for f in MANAGER_FIELDS if not hasattr(mgr, f)]
    blocks = getattr(mgr, "blocks", None)
    if not out:
        try:
            first = blocks[0]
        except (TypeError, IndexError, KeyError):
            return ["blocks (a list of Block objects)"]
        out += [f"Block.{f}" for f in BLOCK_FIELDS if not hasattr(first, f)]
    return out


class NanoDriver(Driver):
    """Plays nano-vllm's scheduler on one manager (see the module doc).

    ``make(num_blocks, block_size)`` builds the manager: the class itself, or a user's
    factory with the same convention."""

    def __init__(self, manager_cls: type, seq_cls: type, api: str, config: Config,
                 make: Optional[Callable[..., Any]] = None) -> None:
        if config.level != "cache":
            raise TargetError("nano-vllm-style managers have no pool-level API: use --level cache")
        if not config.caching:
            raise TargetError("nano-vllm-style managers always cache prefixes: caching=False is not supported")
        self.mgr = (make or manager_cls)(config.num_blocks, config.block_size)
        bs = getattr(self.mgr, "block_size", config.block_size)
        self.bs = bs if isinstance(bs, int) and bs > 0 else config.block_size  # the Sequences follow the manager
        self.seq_cls = seq_cls
        self.make_seq = sequence_factory(seq_cls)  # by the constructor's signature
        self.seq_count = 0
        self.counted = api == COUNTED
        self.hash_blocks_args = _positional(manager_cls.hash_blocks) if self.counted else 0
        self.seqs: dict[str, Any] = {}
        self.running: set[str] = set()
        # Decode tokens not yet fed to the Sequence: a refused step leaves its token here,
        # where nano-vllm's scheduler would have preempted (the model keeps it waiting).
        self.pending: dict[str, list[int]] = {}
        self.content: dict[Any, tuple[int, ...]] = {}  # hash -> the block tokens it was computed for

    # -- forking, for the model checker ------------------------------------------------------
    # A manager and its Sequences are plain Python objects: a deep copy is a faithful,
    # independent state. Not pickling: unpickling a class by its module name would run
    # ``PACKAGE/__init__.py`` (torch, transformers). And not ``copy.deepcopy`` of a
    # Sequence as is: nano-vllm's ``Sequence.__getstate__`` is meant for sending a
    # sequence to a worker and drops ``token_ids`` once it has decoded a token, so the
    # Sequences are copied attribute by attribute.
    def snapshot(self) -> dict:
        return _clone_state(self.__dict__)

    def restore(self, snap: dict) -> "NanoDriver":
        d = object.__new__(type(self))
        d.__dict__.update(_clone_state(snap))
        return d

    # -- Sequence handling ---------------------------------------------------------------
    def new_seq(self, tokens) -> Any:
        """A Sequence of the package's own class. Failing to build one is kvspec's adapter
        failing (TargetError), never a finding against the manager."""
        self.seq_count += 1
        try:
            seq = self.make_seq(list(tokens), self.bs, self.seq_count)
        except Exception as e:
            if not tokens:  # the package refusing an empty prompt is its own rejection (misuse)
                self.seq_count -= 1
                raise
            raise TargetError(f"kvspec could not build a {self.seq_cls.__module__}.{self.seq_cls.__name__} for "
                              f"tokens {list(tokens)} with block_size {self.bs}: {type(e).__name__}: {e}") from None
        try:  # an instance attribute, so drivers of different block sizes can coexist
            seq.block_size = self.bs
        except AttributeError:
            pass
        if seq.num_blocks != cdiv(len(seq), self.bs):  # a class that reads Sequence.block_size
            type(seq).block_size = self.bs
        return seq

    @staticmethod
    def pop_token(seq: Any) -> None:
        """Undo append_token on nano-vllm's Sequence (or one with the same fields)."""
        if callable(getattr(seq, "pop_token", None)):
            seq.pop_token()
            return
        seq.token_ids.pop()
        if isinstance(vars(seq).get("num_tokens"), int):
            seq.num_tokens -= 1
        if "last_token" in vars(seq):
            seq.last_token = seq.token_ids[-1]

    def _computed(self, seq: Any, n: int) -> None:
        """What the counted generation's scheduler does after a forward of n tokens."""
        seq.num_scheduled_tokens = n
        if self.hash_blocks_args >= 2:
            self.mgr.hash_blocks(seq, n)
        else:
            self.mgr.hash_blocks(seq)
        seq.num_cached_tokens += n
        seq.num_scheduled_tokens = 0

    # -- ops -------------------------------------------------------------------------------
    def apply(self, op: Op) -> Any:
        m = self.mgr
        if isinstance(op, Admit):
            if op.prompt is not None:
                if op.req in self.seqs:
                    raise ValueError(f"request {op.req} already exists")
                self.seqs[op.req] = self.new_seq(op.prompt)
            elif op.req not in self.seqs or op.req in self.running:
                raise ValueError(f"no waiting request {op.req}")
            seq = self.seqs[op.req]
            if self.counted:
                n = m.can_allocate(seq)
                if n is None or n is False or n < 0:
                    return None
                m.allocate(seq, n)
                hit = seq.num_cached_tokens
                self._computed(seq, len(seq) - hit)
            else:
                if not m.can_allocate(seq):
                    return None
                m.allocate(seq)
                hit = seq.num_cached_tokens
            self.running.add(op.req)
            return hit
        if isinstance(op, Step):
            if op.req not in self.running:
                raise ValueError(f"request {op.req} is not running")
            seq, pend = self.seqs[op.req], self.pending.setdefault(op.req, [])
            pend.append(op.token)
            if len(pend) > 1:  # after a refusal: all of them or none, as the model decides
                if cdiv(len(seq) + len(pend), self.bs) - len(seq.block_table) > len(m.free_block_ids):
                    return False
            while pend:
                seq.append_token(pend[0])
                if not m.can_append(seq):
                    self.pop_token(seq)
                    return False
                pend.pop(0)
                m.may_append(seq)
                if self.counted:
                    self._computed(seq, 1)
            return True
        if isinstance(op, (Preempt, Finish)):
            # The scheduler's preempt and finish are both deallocate. A waiting request
            # holds no blocks, and an unknown one gets an empty Sequence: nano-vllm's
            # deallocate of either is a no-op (a documented one, see the traits).
            seq = self.seqs.get(op.req)
            m.deallocate(seq if seq is not None else self.new_seq([0]))
            self.running.discard(op.req)
            if seq is not None:
                for t in self.pending.pop(op.req, []):
                    seq.append_token(t)  # a preempted request waits with every token it has
            if isinstance(op, Finish):
                self.seqs.pop(op.req, None)
            return None
        raise TypeError(f"{op!r} is not a cache-level op")

    # -- observation -------------------------------------------------------------------------
    def observe(self) -> Observation:
        try:
            return self._observe()
        except AttributeError as e:  # a field the observation reads is missing: kvspec cannot read the state
            raise TargetError(f"kvspec could not read {type(self.mgr).__name__}'s state: {e}") from None

    def _observe(self) -> Observation:
        m = self.mgr
        blocks, n = m.blocks, len(m.blocks)
        free = list(m.free_block_ids)
        free_set, used = set(free), set(m.used_block_ids)
        problems = [f"block {b} is in both free_block_ids and used_block_ids" if b in free_set else
                    f"block {b} is in neither free_block_ids nor used_block_ids"
                    for b in range(n) if (b in free_set) == (b in used)]
        problems += [f"free_block_ids holds {b}, which is not a block id" for b in free_set
                     if not (type(b) is int and 0 <= b < n)]
        for blk in blocks:  # a hash stands for one content: remember it while the block shows it
            if _has_hash(blk.hash) and len(blk.token_ids) == self.bs:
                self.content.setdefault(blk.hash, tuple(blk.token_ids))
        table = m.hash_to_block_id

        def hittable(h, b) -> bool:  # what allocate's lookup accepts: the block's tokens match
            return type(b) is int and 0 <= b < n and (blocks[b].hash == h  # still the block it names
                                                      or self.content.get(h) == tuple(blocks[b].token_ids))

        states, index = [], {}
        for b, blk in enumerate(blocks):
            h = blk.hash if _has_hash(blk.hash) else None
            if h is not None and blk.ref_count == 0 and not (table.get(h) == b and hittable(h, b)):
                h = None  # free and unreachable: nothing can hit it, so it is not cached
            states.append(BlockState(blk.ref_count, h, b in free_set))
        for h, b in table.items():  # the manager's own index and nothing else (a held block whose
            if hittable(h, b):         # entry a duplicate took is allowed by Traits.index_latest_wins)
                index.setdefault(h, []).append(b)
        reqs = {rid: RequestState(tuple(self.seqs[rid].block_table), len(self.seqs[rid]))
                for rid in sorted(self.running)}
        return Observation(blocks=tuple(states), queue=tuple(free), index={h: tuple(v) for h, v in index.items()},
                           free_count=len(free), null_block=None, requests=reqs, queue_problems=tuple(problems))


def _clone_state(state: dict) -> dict:
    memo: dict = {}
    for seq in state["seqs"].values():
        if hasattr(seq, "__dict__") and id(seq) not in memo:
            c = object.__new__(type(seq))
            memo[id(seq)] = c
            c.__dict__.update(copy.deepcopy(vars(seq), memo))
    return copy.deepcopy(state, memo)


def _has_hash(h: Any) -> bool:
    return h is not None and h != -1


# -- target ----------------------------------------------------------------------------
# nano-vllm's policies where a package declares nothing (kvspec.targets.policies has the
# declarations of released derivatives): vLLM's, except that the manager has no null block
# and always caches, and that the boolean can_allocate generation counts every block.
def nano_defaults(api: str) -> dict[str, Any]:
    from kvspec.targets.policies import VLLM_DEFAULTS
    return {**VLLM_DEFAULTS, "null_block": None, "prefix_caching": "on", "admit_all_blocks": api == BOOLEAN}


def nano_traits(manager_cls: type, seq_cls: type, api: str, make: Optional[Callable[..., Any]] = None,
                **policies: Any) -> Traits:
    """What the nano-vllm API itself fixes, with ``policies`` (declared) on top:

    - no null block; prefix caching always on (the manager has no switch);
    - misuse is met with ``assert`` at best: no documented defence (robustness findings);
    - deallocating a Sequence that holds nothing is a no-op (``free_unknown_request``);
    - one block per hash in ``hash_to_block_id``, the latest cached wins;
    - block size at least 2: block boundaries are found with ``len(seq) % block_size == 1``,
      which never holds for block size 1 (nano-vllm's Config asks multiples of 256).

    Freed blocks go to the tail of ``free_block_ids`` (``append``), a request's tail first
    (``reversed(seq.block_table)``): "lru_tail_first", the default order. Admission
    counting and eviction on free are policies a package declares; they are never probed."""
    fixed: dict[str, Any] = dict(null_block=False, unhashed_free_first=False, misuse_errors=(), levels=("cache",),
                                 documented_noops=frozenset({"free_unknown_request"}), index_latest_wins=True,
                                 min_block_size=2, prefix_caching="on")
    return Traits(**{**fixed, **policies})


def check_nano_policies(traits: Traits, where: str) -> Traits:
    """The declared policies the nano-vllm API can be checked under, else UsageError."""
    from kvspec.errors import UsageError
    if traits.null_block:
        raise UsageError(f"{where}: a nano-vllm BlockManager has no null block: declare null_block = \"none\"")
    if traits.prefix_caching != "on":
        raise UsageError(f"{where}: a nano-vllm BlockManager always caches prefixes: declare prefix_caching = \"on\"")
    return traits


def declared_nano_traits(manager_cls: type, seq_cls: type, api: str, name: str, source: Any = None,
                         defaults_name: str = "vLLM's") -> Traits:
    """``nano_traits`` with the policies the manager's package declares (see
    ``kvspec.targets.policies.declared_traits``); nano-vllm's defaults otherwise."""
    from kvspec.targets.policies import declared_traits
    defaults = nano_defaults(api)
    if defaults_name == "vLLM's":
        defaults["admit_all_blocks"] = False  # a user class: vLLM's admission
    t = declared_traits(nano_traits(manager_cls, seq_cls, api), cls=manager_cls, source=source, name=name,
                        defaults=defaults, defaults_name=defaults_name)
    return check_nano_policies(t, name)


class NanoTarget(Target):
    """Any nano-vllm-style (BlockManager, Sequence) pair; ``traits`` from the unpatched pair.

    ``make(num_blocks, block_size)`` builds a manager (default: ``manager_cls`` itself)."""

    def __init__(self, manager_cls: type, seq_cls: type, name: str, traits: Optional[Traits] = None,
                 make: Optional[Callable[..., Any]] = None) -> None:
        self.manager_cls, self.seq_cls, self.name, self.make = manager_cls, seq_cls, name, make
        self.api = detect_nano_api(manager_cls)
        # Declared policies only (kvspec.targets.policies); without a declaration, vLLM's.
        self.traits = traits if traits is not None else nano_traits(manager_cls, seq_cls, self.api, make)

    def driver(self, config: Config) -> Driver:
        return NanoDriver(self.manager_cls, self.seq_cls, self.api, config, self.make)

    def check_internals(self) -> None:
        """Raise TargetError (one line) unless a manager shows what the observation reads."""
        try:
            d = self.driver(Config(level="cache", num_blocks=4, block_size=2))
        except TargetError:
            raise
        except Exception as e:
            raise TargetError(f"cannot build {self.manager_cls.__name__}(num_blocks, block_size): "
                              f"{type(e).__name__}: {e}") from None
        missing = missing_internals(d.mgr)
        if missing:
            raise TargetError(f"{self.manager_cls.__name__} has the nano-vllm BlockManager methods but not the "
                              f"internals kvspec observes: {', '.join(missing)}")
        d.new_seq([1, 2, 3])  # TargetError naming what kvspec could not build

    def describe(self) -> str:
        t = self.traits
        return (f"{self.name} ({self.api} can_allocate; admission counts "
                f"{'every block' if t.admit_all_blocks else 'new blocks only'}; freed blocks "
                f"{'leave the cache' if t.free_evicts else 'stay cached until reused'})")


class NanoVllmTarget(NanoTarget):
    def __init__(self, package: str = "nanovllm", patch_text: Optional[str] = None,
                 patch_name: Optional[str] = None) -> None:
        base_bm, base_seq = load_nano(package)
        try:
            api = detect_nano_api(base_bm)
        except TargetError as e:
            raise TargetError(f"target nanovllm:{package}: {e}") from None
        name = "nanovllm" if package == "nanovllm" else f"nanovllm:{package}"
        # The release's declared policies (kvspec's table of released derivatives, a class
        # attribute or [tool.kvspec]), never a probe of its code; a patch keeps them.
        traits = declared_nano_traits(base_bm, base_seq, api, name, source=_source_file(base_bm),
                                      defaults_name="nano-vllm's")
        bm, seq = (base_bm, base_seq) if patch_text is None else load_nano(package, patch_text)
        try:
            super().__init__(bm, seq, f"{name}+{patch_name}" if patch_name else name, traits)
            self.check_internals()
        except TargetError as e:
            raise TargetError(f"target {name}" + (f" with patch {patch_name}" if patch_name else "") + f": {e}") from None
        self.package = package


def _source_file(cls: type) -> Any:
    import sys
    from pathlib import Path
    f = getattr(sys.modules.get(cls.__module__), "__file__", None)
    return Path(f) if f else None

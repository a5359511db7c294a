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
every token. The manager is built as ``BlockManager(num_blocks, block_size)`` (plus
``enable_prefix_caching=`` where the constructor has that switch), or by a user's factory
with that convention (``user_target``). For the model checker the driver forks itself
(``snapshot``/``restore``, deep copies), never by pickling. Three API generations are
detected from the signatures, counting only parameters without a default (``NANO_CALLS``
is the exact call table, per generation, that the load-time contract check reads):

- boolean (nano-vllm 2025, nano-vllm-fork): ``can_allocate(seq) -> bool``, ``allocate(seq)``
  hashes full blocks itself, ``may_append`` hashes a block when it fills;
- counted (later nano-vllm): ``can_allocate(seq)`` returns the number of cached blocks
  or -1, ``allocate(seq, n)``, and the scheduler calls ``hash_blocks(seq)`` (or
  ``hash_block``) after each step with ``seq.num_scheduled_tokens`` set;
- chunked (chunked-prefill forks): ``can_allocate(seq, num_tokens)`` (a bool, or the number
  of cached blocks, -1 or False when refused) and ``allocate(seq, num_tokens)`` (or
  ``allocate(seq, num_cached_blocks, num_tokens)``) grow the block table to hold
  ``seq.num_cached_tokens + num_tokens`` tokens. An admission first asks
  ``can_allocate(seq, <the whole uncomputed prompt>)`` (kvspec's admission is all or
  nothing), then prefills chunk by chunk, one block of tokens per chunk: ``allocate``,
  the forward (``hash_blocks`` where the manager has it, then ``num_cached_tokens +=
  chunk``), as the fork's scheduler does; each later chunk asks ``can_allocate(seq, chunk)``
  first, and a chunk refused after the whole prompt was admitted is preempted
  (``deallocate``) and the admission reported refused. The hit is ``num_cached_tokens``
  after the first ``allocate``. Decode uses ``can_append``/``may_append`` where the
  manager has them, else ``can_allocate(seq, 1)``/``allocate(seq, 1)``.

Names, hooks, protocol. kvspec's names resolve through ``kvspec.targets.names`` (a
declared name map, else conservative aliases); ``kvspec_observe`` replaces reading the
internals; declared extra protocol calls (``after_allocate``, ``after_prefill_chunk``,
``after_append``, ``before_deallocate``) are made at those points.

Block size. The manager is built with the run's block size. A manager that insists on its
own (its constructor raises AssertionError or ValueError, or it keeps another
``block_size``) is built with the class's own: the constructor's default, else the
package Sequence's class attribute ``block_size``, else a ``Config`` default in the
manager's module (``kvcache_block_size``). The machines' requests are then scaled to it:
each token of the run's block of B tokens stands for a run of about R/B copies of itself
in the manager's block of R tokens (block boundaries, partial blocks and refusals map
one to one), and the observation maps lengths back. Repros keep the run's block size.

Prefix caching. A manager without an index (no ``hash_to_block_id``, no block hash) is
checked with prefix caching off; one whose constructor has an ``enable_prefix_caching``
(or ``enable_caching``) switch, with both; any other with it on.

Observation. nano-vllm's state is a ``free_block_ids`` deque, a ``used_block_ids`` set
and a ``hash_to_block_id`` dict that may keep entries for blocks since reused (lookups
check the block's ``token_ids``). It is normalized so the generic invariants mean the
same as for vLLM: ``queue`` is ``free_block_ids`` in order (also a list, an OrderedDict of
ids, or a lazily cleaned deque with a companion set: ``names.read_free_list``); a block's
hash is reported while it is held, or while it is free and the dict can still hit it
(otherwise nothing can ever hit it: it is not cached); the index holds the dict entries
the manager's own lookup would accept, and nothing of the adapter's own (a held block
whose entry a later duplicate replaced is absent, as in the dict:
``Traits.index_latest_wins`` allows that). ``used_block_ids`` is optional.
"""
from __future__ import annotations

import bisect
import copy
import dataclasses
import inspect
import sys
from typing import Any, Callable, NamedTuple, Optional

from kvspec.errors import UsageError
from kvspec.spec.config import Config
from kvspec.spec.observation import BlockState, Observation, RequestState
from kvspec.spec.ops import Admit, Finish, Op, Preempt, Step
from kvspec.targets.base import Driver, Target, TargetError, Traits
from kvspec.targets.names import OBSERVE_HOOK, Names, companion_set, load_names, read_free_list, read_protocol
from kvspec.targets.nano_loader import load_nano
from kvspec.targets.nano_sequence import sequence_factory

BOOLEAN, COUNTED, CHUNKED = "boolean", "counted", "chunked"  # the can_allocate/allocate generations
NANO_METHODS = ("can_allocate", "allocate", "deallocate", "can_append", "may_append")
CACHING_SWITCHES = ("enable_prefix_caching", "enable_caching", "prefix_caching")


class NanoCall(NamedTuple):
    """One call the nano driver makes: ``method(*args)``, what it must return, and whether a
    manager of that generation must have it (else an alternative in the same row's note)."""
    method: str
    args: tuple[str, ...]
    returns: str
    required: bool = True
    note: str = ""


# The exact call forms the driver makes, per generation (kvspec.targets.contract checks the
# signatures against them at load; ``kvspec api nanovllm`` prints them). ``seq`` is a
# Sequence; the other arguments are ints, always passed positionally.
_COMMON = (
    NanoCall("deallocate", ("seq",), "None"),
    NanoCall("can_append", ("seq",), "bool: a decode token fits (called after seq.append_token)"),
    NanoCall("may_append", ("seq",), "None: a block for the new token if it opens one"),
)
NANO_CALLS: dict[str, tuple[NanoCall, ...]] = {
    BOOLEAN: (
        NanoCall("can_allocate", ("seq",), "bool: the prompt fits"),
        NanoCall("allocate", ("seq",), "None; sets seq.block_table and seq.num_cached_tokens (the hit)"),
    ) + _COMMON,
    COUNTED: (
        NanoCall("can_allocate", ("seq",), "int: cached blocks, or -1 when the prompt does not fit"),
        NanoCall("allocate", ("seq", "num_cached_blocks"), "None; sets seq.block_table, seq.num_cached_tokens"),
        NanoCall("hash_blocks", ("seq",), "None; hashes the blocks the step filled (seq.num_scheduled_tokens)",
                 note="or hash_blocks(seq, num_tokens); spelled hash_block also"),
    ) + _COMMON,
    CHUNKED: (
        NanoCall("can_allocate", ("seq", "num_tokens"), "bool, or int cached blocks; False or -1: refused"),
        NanoCall("allocate", ("seq", "num_tokens"), "None; table holds seq.num_cached_tokens + num_tokens",
                 note="or allocate(seq, num_cached_blocks, num_tokens)"),
        NanoCall("hash_blocks", ("seq",), "None", required=False, note="called after each forward if present"),
        NanoCall("deallocate", ("seq",), "None"),
        NanoCall("can_append", ("seq",), "bool", required=False,
                 note="without can_append/may_append decode is can_allocate(seq, 1) / allocate(seq, 1)"),
        NanoCall("may_append", ("seq",), "None", required=False),
    ),
}

NANO_GENERATIONS: dict[str, str] = {
    BOOLEAN: "can_allocate(seq) -> bool and allocate(seq) (nano-vllm 2025, nano-vllm-fork)",
    COUNTED: "can_allocate(seq) -> cached blocks or -1, allocate(seq, num_cached_blocks), hash_blocks after "
             "each forward (later nano-vllm)",
    CHUNKED: "can_allocate(seq, num_tokens) and allocate(seq, num_tokens): prefill in chunks of one block of "
             "tokens (chunked-prefill forks)",
}


# -- API detection ---------------------------------------------------------------------
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _params(fn) -> Optional[list[inspect.Parameter]]:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    return params[1:] if params and params[0].name in ("self", "cls") else params


def _positional(fn) -> int:
    """Positional parameters of a method, ``self`` excluded."""
    params = _params(fn)
    return 1 if params is None else sum(p.kind in _POSITIONAL for p in params)


def _required(fn) -> int:
    """Positional parameters without a default, ``self`` excluded (``allocate(seq, plan=None)``
    takes one)."""
    params = _params(fn)
    return 1 if params is None else sum(p.kind in _POSITIONAL and p.default is p.empty for p in params)


def _method(cls: type, names: Optional[Names], name: str) -> Any:
    attr = (names or Names()).resolve(cls, name)
    fn = getattr(cls, attr, None) if attr else None
    return fn if callable(fn) else None


def missing_nano_methods(cls: type, names: Optional[Names] = None) -> list[str]:
    """The nano-vllm methods ``cls`` lacks (by kvspec's names, through ``names``); a chunked
    manager may do without can_append/may_append."""
    missing = [m for m in NANO_METHODS if _method(cls, names, m) is None]
    ca = _method(cls, names, "can_allocate")
    if ca is not None and _required(ca) >= 2:
        missing = [m for m in missing if m not in ("can_append", "may_append")]
    return missing


def detect_nano_api(cls: type, names: Optional[Names] = None) -> str:
    """BOOLEAN, COUNTED or CHUNKED (see the module doc); raises TargetError for none."""
    missing = missing_nano_methods(cls, names)
    if missing:
        raise TargetError(f"{cls.__name__} lacks the nano-vllm BlockManager methods {', '.join(missing)}")
    nc, n = _required(_method(cls, names, "can_allocate")), _required(_method(cls, names, "allocate"))
    if nc >= 2 and n in (2, 3):
        return CHUNKED
    if nc == 1 and n == 2 and _method(cls, names, "hash_blocks") is not None:
        return COUNTED
    if nc == 1 and n == 1:
        return BOOLEAN
    raise TargetError(f"{cls.__name__}: can_allocate takes {nc} and allocate takes {n} required arguments: expected "
                      f"can_allocate(seq) with allocate(seq), or with allocate(seq, num_cached_blocks) and "
                      f"hash_blocks(seq), or the chunked can_allocate(seq, num_tokens) with allocate(seq, num_tokens)")


# -- building a manager ------------------------------------------------------------------
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def caching_switch(cls: type) -> Optional[str]:
    """The constructor's prefix-caching switch parameter, if it has one."""
    params = _params(cls.__init__) if isinstance(cls, type) else _params(cls)
    return next((p.name for p in params or () if p.name in CACHING_SWITCHES), None)


def own_block_size(cls: type, seq_cls: Optional[type] = None) -> Optional[int]:
    """The block size the class insists on, where it states one (see the module doc)."""
    for p in _params(cls.__init__) or ():
        if p.name in ("block_size", "kvcache_block_size") and isinstance(p.default, int) and p.default > 0:
            return p.default
    from kvspec.targets.nano_sequence import Sequence as OwnSequence
    bs = getattr(seq_cls, "block_size", None) if seq_cls is not None and seq_cls is not OwnSequence else None
    if isinstance(bs, int) and not isinstance(bs, bool) and bs > 0:
        return bs
    cfg = getattr(sys.modules.get(cls.__module__), "Config", None)
    for attr in ("kvcache_block_size", "block_size"):
        v = getattr(cfg, attr, None) if isinstance(cfg, type) else None
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def build_manager(cls: type, make: Optional[Callable[..., Any]], num_blocks: int, block_size: int,
                  caching: bool, seq_cls: Optional[type] = None) -> Any:
    """``(make or cls)(num_blocks, block_size[, enable_prefix_caching=caching])``; where the
    constructor refuses ``block_size`` (AssertionError, ValueError), with the class's own."""
    build = make or cls
    switch = caching_switch(build if make is not None else cls)
    kw = {switch: caching} if switch else {}
    try:
        return build(num_blocks, block_size, **kw)
    except (AssertionError, ValueError):
        own = own_block_size(cls, seq_cls)
        if own is None or own == block_size:
            raise
        return build(num_blocks, own, **kw)


class Scale:
    """Lengths between the run's block size B and the manager's R >= B: position p of a
    block of B stands for ``copies[p]`` tokens (together R), so blocks map to blocks."""

    def __init__(self, run_bs: int, real_bs: int) -> None:
        base, extra = divmod(real_bs, run_bs)
        self.B, self.R = run_bs, real_bs
        self.copies = [base + (p < extra) for p in range(run_bs)]
        self.starts = [sum(self.copies[:p]) for p in range(run_bs + 1)]
        self.identity = run_bs == real_bs

    def expand(self, tokens, start: int = 0) -> list:
        """The manager's tokens for the run's ``tokens`` placed from run position ``start``."""
        if self.identity:
            return list(tokens)
        return [t for i, t in enumerate(tokens, start) for _ in range(self.copies[i % self.B])]

    def to_real(self, n: int) -> int:
        q, r = divmod(n, self.B)
        return q * self.R + self.starts[r]

    def to_run(self, n: int) -> int:
        if self.identity:
            return n
        q, r = divmod(n, self.R)
        return q * self.B + bisect.bisect_right(self.starts, r) - 1


# -- the driver ------------------------------------------------------------------------
# What the observation reads off a manager and its blocks (nano-vllm's own names).
MANAGER_FIELDS = ("blocks", "free_block_ids", "used_block_ids", "hash_to_block_id")
BLOCK_FIELDS = ("ref_count", "hash", "token_ids")


def has_index(mgr: Any, names: Optional[Names] = None) -> bool:
    """Whether the manager may cache prefixes: it has the observation hook, an index, or
    blocks with a hash. Only a manager with none of them is taken as not caching (one
    with hashed blocks but no index kvspec can find is refused by ``missing_internals``,
    never silently checked with caching off)."""
    names = names or Names()
    if callable(getattr(mgr, OBSERVE_HOOK, None)) or names.has(mgr, "hash_to_block_id"):
        return True
    try:
        first = names.get(mgr, "blocks")[0]
    except (AttributeError, TypeError, IndexError, KeyError):
        return True  # missing_internals names what is wrong
    return names.has(first, "hash")


def missing_internals(mgr: Any, names: Optional[Names] = None, caching: bool = True) -> list[str]:
    """The nano-vllm internals the observation needs that ``mgr`` does not have."""
    names = names or Names()
    if callable(getattr(mgr, OBSERVE_HOOK, None)):
        return []
    fields = ("blocks", "free_block_ids") + (("hash_to_block_id",) if caching else ())
    out = [f for f in fields if not names.has(mgr, f)]
    if not out:
        try:
            first = names.get(mgr, "blocks")[0]
        except (TypeError, IndexError, KeyError):
            return ["blocks (a list of Block objects)"]
        block_fields = BLOCK_FIELDS if caching else ("ref_count",)
        out += [f"Block.{f}" for f in block_fields if not names.has(first, f)]
    return out


class NanoDriver(Driver):
    """Plays nano-vllm's scheduler on one manager (see the module doc).

    ``make(num_blocks, block_size)`` builds the manager: the class itself, or a user's
    factory with the same convention."""

    def __init__(self, manager_cls: type, seq_cls: type, api: str, config: Config,
                 make: Optional[Callable[..., Any]] = None, names: Optional[Names] = None,
                 protocol: Optional[dict] = None, caching_support: str = "on") -> None:
        if config.level != "cache":
            raise TargetError("nano-vllm-style managers have no pool-level API: use --level cache")
        if caching_support == "on" and not config.caching:
            raise TargetError("this nano-vllm-style manager always caches prefixes: caching=False is not supported")
        if caching_support == "off" and config.caching:
            raise TargetError("this nano-vllm-style manager has no prefix index: caching=True is not supported")
        self.names = names or Names()
        self.protocol = dict(protocol or {})
        self.caching = config.caching
        self.mgr = build_manager(manager_cls, make, config.num_blocks, config.block_size, config.caching, seq_cls)
        bs = self.names.get(self.mgr, "block_size", config.block_size)
        self.bs = bs if isinstance(bs, int) and not isinstance(bs, bool) and bs > 0 else config.block_size
        if self.bs < config.block_size:
            raise TargetError(f"{manager_cls.__name__} keeps block size {self.bs}, smaller than the run's "
                              f"{config.block_size}: run with --block-size {self.bs} or less")
        self.scale = Scale(config.block_size, self.bs)  # the Sequences follow the manager
        self.seq_cls = seq_cls
        self.make_seq = sequence_factory(seq_cls)  # by the constructor's signature
        self.seq_count = 0
        self.api = api
        self.counted = api == COUNTED
        self.chunked = api == CHUNKED
        wanted = NANO_METHODS + (("hash_blocks",) if api in (COUNTED, CHUNKED) else ())
        self.meth = {m: self.names.resolve(manager_cls, m) for m in wanted}
        self.meth.setdefault("hash_blocks", None)
        hb = self.meth["hash_blocks"]
        self.hash_blocks_args = _positional(getattr(manager_cls, hb)) if hb else 0
        self.alloc_args = _required(getattr(manager_cls, self.meth["allocate"]))
        self.hook = callable(getattr(self.mgr, OBSERVE_HOOK, None))
        self.seqs: dict[str, Any] = {}
        self.running: set[str] = set()
        # Decode tokens not yet fed to the Sequence: a refused step leaves its token here,
        # where nano-vllm's scheduler would have preempted (the model keeps it waiting).
        self.pending: dict[str, list[int]] = {}
        self.content: dict[Any, tuple[int, ...]] = {}  # hash -> the block tokens it was computed for
        self.prefix_of: dict[Any, tuple[int, ...]] = {}  # hash -> the tokens up to its block's end
        self.probed: dict[tuple, bool] = {}  # (hash, block, the block's hash and tokens) -> the lookup hits it

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

    # -- calls -------------------------------------------------------------------------------
    def call(self, name: str, *args: Any) -> Any:
        return getattr(self.mgr, self.meth[name])(*args)

    def _hook(self, point: str, seq: Any) -> None:
        for m in self.protocol.get(point, ()):
            getattr(self.mgr, m)(seq)

    def _seq_get(self, seq: Any, name: str) -> Any:
        return self.names.get(seq, name)

    def _seq_set(self, seq: Any, name: str, value: Any) -> None:
        self.names.set(seq, name, value)

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
                              f"tokens {list(tokens)[:8]}{'...' if len(tokens) > 8 else ''} with block_size "
                              f"{self.bs}: {type(e).__name__}: {e}") from None
        try:  # an instance attribute, so drivers of different block sizes can coexist
            seq.block_size = self.bs
        except AttributeError:
            pass
        if seq.num_blocks != cdiv(len(seq), self.bs):  # a class that reads Sequence.block_size
            type(seq).block_size = self.bs
        return seq

    def append(self, seq: Any, token: int) -> None:
        self._seq_get(seq, "append_token")(token)

    def pop_token(self, seq: Any) -> None:
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
        """What the counted and chunked generations' scheduler does after a forward of n tokens."""
        if n <= 0:
            return
        self._seq_set(seq, "num_scheduled_tokens", n)
        if self.meth["hash_blocks"] and self.caching:
            if self.hash_blocks_args >= 2:
                self.call("hash_blocks", seq, n)
            else:
                self.call("hash_blocks", seq)
        self._seq_set(seq, "num_cached_tokens", self._seq_get(seq, "num_cached_tokens") + n)
        self._seq_set(seq, "num_scheduled_tokens", 0)

    @staticmethod
    def _refused(answer: Any) -> bool:
        return answer is None or answer is False or (isinstance(answer, int) and not isinstance(answer, bool)
                                                      and answer < 0)

    def _chunk_alloc(self, seq: Any, answer: Any, n: int) -> None:
        if self.alloc_args >= 3:
            cached = answer if isinstance(answer, int) and not isinstance(answer, bool) else 0
            self.call("allocate", seq, cached, n)
        else:
            self.call("allocate", seq, n)
        self._hook("after_allocate", seq)

    def _admit_chunked(self, seq: Any) -> Optional[int]:
        cached = lambda: self._seq_get(seq, "num_cached_tokens")  # noqa: E731
        answer = self.call("can_allocate", seq, len(seq) - cached())
        if self._refused(answer):
            return None
        self._chunk_alloc(seq, answer, min(self.bs, len(seq) - cached()))
        hit = cached()
        first = True
        while cached() < len(seq):
            n = min(self.bs, len(seq) - cached())
            if not first:
                answer = self.call("can_allocate", seq, n)
                if self._refused(answer):  # refused mid-prefill: the scheduler preempts it
                    self._hook("before_deallocate", seq)
                    self.call("deallocate", seq)
                    return None
                self._chunk_alloc(seq, answer, n)
            first = False
            self._computed(seq, n)
            self._hook("after_prefill_chunk", seq)
        return hit

    # -- ops -------------------------------------------------------------------------------
    def apply(self, op: Op) -> Any:
        if isinstance(op, Admit):
            if op.prompt is not None:
                if op.req in self.seqs:
                    raise ValueError(f"request {op.req} already exists")
                self.seqs[op.req] = self.new_seq(self.scale.expand(op.prompt))
            elif op.req not in self.seqs or op.req in self.running:
                raise ValueError(f"no waiting request {op.req}")
            seq = self.seqs[op.req]
            if self.chunked:
                hit = self._admit_chunked(seq)
                if hit is None:
                    return None
            elif self.counted:
                n = self.call("can_allocate", seq)
                if self._refused(n):
                    return None
                self.call("allocate", seq, n)
                self._hook("after_allocate", seq)
                hit = self._seq_get(seq, "num_cached_tokens")
                self._computed(seq, len(seq) - hit)
                self._hook("after_prefill_chunk", seq)
            else:
                if not self.call("can_allocate", seq):
                    return None
                self.call("allocate", seq)
                self._hook("after_allocate", seq)
                hit = self._seq_get(seq, "num_cached_tokens")
                self._hook("after_prefill_chunk", seq)
            self.running.add(op.req)
            return self.scale.to_run(hit)
        if isinstance(op, Step):
            if op.req not in self.running:
                raise ValueError(f"request {op.req} is not running")
            seq, pend = self.seqs[op.req], self.pending.setdefault(op.req, [])
            pend.append(op.token)
            table = self._seq_get(seq, "block_table")
            if len(pend) > 1:  # after a refusal: all of them or none, as the model decides
                need = cdiv(self.scale.to_real(self.scale.to_run(len(seq)) + len(pend)), self.bs) - len(table)
                if need > self._free_count():
                    return False
            while pend:
                pos = self.scale.to_run(len(seq))
                for i, t in enumerate(self.scale.expand(pend[:1], pos)):
                    if not self._decode_one(seq, t):
                        if i:  # only a run's first copy can open a block: a later refusal is the manager's
                            raise AssertionError(f"{type(self.mgr).__name__} refused a decode token inside a block")
                        return False
                pend.pop(0)
            return True
        if isinstance(op, (Preempt, Finish)):
            # The scheduler's preempt and finish are both deallocate. A waiting request
            # holds no blocks, and an unknown one gets an empty Sequence: nano-vllm's
            # deallocate of either is a no-op (a documented one, see the traits).
            seq = self.seqs.get(op.req)
            target = seq if seq is not None else self.new_seq(self.scale.expand([0]))
            self._hook("before_deallocate", target)
            self.call("deallocate", target)
            self.running.discard(op.req)
            if seq is not None:
                for t in self.pending.pop(op.req, []):  # a preempted request waits with every token it has
                    for c in self.scale.expand([t], self.scale.to_run(len(seq))):
                        self.append(seq, c)
            if isinstance(op, Finish):
                self.seqs.pop(op.req, None)
            return None
        raise TypeError(f"{op!r} is not a cache-level op")

    def _decode_one(self, seq: Any, token: int) -> bool:
        """One decode token of the manager's: False (and undone) when refused."""
        self.append(seq, token)
        if self.meth["can_append"] and self.meth["may_append"]:
            if not self.call("can_append", seq):
                self.pop_token(seq)
                return False
            self.call("may_append", seq)
        else:  # chunked without can_append/may_append: a one-token chunk
            answer = self.call("can_allocate", seq, 1)
            if self._refused(answer):
                self.pop_token(seq)
                return False
            self._chunk_alloc(seq, answer, 1)
        if self.counted or self.chunked:
            self._computed(seq, 1)
        self._hook("after_append", seq)
        return True

    # -- observation -------------------------------------------------------------------------
    def _free_list(self) -> tuple[list, list[str]]:
        m = self.mgr
        attr = self.names.resolve(m, "free_block_ids")
        free = getattr(m, attr)
        return read_free_list(free, companion_set(m, attr, self.names))

    def _free_count(self) -> int:
        if self.hook:
            return len(getattr(self.mgr, OBSERVE_HOOK)()["free"])
        return len(self._free_list()[0])

    def observe(self) -> Observation:
        try:
            return self._observe_hook() if self.hook else self._observe()
        except (AttributeError, TypeError, KeyError) as e:  # kvspec cannot read the state
            raise TargetError(f"kvspec could not read {type(self.mgr).__name__}'s state: {e}") from None

    def _requests(self) -> dict:
        return {rid: RequestState(tuple(self._seq_get(self.seqs[rid], "block_table")),
                                  self.scale.to_run(len(self.seqs[rid])))
                for rid in sorted(self.running)}

    def _observe(self) -> Observation:
        m, nm = self.mgr, self.names
        blocks = nm.get(m, "blocks")
        n = len(blocks)
        free, problems = self._free_list()
        free_set = set(free)
        if nm.has(m, "used_block_ids"):
            used = set(nm.get(m, "used_block_ids"))
            problems += [f"block {b} is in both free_block_ids and used_block_ids" if b in free_set else
                         f"block {b} is in neither free_block_ids nor used_block_ids"
                         for b in range(n) if (b in free_set) == (b in used)]
        problems += [f"free_block_ids holds {b}, which is not a block id" for b in free_set
                     if not (type(b) is int and 0 <= b < n)]
        if len(free) != len(free_set):
            problems.append("free_block_ids holds a block more than once")
        f_ref = nm.resolve(blocks[0], "ref_count") if n else "ref_count"
        if not self.caching:
            states = [BlockState(getattr(blk, f_ref), None, b in free_set) for b, blk in enumerate(blocks)]
            return Observation(blocks=tuple(states), queue=tuple(free), index={}, free_count=len(free),
                               null_block=None, requests=self._requests(), queue_problems=tuple(problems))
        f_hash, f_tok = (nm.resolve(blocks[0], "hash"), nm.resolve(blocks[0], "token_ids")) if n else ("", "")
        hashes = [getattr(blk, f_hash) for blk in blocks]
        toks = [getattr(blk, f_tok) for blk in blocks]
        for h, t in zip(hashes, toks):  # a hash stands for one content: remember it while the block shows it
            if _has_hash(h) and len(t) == self.bs:
                self.content.setdefault(h, tuple(t))
        table = nm.get(m, "hash_to_block_id")

        for rid in self.running:  # the prefix each held hash was computed for (probing stale entries)
            seq = self.seqs[rid]
            seq_tokens = getattr(seq, "token_ids", None)
            if seq_tokens is None:
                continue
            for i, b in enumerate(self._seq_get(seq, "block_table")):
                h = hashes[b] if type(b) is int and 0 <= b < n else None
                if _has_hash(h) and h not in self.prefix_of and (i + 1) * self.bs <= len(seq_tokens):
                    self.prefix_of[h] = tuple(seq_tokens[:(i + 1) * self.bs])

        def hittable(h, b) -> bool:  # what allocate's lookup accepts: the block's tokens match,
            if not (type(b) is int and 0 <= b < n):  # or the manager's own lookup takes it anyway
                return False
            if hashes[b] == h:
                return True
            if h in self.prefix_of:  # the manager's own lookup says
                return self._lookup_takes(h, b, hashes[b], toks[b])
            return self.content.get(h) == tuple(toks[b])  # no prefix to ask with: nano-vllm's token check

        states, index = [], {}
        for b, blk in enumerate(blocks):
            h = hashes[b] if _has_hash(hashes[b]) else None
            ref = getattr(blk, f_ref)
            if h is not None and ref == 0 and not (table.get(h) == b and hittable(h, b)):
                h = None  # free and unreachable: nothing can hit it, so it is not cached
            states.append(BlockState(ref, h, b in free_set))
        for h, b in table.items():  # the manager's own index and nothing else (a held block whose
            if hittable(h, b):         # entry a duplicate took is allowed by Traits.index_latest_wins)
                index.setdefault(h, []).append(b)
        return Observation(blocks=tuple(states), queue=tuple(free), index={h: tuple(v) for h, v in index.items()},
                           free_count=len(free), null_block=None, requests=self._requests(),
                           queue_problems=tuple(problems))

    def _lookup_takes(self, h: Any, b: int, now: Any, tokens: Any) -> bool:
        """Whether the manager's own lookup hits block ``b`` for the prefix that hash ``h``
        was computed for, though ``b`` now holds something else (a stale entry): asked of a
        deep copy of the manager, admitting that prefix plus one token. A manager whose
        lookup compares the block's tokens (nano-vllm) refuses it, and the entry is left
        out as unreachable; one whose lookup does not would hand out wrong KV, and the
        entry is observed (INDEX_CONSISTENT). Unknown (no recorded prefix, a refusal or an
        error before the lookup): left out. Remembered per (entry, block content)."""
        prefix = self.prefix_of.get(h)
        if prefix is None:
            return False
        try:
            key = (h, b, now, tuple(tokens))
        except TypeError:
            return False
        if key in self.probed:
            return self.probed[key]
        found = self._probe_lookup(prefix, b)
        if found is not None:  # a refusal says nothing: asked again later
            self.probed[key] = found
        return bool(found)

    def _probe_lookup(self, prefix: tuple, b: int) -> Optional[bool]:
        i = len(prefix) // self.bs - 1
        try:
            mgr = copy.deepcopy(self.mgr)
            seq = self.make_seq(list(prefix) + [prefix[-1]], self.bs, 0)
            try:
                seq.block_size = self.bs
            except AttributeError:
                pass
        except Exception:
            return None
        alloc = getattr(mgr, self.meth["allocate"])
        ask = getattr(mgr, self.meth["can_allocate"])
        try:
            if self.chunked:
                answer = ask(seq, len(seq))
                if self._refused(answer):
                    return None
                if self.alloc_args >= 3:
                    alloc(seq, answer if type(answer) is int else 0, self.bs)
                else:
                    alloc(seq, self.bs)
            elif self.counted:
                answer = ask(seq)
                if self._refused(answer):
                    return None
                alloc(seq, answer)
            else:
                alloc(seq)  # the boolean generation looks up inside allocate: capacity aside
        except Exception:
            pass  # a lookup done before the failure still shows in the table
        try:
            table = list(self._seq_get(seq, "block_table"))
            cached = self._seq_get(seq, "num_cached_tokens")
        except AttributeError:
            return False
        return len(table) > i and table[i] == b and isinstance(cached, int) and cached >= (i + 1) * self.bs

    def _observe_hook(self) -> Observation:
        """The state as the manager's ``kvspec_observe`` reports it (kvspec.targets.names)."""
        d = getattr(self.mgr, OBSERVE_HOOK)()
        rows, free = list(d["blocks"]), list(d["free"])
        n, free_set = len(rows), set(free)
        problems = [f"kvspec_observe's free list holds {b}, which is not a block id" for b in free
                    if not (type(b) is int and 0 <= b < n)]
        if len(free) != len(free_set):
            problems.append("kvspec_observe's free list holds a block more than once")
        raw = d.get("index") or {}
        index = {h: tuple(v) if isinstance(v, (list, tuple, set, frozenset)) else (v,) for h, v in raw.items()}
        states = []
        for b, (ref, h, _tokens) in enumerate(rows):
            h = h if _has_hash(h) and self.caching else None
            if h is not None and ref == 0 and b not in index.get(h, ()):
                h = None  # free and unreachable: not cached
            states.append(BlockState(ref, h, b in free_set))
        return Observation(blocks=tuple(states), queue=tuple(free), index=index if self.caching else {},
                           free_count=len(free), null_block=None, requests=self._requests(),
                           queue_problems=tuple(problems))


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
def nano_defaults(api: str, caching: str = "on") -> dict[str, Any]:
    from kvspec.targets.policies import VLLM_DEFAULTS
    return {**VLLM_DEFAULTS, "null_block": None, "prefix_caching": caching, "admit_all_blocks": api == BOOLEAN}


def caching_support(manager_cls: type, seq_cls: Optional[type] = None, make: Optional[Callable[..., Any]] = None,
                    names: Optional[Names] = None) -> str:
    """"off" (no prefix index), "both" (an index and a constructor switch) or "on"."""
    switch = caching_switch(make if make is not None else manager_cls)
    try:
        probe = build_manager(manager_cls, make, 4, 2, True, seq_cls)
    except Exception:
        return "both" if switch else "on"  # the load's own checks say what is wrong
    if not has_index(probe, names):
        return "off"
    return "both" if switch else "on"


def nano_traits(manager_cls: type, seq_cls: type, api: str, make: Optional[Callable[..., Any]] = None,
                **policies: Any) -> Traits:
    """What the nano-vllm API itself fixes, with ``policies`` (declared) on top:

    - no null block; prefix caching as the manager supports it (``caching_support``);
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
                                 min_block_size=2, prefix_caching=caching_support(
                                     manager_cls, seq_cls, make, load_names(manager_cls, _source_file(manager_cls))))
    return Traits(**{**fixed, **policies})


def check_nano_policies(traits: Traits, where: str, supported: str = "on") -> Traits:
    """The declared policies the nano-vllm API can be checked under, else UsageError."""
    if traits.null_block:
        raise UsageError(f"{where}: a nano-vllm BlockManager has no null block: declare null_block = \"none\"")
    ok = {"on": ("on",), "off": ("off",), "both": ("on", "off", "both")}[supported]
    if traits.prefix_caching not in ok:
        what = {"on": "always caches prefixes", "off": "has no prefix index (hash_to_block_id, Block.hash)",
                "both": ""}[supported]
        raise UsageError(f"{where}: this nano-vllm BlockManager {what}: declare prefix_caching = \"{supported}\"")
    return traits


def declared_nano_traits(manager_cls: type, seq_cls: type, api: str, name: str, source: Any = None,
                         defaults_name: str = "vLLM's", make: Optional[Callable[..., Any]] = None) -> Traits:
    """``nano_traits`` with the policies the manager's package declares (see
    ``kvspec.targets.policies.declared_traits``); nano-vllm's defaults otherwise."""
    from kvspec.targets.policies import declared_traits
    names = load_names(manager_cls, source)
    supported = caching_support(manager_cls, seq_cls, make, names)
    defaults = nano_defaults(api, supported)
    if defaults_name == "vLLM's":
        defaults["admit_all_blocks"] = False  # a user class: vLLM's admission
    t = declared_traits(nano_traits(manager_cls, seq_cls, api, make), cls=manager_cls, source=source, name=name,
                        defaults=defaults, defaults_name=defaults_name)
    return check_nano_policies(t, name, supported)


class NanoTarget(Target):
    """Any nano-vllm-style (BlockManager, Sequence) pair; ``traits`` from the unpatched pair.

    ``make(num_blocks, block_size)`` builds a manager (default: ``manager_cls`` itself);
    ``source`` is the file whose nearest pyproject.toml may hold ``[tool.kvspec.names]``
    and ``[tool.kvspec.protocol]`` (default: the class's module file)."""

    def __init__(self, manager_cls: type, seq_cls: type, name: str, traits: Optional[Traits] = None,
                 make: Optional[Callable[..., Any]] = None, source: Any = None) -> None:
        self.manager_cls, self.seq_cls, self.name, self.make = manager_cls, seq_cls, name, make
        self.source = source if source is not None else _source_file(manager_cls)
        self.names = load_names(manager_cls, self.source)
        self.protocol, _ = read_protocol(manager_cls, self.source)
        self.api = detect_nano_api(manager_cls, self.names)
        self.caching_support = caching_support(manager_cls, seq_cls, make, self.names)
        # Declared policies only (kvspec.targets.policies); without a declaration, vLLM's.
        self.traits = traits if traits is not None else nano_traits(manager_cls, seq_cls, self.api, make)
        if self.caching_support == "off" and self.traits.prefix_caching != "off":
            # A manager without an index cannot cache, whatever defaults were applied.
            self.traits = dataclasses.replace(self.traits, prefix_caching="off")

    def driver(self, config: Config) -> Driver:
        return NanoDriver(self.manager_cls, self.seq_cls, self.api, config, self.make, self.names, self.protocol,
                          self.caching_support)

    def check_internals(self) -> None:
        """Raise TargetError (one line) unless a manager shows what the observation reads."""
        caching = self.traits.caching_modes[0]
        try:
            d = self.driver(Config(level="cache", num_blocks=4, block_size=2, caching=caching))
        except (TargetError, UsageError):
            raise
        except Exception as e:
            raise TargetError(f"cannot build {self.manager_cls.__name__}(num_blocks, block_size): "
                              f"{type(e).__name__}: {e or '(no message)'}") from None
        missing = missing_internals(d.mgr, self.names, caching)
        if missing:
            raise TargetError(f"{self.manager_cls.__name__} has the nano-vllm BlockManager methods but not the "
                              f"internals kvspec observes: {', '.join(missing)} (declare other names in "
                              f"[tool.kvspec.names], or define kvspec_observe: kvspec.targets.names)")
        try:
            d._free_list() if not d.hook else None
        except TypeError as e:
            raise TargetError(f"{self.manager_cls.__name__}: {e}") from None
        seq = d.new_seq(d.scale.expand([1, 2, 3]))  # TargetError naming what kvspec could not build
        if not d.names.has(seq, "append_token"):
            raise TargetError(f"{self.seq_cls.__name__} has no append_token (nor append): declare its name in "
                              f"[tool.kvspec.names]")

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
            super().__init__(bm, seq, f"{name}+{patch_name}" if patch_name else name, traits,
                             source=_source_file(base_bm))
            self.check_internals()
        except TargetError as e:
            raise TargetError(f"target {name}" + (f" with patch {patch_name}" if patch_name else "") + f": {e}") from None
        self.package = package


def _source_file(cls: type) -> Any:
    from pathlib import Path
    f = getattr(sys.modules.get(cls.__module__), "__file__", None)
    return Path(f) if f else None

"""The nano-vllm driver: plays nano-vllm's scheduler on one manager and reads its state
back into an Observation (the rules are in ``nanovllm_target``'s docstring). Split from
the target so each file has one job: ``nano_api`` (generations, calls, building), this
driver, and ``nanovllm_target`` (traits and targets). It is longer than 450 lines
because one driver plays the scheduler of four API generations (prefill, chunks,
decode, refusals) and reads the same manager back: both halves share its state."""
from __future__ import annotations

import dataclasses

import copy
from collections import deque
from enum import Enum
from types import BuiltinFunctionType, FunctionType, MethodType, ModuleType
from typing import Any, Callable, Optional

from kvspec.spec.config import Config
from kvspec.spec.observation import BlockState, Observation, RequestState
from kvspec.spec.ops import Admit, Finish, Op, Preempt, Step
from kvspec.targets.base import Driver, TargetError
from kvspec.targets.names import OBSERVE_HOOK, Names, companion_set, free_next_end, read_free_list
from kvspec.targets.nano_sequence import sequence_factory, table_ids

BOOLEAN, COUNTED, CHUNKED = "boolean", "counted", "chunked"  # the can_allocate/allocate generations
from kvspec.targets.nano_api import (CHUNKED, COUNTED, LAYOUT, NANO_METHODS, Scale, _positional, _required,
                                     build_manager, cdiv, free_tiers, tier_ids)

# -- the driver ------------------------------------------------------------------------
# What the observation reads off a manager and its blocks (nano-vllm's own names).
MANAGER_FIELDS = ("blocks", "free_block_ids", "used_block_ids", "hash_to_block_id")
BLOCK_FIELDS = ("ref_count", "hash", "token_ids")


def has_index(mgr: Any, names: Optional[Names] = None) -> bool:
    """Whether the manager may cache prefixes: it has an index, or blocks with a hash. Only
    a manager with neither is taken as not caching (one with hashed blocks but no index
    kvspec can find is refused by ``missing_internals``, never silently checked with
    caching off). An observation hook alone says nothing either way: such a manager
    caches where its declaration says so (``nanovllm_target.caching_support``)."""
    names = names or Names()
    if names.has(mgr, "hash_to_block_id"):
        return True
    try:
        first = names.get(mgr, "blocks")[0]
    except (AttributeError, TypeError, IndexError, KeyError):
        # missing_internals names what is wrong; behind a hook, the blocks are its own business
        return not callable(getattr(mgr, OBSERVE_HOOK, None))
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

    free_order = ""  # the declared free order (set by the target): a list under "mru" is a stack

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
        self.layout = api == LAYOUT
        wanted = NANO_METHODS + (("hash_blocks",) if api in (COUNTED, CHUNKED) else ()) + (
            ("get_token_layout",) if self.layout else ())
        self.meth = {m: self.names.resolve(manager_cls, m) for m in wanted}
        self.meth.setdefault("hash_blocks", None)
        hb = self.meth["hash_blocks"]
        self.hash_blocks_args = _positional(getattr(manager_cls, hb)) if hb else 0
        self.alloc_args = _required(getattr(manager_cls, self.meth["allocate"]))
        self.hook = callable(getattr(self.mgr, OBSERVE_HOOK, None))
        from kvspec.targets.nano_fork import fork_method
        # copy-on-write probed after each admission and step (kvspec.targets.nano_fork)
        self.fork_name = fork_method(manager_cls) if self.hook and self.chunked else None
        self.fork_found: list = []
        free_attr = self.names.resolve(self.mgr, "free_block_ids") if not self.hook else None
        self.tiers = free_tiers(manager_cls, free_attr) if free_attr else ()  # freed cached blocks kept apart
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
        value = self.names.get(seq, name)
        if name == "block_table":
            return table_ids(value)
        return value

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

    def _layout_forward(self, seq: Any) -> None:
        """What the layout generation's scheduler does after a forward (its postprocess):
        the step's new tokens become cached."""
        self._seq_set(seq, "num_cached_tokens",
                      self._seq_get(seq, "num_cached_tokens") + self._seq_get(seq, "num_new_tokens"))
        self._seq_set(seq, "num_new_tokens", 0)

    def _admit_layout(self, seq: Any) -> Optional[int]:
        """The layout generation's admission, as its scheduler makes it (the whole prompt:
        its Config's chunked_prefill is off by default): ``get_token_layout(seq)`` gives
        (hit in held blocks, hit in free cached blocks, new tokens); ``can_allocate(hit in
        free + new)``; ``seq.num_new_tokens = new``; ``allocate(seq)``; the scheduler then
        asserts that the hit allocate took is the layout's, and after the forward the new
        tokens are cached."""
        layout = self.call("get_token_layout", seq)
        try:
            in_used, in_free, new = (int(x) for x in layout)
        except (TypeError, ValueError):
            raise TargetError(f"{type(self.mgr).__name__}.get_token_layout(seq) returned {layout!r}: kvspec expects "
                              f"(tokens hit in held blocks, tokens hit in free cached blocks, new tokens)") from None
        if self._refused(self.call("can_allocate", in_free + new)):
            return None
        self._seq_set(seq, "num_new_tokens", new)
        self.call("allocate", seq)
        self._hook("after_allocate", seq)
        hit = self._seq_get(seq, "num_cached_tokens")
        if hit != in_used + in_free:  # the package's scheduler asserts the same after allocate
            raise AssertionError(f"allocate cached {hit} tokens where get_token_layout counted {in_used + in_free}")
        self._layout_forward(seq)
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
            if self.layout:
                hit = self._admit_layout(seq)
                if hit is None:
                    return None
            elif self.chunked:
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
            if self.fork_name:
                from kvspec.targets.nano_fork import probe_fork
                probe_fork(self, seq)
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
            if self.fork_name:
                from kvspec.targets.nano_fork import probe_fork
                probe_fork(self, seq)
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
            if isinstance(op, Preempt) and seq is not None:
                # where the Sequence has a reset for recompute, the package's scheduler (not the
                # manager) drops the computed count on preemption (Mini-vLLM's
                # reset_for_recompute: num_computed_tokens = 0; its status change is the
                # scheduler's bookkeeping, not kvspec's)
                if any(callable(getattr(seq, n, None)) for n in ("reset_for_recompute", "reset_state_for_recompute")):
                    self._seq_set(seq, "num_cached_tokens", 0)
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
        if self.layout:  # the scheduler's running phase: the tokens not yet computed (one, in decode)
            n = len(seq) - self._seq_get(seq, "num_cached_tokens")
            if not self.call("can_append", seq, n):
                self.pop_token(seq)
                return False
            self._seq_set(seq, "num_new_tokens", n)
            self.call("may_append", seq)
            self._layout_forward(seq)
            self._hook("after_append", seq)
            return True
        if self.meth["can_append"] and self.meth["may_append"]:
            if not self.call("can_append", seq):
                self.pop_token(seq)
                return False
            self.call("may_append", seq)
        else:  # chunked without can_append/may_append: a one-token chunk
            if not self._decode_alloc(seq):
                self.pop_token(seq)
                return False
        if self.counted or self.chunked:
            self._computed(seq, 1)
        self._hook("after_append", seq)
        return True

    def _decode_alloc(self, seq: Any) -> bool:
        """A chunked manager's decode without can_append/may_append: a one-token chunk."""
        answer = self.call("can_allocate", seq, 1)
        if self._refused(answer):
            return False
        self._chunk_alloc(seq, answer, 1)
        return True

    # -- observation -------------------------------------------------------------------------
    def _free_list(self) -> tuple[list, list[str]]:
        m = self.mgr
        attr = self.names.resolve(m, "free_block_ids")
        free = getattr(m, attr)
        queue, problems = read_free_list(free, companion_set(m, attr, self.names),
                                         next_end=free_next_end(free, self.names, self.free_order))
        if self.tiers:  # the manager's other free pools, reused after its free list (nano_api.free_tiers)
            n = len(self.names.get(m, "blocks"))
            for tier in self.tiers:
                queue += tier_ids(getattr(m, tier), n)
        return queue, problems

    def _free_count(self) -> int:
        if self.hook:
            return len(getattr(self.mgr, OBSERVE_HOOK)()["free"])
        return len(self._free_list()[0])

    def observe(self) -> Observation:
        try:
            obs = self._observe_hook() if self.hook else self._observe()
            return dataclasses.replace(obs, found=tuple(self.fork_found)) if self.fork_found else obs
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
            if self.layout:
                used, in_free, new = getattr(mgr, self.meth["get_token_layout"])(seq)
                self._seq_set(seq, "num_new_tokens", new)
                alloc(seq)  # capacity aside, as for the boolean generation
            elif self.chunked:
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
        count = d.get("free_count", len(free))  # the count the manager reports, where the hook gives one
        return Observation(blocks=tuple(states), queue=tuple(free), index=index if self.caching else {},
                           free_count=count, null_block=None, requests=self._requests(),
                           queue_problems=tuple(problems))


# The driver's fields that never change after __init__: shared by every clone, not copied.
_FIXED = frozenset({"names", "protocol", "caching", "bs", "scale", "seq_cls", "make_seq", "api", "counted",
                    "chunked", "layout", "tiers", "meth", "hash_blocks_args", "alloc_args", "hook"})
_ATOMS = frozenset({int, float, str, bytes, bool, type(None), complex, range})  # immutable: shared
_SHARED_KINDS = (type, FunctionType, BuiltinFunctionType, ModuleType, MethodType, Enum)  # not state: shared


def _clone(obj: Any, memo: dict) -> Any:
    """A deep copy of plain Python state (containers, and objects that keep their fields in
    ``__dict__``), much cheaper than ``copy.deepcopy``'s general protocol: a search clones
    a state once per transition. Anything else (slots, custom copy hooks, arrays) goes to
    ``copy.deepcopy`` with the same memo, so shared references stay shared."""
    t = type(obj)
    if t in _ATOMS or isinstance(obj, _SHARED_KINDS):
        return obj
    found = memo.get(id(obj))
    if found is not None:
        return found
    if t is list:
        if all(type(x) in _ATOMS for x in obj):  # token ids, block tables: the common case
            c: Any = obj[:]
            memo[id(obj)] = c
            return c
        c = []
        memo[id(obj)] = c
        c.extend([_clone(x, memo) for x in obj])
    elif t is dict:
        c = {}
        memo[id(obj)] = c
        for k, v in obj.items():
            c[_clone(k, memo)] = _clone(v, memo)
    elif t is set:
        c = obj.copy() if all(type(x) in _ATOMS for x in obj) else {_clone(x, memo) for x in obj}
        memo[id(obj)] = c
    elif t is tuple or t is frozenset:
        if all(type(x) in _ATOMS for x in obj):  # immutable all the way down: share it
            return obj
        c = t(_clone(x, memo) for x in obj)
        memo[id(obj)] = c
    elif t is deque:
        c = deque(maxlen=obj.maxlen)
        memo[id(obj)] = c
        c.extend(_clone(x, memo) for x in obj)
    elif _plain(t) and hasattr(obj, "__dict__"):
        # a plain object, copied field by field (never through __getstate__: nano-vllm's
        # Sequence drops its token_ids there, once it has decoded, see snapshot())
        c = object.__new__(t)
        memo[id(obj)] = c
        c.__dict__.update({k: _clone(v, memo) for k, v in vars(obj).items()})
        return c
    else:
        return copy.deepcopy(obj, memo)
    return c


_PLAIN: dict = {}


def _plain(t: type) -> bool:
    """Whether ``t``'s instances are plain: state in ``__dict__`` alone, no copy hooks."""
    p = _PLAIN.get(t)
    if p is None:
        p = _PLAIN[t] = (not hasattr(t, "__slots__") and not hasattr(t, "__deepcopy__")
                         and t.__reduce_ex__ is object.__reduce_ex__ and t.__module__ != "builtins"
                         and not issubclass(t, (dict, list, set, tuple, deque, Enum)))
    return p


def _clone_state(state: dict) -> dict:
    memo: dict = {}
    return {k: (v if k in _FIXED else _clone(v, memo)) for k, v in state.items()}


def _has_hash(h: Any) -> bool:
    return h is not None and h != -1



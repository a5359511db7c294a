"""Loading a user's allocator of its own API as a kvspec target (``FILE.py:NAME``,
``module:NAME``, after the nano-vllm / KVCacheManager / BlockPool APIs did not fit).

The mapping comes from a declaration (a ``kvspec_alloc`` class attribute, else
``[tool.kvspec.alloc]`` in the pyproject.toml nearest the file), else from inference
(``kvspec.alloc.shapes``). Either way it is shown: a note on stderr at load, and the
report's ``declaration`` line. Each mapped call is bound to the class's signature before
anything runs (``kvspec.targets.contract``). Where neither gives a mapping, the loader
prints the declaration kvspec proposes (``kvspec.alloc.proposal``) and refuses in one line.

Policies are the allocator level's own, not declared: no prefix cache, free order "any"
(kvspec follows which free blocks the allocator hands out and checks they were free), a
null block only where a probe shows block 0 is never handed out; a refusal may be any
exception or a None/False return (ATOMIC_REJECT, with --misuse)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Optional

from kvspec.alloc.build import build_probe, plan
from kvspec.alloc.pool_driver import FreeListDriver
from kvspec.alloc.proposal import propose
from kvspec.alloc.shapes import FREE_LIST, SEQUENCE, AllocMap, declared, fill_fields, infer
from kvspec.errors import UsageError
from kvspec.spec.config import Config
from kvspec.targets.base import Driver, Target, TargetError, Traits

POOL_ONLY_OPS = frozenset({"Touch", "Cache", "CachePartial", "Lookup", "Reset", "FreeForeign"})


class FreeListTarget(Target):
    def __init__(self, name: str, traits: Traits, make: Callable[[int, int], Any], amap: AllocMap,
                 reserved: frozenset) -> None:
        self.name, self.traits, self.make, self.amap, self.reserved = name, traits, make, amap, reserved
        self.api = "allocator"

    def driver(self, config: Config) -> Driver:
        return FreeListDriver(self.make, self.amap, config, self.reserved)

    def describe(self) -> str:
        return f"{self.name} (free-list allocator)"


def read_declaration(cls: type, source: Optional[Path]) -> Optional[AllocMap]:
    """The declared mapping, or None; a mistake in it is a one-line UsageError."""
    from kvspec.targets.names import _declared
    table, where = _declared(cls, "kvspec_alloc", source, "alloc")
    if not table:
        return None
    try:
        return declared(cls, table, where)
    except ValueError as e:
        raise UsageError(str(e)) from None


def mapping_for(cls: type, source: Optional[Path]) -> Optional[AllocMap]:
    return read_declaration(cls, source) or infer(cls)


def refusal(spec: str, cls: type, why: str, source: Optional[Path]) -> TargetError:
    """The one-line refusal; the proposed declaration goes to stderr first."""
    lines = propose(cls)
    trie = [n for n in ("match_prefix", "insert", "evict", "evict_lru", "cache_blocks") if callable(getattr(cls, n, None))]
    if lines is None and "match_prefix" in trie:
        return TargetError(f"{why}; it is a prefix cache ({', '.join(f'{n}()' for n in trie)}) without an allocator "
                           f"of its own: kvspec checks the allocator that hands out its blocks (allocate(n)/free(ids), "
                           f"kvspec api allocator), and drives a tree itself only with match_prefix(key), "
                           f"insert(key, values), evict(n) and a way to unlock a match (dec_lock_ref(node), "
                           f"dec_ref_path(node) or release(key))")
    if lines is None:
        return TargetError(f"{why}; nor does it have an allocator API kvspec recognizes (allocate(n)/free(ids), "
                           f"or allocate_sequence(seq_id, n_tokens)/append_token(seq_id)/free_sequence(seq_id): "
                           f"kvspec api allocator)")
    from kvspec.targets.policies import nearest_pyproject
    py = nearest_pyproject(source) if source is not None else None
    where = py if py is not None else (source.parent / "pyproject.toml" if source is not None else "pyproject.toml")
    print(f"kvspec: proposed declaration for {cls.__name__}, built from its methods (paste it into {where}, "
          f"check each name, and run again):", file=sys.stderr)
    for line in lines:
        print(f"    {line}", file=sys.stderr)
    api = "nanovllm" if lines[0] == "[tool.kvspec.names]" else "allocator"
    return TargetError(f"{why}; kvspec cannot tell which of its methods allocate and free: the declaration "
                       f"printed above, pasted into {where}, says so (kvspec api {api})")


def _calls(amap: AllocMap) -> list:
    from kvspec.targets.contract import Call
    m = amap.methods
    if amap.shape == FREE_LIST:
        out = [Call(m["allocate"], () if amap.per_id.get("allocate") else ("n: int",), "block ids"),
               Call(m["free"], ("block_id: int",) if amap.per_id.get("free") else ("block_ids: list",), "None")]
        if m.get("can_allocate"):
            out.append(Call(m["can_allocate"], ("n: int",), "bool"))
        if m.get("share"):
            out.append(Call(m["share"], ("block_id: int",) if amap.per_id.get("share") else ("block_ids: list",),
                            "None"))
        return out
    grow = amap.per_id.get("add_then_grow")
    out = [Call(m["allocate_sequence"], ("seq_id: int",) if grow else ("seq_id: int", "n_tokens: int"),
                "anything; None/False: refused"),
           Call(m["free_sequence"], ("seq_id: int",), "None")]
    if m.get("append_token"):
        out.append(Call(m["append_token"], ("seq_id: int", "n_tokens: int") if grow else ("seq_id: int",),
                        "anything; None/False: refused"))
    for role, args in (("can_allocate", ("n_tokens: int",)), ("can_append", ("seq_id: int",)),
                       ("fork", ("parent_id: int", "child_id: int"))):
        if m.get(role):
            out.append(Call(m[role], args, "bool"))
    return out


def load_allocator(spec: str, cls: type, make: Optional[Callable[..., Any]], source: Optional[Path],
                   why: str, amap: Optional[AllocMap] = None) -> Target:
    """The target for ``cls``'s own allocator API; ``why``: the other APIs' refusal line."""
    amap = amap or mapping_for(cls, source)
    if amap is None:
        from kvspec.alloc.radix import infer_radix, load_radix
        radix = infer_radix(cls)
        if radix is not None:  # a trie prefix cache: kvspec supplies the allocator (kvspec.alloc.radix)
            return load_radix(spec, cls, make, radix)
        raise refusal(spec, cls, why, source)
    from kvspec.targets.contract import check_calls
    check_calls(spec, cls, _calls(amap))  # the mapping bound to the signatures, before anything runs
    try:
        make_fn, how = plan(make or cls)
    except TargetError as e:
        raise TargetError(f"target {spec}: {e}") from None
    probe = build_probe(make_fn, spec)
    fill_fields(amap, probe, 8)
    if amap.shape == SEQUENCE and not amap.get("block_table"):
        raise TargetError(f"target {spec}: {cls.__name__} is a sequence-keyed allocator, but kvspec finds no block "
                          f"table (a get_block_table(seq_id) method or a dict attribute seq_id -> block ids): "
                          f"declare block_table in [tool.kvspec.alloc] (kvspec api allocator)")
    from kvspec.alloc.kv_tensors import find as find_kv
    kv = [name for name, _, _ in find_kv(probe, 8, 2)]
    shown = amap.describe(cls) + (f", KV tensors <- {', '.join(f'{cls.__name__}.{n}' for n in kv)} (written into and "
                                  f"read back: KV_INTEGRITY)" if kv else "") + f"; built as {how}"
    print(f"kvspec: note: {spec}: {shown}", file=sys.stderr)
    declaration = f"{'none: ' if amap.where == 'inferred' else ''}allocator API {shown}"
    if amap.shape == FREE_LIST:
        reserved = _reserved(make_fn, amap, spec)
        unsupported = POOL_ONLY_OPS - ({"Touch"} if amap.get("share") else set())  # ref counts: Touch shares
        traits = Traits(null_block=bool(reserved), null_block_id=0, unhashed_free_first=False,
                        misuse_errors=(Exception,), levels=("pool",), prefix_caching="off", free_order="any",
                        unsupported_ops=unsupported, declaration=declaration)
        return FreeListTarget(spec, traits, make_fn, amap, reserved)
    from kvspec.alloc.seq_manager import SequenceTarget, front_class
    from kvspec.targets.nano_sequence import Sequence
    traits = Traits(null_block=False, unhashed_free_first=False, misuse_errors=(), levels=("cache",),
                    documented_noops=frozenset({"free_unknown_request"}), prefix_caching="off", free_order="any",
                    declaration=declaration,
                    unsupported_ops=frozenset({"Step"}) if amap.per_id.get("no_append") else frozenset())
    target = SequenceTarget(front_class(cls, amap, make_fn), Sequence, spec, traits, source=source)
    target.caching_support = "off"  # the front has no prefix index, whatever its observation hook implies
    target.check_internals()
    target.api_shape = SEQUENCE
    return target


def _reserved(make: Callable[[int, int], Any], amap: AllocMap, spec: str) -> frozenset:
    """The blocks a fresh allocator keeps back: where it reports fewer than all of 8 blocks
    free (its free count or free list), the ones a probe taking one block at a time never
    gets. Only block 0 may be kept back (a null block); anything else is refused in one line.
    An allocator that reports every block free keeps none back, whatever it then hands out."""
    from kvspec.spec.ops import Alloc
    d = FreeListDriver(make, amap, Config(level="pool", num_blocks=8, block_size=2), frozenset())
    if not amap.get("num_free") and not amap.get("free_ids"):
        return frozenset()
    try:
        start = d.observe().free_count
    except Exception as e:
        raise TargetError(f"target {spec}: kvspec cannot read its free count or free list: "
                          f"{type(e).__name__}: {e}") from None
    if start >= 8:
        return frozenset()
    got: list = []
    for _ in range(8):
        try:
            got += d.apply(Alloc(1))
        except Exception:
            break
    kept = frozenset(range(8)) - set(got)
    if start == 7 and kept == {0}:
        return kept
    raise TargetError(f"target {spec}: a fresh allocator of 8 blocks reports {start} free and hands out "
                      f"{sorted(got)}: kvspec checks allocators that hand out every block (or all but block 0, "
                      f"a null block)")

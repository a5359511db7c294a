"""The API contract: the calls kvspec makes on a user's allocator and the internals it
reads, per API, as tables; the check of a class against them before the first step; and
``kvspec api``, which prints the same tables (one source of truth).

Why check before the first step. A call kvspec makes that the class cannot take
(``can_allocate(self, num_tokens: int)`` driven with a Sequence, a ``cache_full_blocks``
with other parameters) would raise inside the target and read as the target's own
crash: a NO_CRASH finding, exit 1 and a repro of kvspec's mistake. Instead each
signature is bound against the call kvspec will make (defaults and keywords included:
``allocate(seq, plan=None)`` takes ``allocate(seq)``), and a parameter annotated with a
plain scalar type where kvspec passes a Sequence or Request (or the reverse) is refused
too; a mismatch is one line, exit 2, giving the call kvspec makes.

At call time (``binding_error``): a TypeError raised by binding kvspec's own call, not
inside the target, is kvspec's error, never a finding.

The nano-vllm table is the nano driver's own ``NANO_CALLS``
(``kvspec.targets.nanovllm_target``), resolved through the class's name map
(``kvspec.targets.names``); the v1-style tables below are the calls of
``kvspec.targets.impl_target`` / ``impl_cache`` / ``v1_driver`` (kvspec's impl API) and
of ``kvspec.vllm.compat`` (vLLM's own API).

This module is longer than 450 lines because it holds the contract tables of all three
APIs (and both vLLM-style driving styles) beside the one checker and renderer that read
them: one source of truth for the load-time check and ``kvspec api``.
"""
from __future__ import annotations

import inspect
import json
import linecache
import re
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

from kvspec.errors import TargetError


@dataclass(frozen=True)
class Call:
    """One call kvspec makes: ``method(*args, **keywords)``. ``args``/``keywords`` are
    ``"name: Type"``; ``alternatives`` are other positional argument lists the driver uses
    instead when the method takes them (the method must take one of the forms);
    ``optional``: made only when the class has the method."""
    method: str
    args: tuple[str, ...]
    returns: str
    keywords: tuple[str, ...] = ()
    alternatives: tuple[tuple[str, ...], ...] = ()
    optional: bool = False
    when: str = ""

    def form(self, args: Optional[tuple[str, ...]] = None) -> str:
        parts = list(self.args if args is None else args) + [f"{k}=..." for k in self.keywords]
        return f"{self.method}({', '.join(parts)})"


@dataclass(frozen=True)
class Field:
    """An internal kvspec reads: ``name`` on ``owner`` (manager, Block, ...), of ``type``."""
    owner: str
    name: str
    type: str
    note: str = ""


@dataclass(frozen=True)
class Style:
    """One way kvspec drives an API: when it applies, the calls, the internals read."""
    api: str
    style: str
    applies: str
    calls: tuple[Call, ...]
    fields: tuple[Field, ...]
    extra: tuple[str, ...] = field(default=())


# -- the v1-style tables (kvspec's impl API and vLLM's) ----------------------------------
_POOL_FIELDS = (
    Field("pool", "blocks", "list[Block]", "indexed by block_id"),
    Field("pool", "free_block_queue", "doubly linked list",
          "sentinels head/tail (or fake_free_list_head/_tail), walked by next_free_block"),
    Field("pool", "cached_block_hash_to_block", "dict[hash, Block | dict[int, Block]]", "the prefix index"),
    Field("pool", "null_block", "Block", "optional"),
    Field("Block", "block_id", "int"),
    Field("Block", "ref_cnt", "int"),
    Field("Block", "block_hash", "hash | None", "None: not cached"),
    Field("Block", "prev_free_block", "Block | None", "None when not in the free queue"),
    Field("Block", "next_free_block", "Block | None", "None when not in the free queue"),
)

IMPL_POOL = Style(
    "blockpool", "kvspec impl", "a BlockPool whose cache_full_blocks takes (blocks, block_hashes, ...)", (
        Call("__init__", ("num_gpu_blocks: int",), "a BlockPool", keywords=("enable_caching: bool",)),
        Call("__init__", ("num_gpu_blocks: int",), "a BlockPool", when="another pool, for a foreign block"),
        Call("get_new_blocks", ("num_blocks: int",), "list[Block]: num_blocks blocks, taken from the free queue"),
        Call("free_blocks", ("blocks: list[Block]",), "None: ref_cnt -1 each; at 0 to the free queue, in order"),
        Call("touch", ("blocks: list[Block]",), "None: ref_cnt +1 each; a free one leaves the free queue"),
        Call("cache_full_blocks", ("blocks: list[Block]", "block_hashes: list[bytes]", "num_cached_blocks: int",
                                   "num_full_blocks: int"),
             "None: blocks[num_cached_blocks:num_full_blocks] cached under their hashes"),
        Call("get_cached_block", ("block_hash: bytes",), "Block | None"),
        Call("reset_prefix_cache", (), "bool: False while any block is held"),
        Call("get_num_free_blocks", (), "int"),
    ), _POOL_FIELDS)

IMPL_MANAGER = Style(
    "kvcachemanager", "kvspec impl", "a KVCacheManager with make_request and get_block_ids", (
        Call("__init__", ("num_gpu_blocks: int", "block_size: int"), "a KVCacheManager",
             keywords=("enable_caching: bool",)),
        Call("make_request", ("request_id: str", "prompt_token_ids: list[int]"),
             "Request: num_tokens, num_computed_tokens (kvspec sets it), append_output_token_ids(token)"),
        Call("get_computed_blocks", ("request: Request",), "tuple[list[Block], int]: the hit blocks and tokens"),
        Call("allocate_slots", ("request: Request", "num_new_tokens: int", "num_new_computed_tokens: int",
                                "new_computed_blocks: list[Block]"),
             "list[Block] | None: None when the blocks do not fit", when="prefill"),
        Call("allocate_slots", ("request: Request", "num_new_tokens: int"), "list[Block] | None", when="decode"),
        Call("free", ("request: Request",), "None: the request's blocks, tail first"),
        Call("get_block_ids", ("request_id: str",), "list[int]: the request's block table"),
    ), (Field("manager", "block_pool", "BlockPool", "read as the blockpool API's internals"),) + _POOL_FIELDS)

VLLM_POOL = Style(
    "blockpool", "vLLM", "a cache_full_blocks whose first parameter is request, or a constructor with "
    "hash_block_size: driven as vLLM 0.33.0's own, with vLLM's Request and hashing (vllm installed)", (
        Call("__init__", (), "a BlockPool", keywords=("num_gpu_blocks: int", "enable_caching: bool",
                                                      "hash_block_size: int"),
             when="only the names the constructor takes are passed"),
        Call("get_new_blocks", ("num_blocks: int",), "list[Block]"),
        Call("free_blocks", ("blocks: list[Block]",), "None"),
        Call("touch", ("blocks: list[Block]",), "None", alternatives=(("blocks_per_group: tuple[list[Block]]",),)),
        Call("cache_full_blocks", (), "None", keywords=(
            "request: Request", "blocks: list[Block]", "num_cached_blocks: int", "num_full_blocks: int",
            "block_size: int", "kv_cache_group_id: int"), when="only the names the method takes are passed"),
        Call("get_cached_block", ("block_hash: BlockHash",), "Block | None",
             alternatives=(("block_hash: BlockHashWithGroupId", "kv_cache_group_ids: list[int]"),)),
        Call("reset_prefix_cache", (), "bool"),
        Call("get_num_free_blocks", (), "int"),
    ), _POOL_FIELDS)

VLLM_MANAGER = Style(
    "kvcachemanager", "vLLM", "a constructor whose first parameter is kv_cache_config: driven as vLLM 0.33.0's "
    "own KVCacheManager (vllm installed)", (
        Call("__init__", (), "a KVCacheManager", keywords=("kv_cache_config: KVCacheConfig", "max_model_len: int",
                                                           "enable_caching: bool", "hash_block_size: int"),
             when="only the names the constructor takes are passed"),
        Call("get_computed_blocks", ("request: Request",), "tuple[KVCacheBlocks, int]"),
        Call("allocate_slots", ("request: Request", "num_new_tokens: int", "num_new_computed_tokens: int",
                                "new_computed_blocks: KVCacheBlocks"), "KVCacheBlocks | None",
             alternatives=(("request: Request", "num_new_tokens: int", "new_computed_blocks: KVCacheBlocks"),),
             when="the second form where allocate_slots has no num_new_computed_tokens (vLLM before 0.9)"),
        Call("free", ("request: Request",), "None"),
    ), (Field("manager", "block_pool", "BlockPool", "read as the blockpool API's internals"),
        Field("manager", "coordinator.single_type_managers[0].req_to_blocks", "dict[str, list[Block]]",
              "each request's blocks")) + _POOL_FIELDS)

V1_STYLES = {("blockpool", False): IMPL_POOL, ("blockpool", True): VLLM_POOL,
             ("kvcachemanager", False): IMPL_MANAGER, ("kvcachemanager", True): VLLM_MANAGER}


# -- the nano-vllm table (the nano driver's own) -----------------------------------------
_NANO_ARG_TYPES = {"seq": "Sequence"}
_ALT = re.compile(r"(\w+)\(([^)]*)\)")


def _typed(arg: str) -> str:
    return arg if ":" in arg else f"{arg}: {_NANO_ARG_TYPES.get(arg, 'int')}"


def nano_styles() -> tuple[Style, ...]:
    """One Style per generation, from ``nanovllm_target.NANO_CALLS``."""
    from kvspec.targets import nanovllm_target as nt
    try:
        from kvspec.targets import names as nm
    except ImportError:  # the name map's module: without it, kvspec's names only
        nm = None

    fields = (
        Field("manager", "blocks", "list[Block]", "indexed by block id"),
        Field("manager", "free_block_ids", "deque[int] | list[int] | OrderedDict[int, ...]",
              "free block ids, next reused first (a lazily cleaned deque needs a free_block_set; a second "
              "pool the manager counts as free, len(self.free_block_ids) + len(self.<pool>), is read after it)"),
        Field("manager", "used_block_ids", "set[int]", "optional"),
        Field("manager", "hash_to_block_id", "dict[hash, int]", "the prefix index (without it: caching off)"),
        Field("manager", "block_size", "int", "optional: the block size the manager keeps"),
        Field("Block", "ref_count", "int"),
        Field("Block", "hash", "hash | -1 | None", "-1 or None: not cached"),
        Field("Block", "token_ids", "list[int]", "the block's tokens (checked against the hash)"),
        Field("Sequence", "block_table", "list[int]", "set by allocate / may_append"),
        Field("Sequence", "num_cached_tokens", "int", "the prefix hit, set by allocate"),
    )
    known = {(f.owner, f.name) for f in fields}
    extra_fields = tuple(Field("manager" if n in getattr(nt, "MANAGER_FIELDS", ()) else "Block", n, "", "")
                         for n in getattr(nt, "MANAGER_FIELDS", ()) + getattr(nt, "BLOCK_FIELDS", ())
                         if ("manager", n) not in known and ("Block", n) not in known)
    extra = (
        "Sequence: the module's own Sequence class (built by its constructor's signature: token_ids, "
        "block_size, seq_id, sampling_params), else kvspec's kvspec.targets.nano_sequence.Sequence",
    ) + (() if nm is None else (
        "names: other method or field names are declared as [tool.kvspec.names] in pyproject.toml or a "
        "kvspec_names class attribute, kvspec name -> yours; kvspec's names: " + " ".join(nm.VOCABULARY),
        f"free list order: the start of free_block_ids is reused next, except a plain list under "
        f"free_order = \"mru\" (read as a stack, popped from the end); say which end where that is wrong: "
        f"{getattr(nm, 'FREE_NEXT', 'free_next')} = \"end\" or \"start\" in [tool.kvspec.names]",
        f"observation hook: {nm.OBSERVE_HOOK}(self) -> dict with blocks [(ref_count, hash_or_None, token_ids)] "
        "in id order, free [ids, next reused first], index {hash: block_id or [ids]}; replaces reading the internals",
        "protocol: extra scheduler calls, [tool.kvspec.protocol] or kvspec_protocol, hook point -> method(seq); "
        "hook points: " + " ".join(nm.HOOK_POINTS),
    ))
    ctor = Call("__init__", ("num_blocks: int", "block_size: int"), "a BlockManager",
                when="plus enable_prefix_caching=bool where the constructor has that switch")
    described = getattr(nt, "NANO_GENERATIONS", {})
    out = []
    for gen, rows in getattr(nt, "NANO_CALLS", {}).items():
        calls = [ctor]
        for row in rows:
            alts = tuple(tuple(_typed(a.strip()) for a in m.group(2).split(",") if a.strip())
                         for m in _ALT.finditer(row.note or "") if m.group(1) == row.method)
            calls.append(Call(row.method, tuple(_typed(a) for a in row.args), row.returns, alternatives=alts,
                              optional=not row.required, when=row.note))
        out.append(Style("nanovllm", gen, described.get(gen, _NANO_APPLIES.get(gen, "")), tuple(calls),
                         fields + extra_fields, extra))
    return tuple(out)


_NANO_APPLIES = {
    "boolean": "can_allocate(seq) and allocate(seq) (nano-vllm 2025, nano-vllm-fork)",
    "counted": "can_allocate(seq) and allocate(seq, num_cached_blocks), with hash_blocks (later nano-vllm)",
    "chunked": "can_allocate(seq, num_tokens) and allocate(seq, num_tokens) (chunked prefill)",
    "layout": "get_token_layout(seq), can_allocate(num_tokens), allocate(seq), can_append(seq, num_new_tokens) "
              "(v1-style: the scheduler counts the tokens)",
}


def alloc_styles() -> tuple[Style, ...]:
    """The allocator level (``kvspec.alloc``): a free list, a sequence-keyed allocator."""
    from kvspec.alloc import shapes as sh

    def alts(names: tuple) -> str:
        return "or: " + ", ".join(names[1:])
    ctor = Call("__init__", ("num_blocks: int",), "the allocator",
                when="parameters filled by name: " + "/".join(sh.NUM_BLOCKS_PARAMS[:4]) + "... = the block count, "
                     + "/".join(sh.BLOCK_SIZE_PARAMS[:3]) + "... = the block size; a config object is built as "
                     "the package's engine builds it (its Config, num_kvcache_blocks/kvcache_block_size)")
    count = Call(sh.FREE_COUNT[0], (), "int: the free count (a method, property or int attribute)", optional=True,
                 when=alts(sh.FREE_COUNT))
    common_reads = (
        Field("allocator", "<free list>", "list | deque | set | dict of block ids", "optional, found by name: "
              + ", ".join(sh.FREE_FIELDS[:6]) + ", or the one attribute named *free*; without it and without a "
              "free count a leak cannot be seen"),
        Field("allocator", "<ref counts>", "list[int] (one per block)", "optional: " + ", ".join(sh.REF_FIELDS[:3])),
    )
    extra = (
        "mapping: inferred from names and signatures (always shown, and in the report's declaration line), or "
        "declared in [tool.kvspec.alloc] (or a kvspec_alloc class attribute): shape = \"free_list\" | "
        "\"sequence\", then role = \"<your method>\" for the roles above (plus allocate_per_id / free_per_id, "
        "block_table, num_free, free_ids, ref_counts); where nothing fits, kvspec prints a filled-in one",
        "a refusal is an exception, or a None/False return (None only from a method that returns a value when it "
        "succeeds); a refusal must change nothing (ATOMIC_REJECT with --misuse; at the cache level the model's "
        "free counts)",
        "policies: no prefix cache, free order any (kvspec follows which free blocks it hands out and checks they "
        "were free), block 0 a null block only where a fresh allocator reports one block fewer free and never hands "
        "block 0 out",
        "invariants: ids handed out are distinct, free and in range (EVICTION_ORDER, I1), free returns exactly what "
        "was held and the count is true (ACCOUNTING, I1), nothing leaks once nothing runs (NO_LEAK, I1), a "
        "sequence's table covers its tokens and stays put (I2, KV_INTEGRITY's shadow store, EVICTION_ORDER); a "
        "fork shares every block and a write into a shared block copies it first (COPY_ON_WRITE)",
        "KV tensors it owns (a float tensor attribute, or a list of them per layer, with a dimension of the block "
        "count followed by the block size: k_cache, v_cache...): kvspec writes into each block (each token's slot, "
        "for a sequence) when it is handed out and reads it back while it is held (KV_INTEGRITY); they are built "
        "small on the CPU (device='cpu', num_layers/num_heads/head_dim/... = 1)",
        "a sequence allocator without decode growth (allocate(request_id, n_tokens) and free(request_id) only) is "
        "checked with Admit, Preempt and Finish (Step is not drawn)",
    )
    free_list = Style("allocator", "free_list", "allocate(n) -> ids and free(ids): checked at the pool level "
                      "(Alloc, Free)", (
                          ctor,
                          Call("allocate", ("n: int",), "list of block ids (None/False/empty: refused)",
                               alternatives=((),), when=alts(sh.FREE_LIST_ROLES["allocate"])
                               + "; allocate() -> one id is called n times"),
                          Call("free", ("block_ids: list[int]",), "None", alternatives=(("block_id: int",),),
                               when=alts(sh.FREE_LIST_ROLES["free"]) + "; free(block_id) is called per id"),
                          Call("can_allocate", ("n: int",), "bool", optional=True, when=alts(sh.CAN_ALLOCATE)),
                          count), common_reads, extra)
    sequence = Style("allocator", "sequence", "allocate_sequence(seq_id, n_tokens), append_token(seq_id), "
                     "free_sequence(seq_id): checked at the cache level (Admit, Step, Preempt, Finish; caching off)", (
                         Call("__init__", ("num_blocks: int", "block_size: int"), "the allocator", when=ctor.when),
                         Call("allocate_sequence", ("seq_id: int", "n_tokens: int"), "anything; refused: see below",
                              when=alts(sh.SEQUENCE_ROLES["allocate_sequence"])),
                         Call("append_token", ("seq_id: int",), "anything; refused: see below",
                              when=alts(sh.SEQUENCE_ROLES["append_token"]) + "; called once per decode token"),
                         Call("free_sequence", ("seq_id: int",), "None", when=alts(sh.SEQUENCE_ROLES["free_sequence"])),
                         Call("get_block_table", ("seq_id: int",), "list of block ids", optional=True,
                              when=alts(sh.TABLE_METHODS) + "; else a dict attribute seq_id -> ids: "
                              + ", ".join(sh.TABLE_FIELDS[:4])),
                         Call("can_allocate", ("n_tokens: int",), "bool", optional=True, when=alts(sh.CAN_ALLOCATE)),
                         Call("can_append", ("seq_id: int",), "bool", optional=True, when=alts(sh.CAN_APPEND)),
                         Call("fork", ("parent_id: int", "child_id: int"), "None", optional=True,
                              when=alts(sh.FORK) + "; copy-on-write: probed after each admission and step (fork, "
                              "the child's next token, free of the child): COPY_ON_WRITE"),
                         Call("copy_on_write", ("seq_id: int", "block_idx: int"), "(src, dst)", optional=True,
                              when=alts(sh.COPY_ON_WRITE) + "; with a fork: called before each write into a "
                              "partial last block, as its engine does; the probe checks the copy it returns"),
                         count), common_reads, extra)
    radix = Style("allocator", "radix", "a radix / trie prefix cache (match_prefix, insert, evict, node locks), "
                  "with no allocator of its own: kvspec supplies a free list and drives the tree at the cache level "
                  "(Admit, Step, Preempt, Finish; caching on)", (
                      Call("__init__", (), "the tree", when=ctor.when),
                      Call("match_prefix", ("key: list",), "(n, values[, node]) | values | (values, node)",
                           when=alts(sh.MATCH) + "; key items are tuples of a block's tokens, values block ids"),
                      Call("insert", ("key: list", "values: list"), "anything", when=alts(sh.INSERT)
                           + "; called one block longer per call, so each node holds one block"),
                      Call("evict", ("n: int",), "the evicted values", when=alts(sh.EVICT)
                           + "; called again while short and it frees something"),
                      Call("inc_lock_ref", ("node",), "None", optional=True, when=alts(sh.LOCK)
                           + "; else the match locks by itself"),
                      Call("dec_lock_ref", ("node",), "None", when=alts(sh.UNLOCK_NODE) + "; or release(key): "
                           + ", ".join(sh.UNLOCK_TOKENS)),
                      Call("evictable_size", (), "int: evictable blocks", optional=True, when=alts(sh.EVICTABLE)
                           + "; else kvspec counts the tree's blocks no request holds")),
                  (Field("tree", "root", "a node with a children dict", "or: " + ", ".join(sh.ROOT_FIELDS[1:])),
                   Field("node", "key / value / lock", "its key items, values, lock count",
                         "found by name: " + "/".join(sh.KEY_FIELDS[:3]) + ", " + "/".join(sh.VALUE_FIELDS[:3])
                         + ", " + "/".join(sh.LOCK_FIELDS[:3]))),
                  ("invariants: a hit returns only KV inserted for exactly that prefix (HASH_CHAIN, MAX_HIT, "
                   "KV_INTEGRITY), a held block is locked and never evicted (I1, I3), evict frees exactly what it "
                   "returns (a returned block still in the tree is a queue problem), the evictable count is true "
                   "(ACCOUNTING); a block the tree already holds stays the request's own (never deduplicated)",))
    return (free_list, sequence, radix)


def styles(api: str) -> tuple[Style, ...]:
    if api == "nanovllm":
        return nano_styles()
    if api == "allocator":
        return alloc_styles()
    return (V1_STYLES[(api, False)], V1_STYLES[(api, True)])


# -- checking a class ------------------------------------------------------------------
_SCALARS = {"int", "float", "str", "bytes", "bool", "None"}
_OBJECTS = {"Sequence", "Request"}


def _annotation(p: inspect.Parameter) -> str:
    a = p.annotation
    if a is inspect.Parameter.empty:
        return ""
    text = a if isinstance(a, str) else getattr(a, "__name__", str(a))
    return text.strip().strip("'\"").replace("typing.", "")


def _type_clash(passed: str, param: inspect.Parameter) -> bool:
    """kvspec passes ``passed`` (a type name) where ``param`` is annotated with a clearly
    different kind: a scalar for a Sequence/Request, or a Sequence/Request for a scalar."""
    ann = _annotation(param)
    if not ann:
        return False
    if passed in _OBJECTS:
        return ann in _SCALARS
    if passed in _SCALARS:
        return ann.rsplit(".", 1)[-1] in _OBJECTS
    return False


def _split(arg: str) -> tuple[str, str]:
    name, _, typ = arg.partition(":")
    return name.strip(), typ.strip()


def _fits(sig: inspect.Signature, call: Call, args: tuple[str, ...], bound_self: bool) -> bool:
    """Whether ``sig`` (unbound: with self) takes kvspec's call with ``args``."""
    values = [object()] * len(args)
    kws = {_split(k)[0]: object() for k in call.keywords}
    try:
        ba = sig.bind(*([] if bound_self else [object()]), *values, **kws)
    except TypeError:
        return False
    params = list(sig.parameters.values())
    offset = 0 if bound_self else 1
    for i, arg in enumerate(args):
        typ = _split(arg)[1]
        if offset + i < len(params) and params[offset + i].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                                     inspect.Parameter.POSITIONAL_OR_KEYWORD):
            if _type_clash(typ, params[offset + i]):
                return False
    return ba is not None


def _signature(fn: Any) -> Optional[tuple[inspect.Signature, bool]]:
    """(signature, whether it is already bound: a staticmethod, classmethod or builtin)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    first = next(iter(sig.parameters.values()), None)
    bound = first is None or first.name not in ("self", "cls") or first.kind not in (
        inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sig, bound


def _raw(cls: type, attr: str) -> Any:
    for k in cls.__mro__:
        if attr in vars(k):
            v = vars(k)[attr]
            if isinstance(v, (staticmethod, classmethod)):
                return getattr(cls, attr)
            return v
    return getattr(cls, attr, None)


def _shown(sig: inspect.Signature) -> str:
    return str(sig.replace(return_annotation=inspect.Signature.empty))


def mismatch(cls: type, call: Call, attr: Optional[str] = None, build: Any = None) -> Optional[str]:
    """The reason ``cls`` cannot take ``call`` (through its attribute ``attr``), or None."""
    attr = attr or call.method
    if call.method == "__init__":
        fn = build if build is not None and not isinstance(build, type) else cls
        got = _signature(fn)
        shown_name = getattr(fn, "__name__", cls.__name__)
        if got is None:
            return None
        sig, _ = got
        forms = (call.args,) + call.alternatives
        if any(_fits(sig, call, a, True) for a in forms):
            return None
        return f"{shown_name}{_shown(sig)} cannot be called as {shown_name}" \
               f"({', '.join(list(call.args) + [f'{_split(k)[0]}=...' for k in call.keywords])})"
    fn = _raw(cls, attr)
    if fn is None or not callable(fn):
        return None if call.optional else f"{cls.__name__} has no {attr} (kvspec calls {call.form()})"
    got = _signature(fn)
    if got is None:
        return None  # a builtin or C method without a signature: nothing to check
    sig, bound = got
    forms = (call.args,) + call.alternatives
    if any(_fits(sig, call, a, bound) for a in forms):
        return None
    expected = " or ".join(Call(attr, a, call.returns, call.keywords).form() for a in forms)
    return f"{cls.__name__}.{attr}{_shown(sig)} cannot be called as {expected} -> {call.returns.split(':')[0]}"


def check_calls(spec: str, cls: type, calls: Iterable[Call], resolve: Any = None, build: Any = None) -> None:
    """Raise TargetError (one line) at the first call ``cls`` cannot take. ``resolve(name)``
    gives the class's attribute for kvspec's method name (a name map), or None."""
    seen: set = set()
    for call in calls:
        attr = call.method if call.method == "__init__" or resolve is None else (resolve(call.method) or call.method)
        key = (attr, call.args, call.keywords)
        if key in seen:
            continue
        seen.add(key)
        why = mismatch(cls, call, attr, build)
        if why is not None:
            raise TargetError(f"target {spec}: {why} (kvspec api lists the calls kvspec makes)")


def check_nano(spec: str, target: Any) -> None:
    """The nano-vllm contract of ``target`` (a NanoTarget): its generation's calls, through
    its name map, and the declared protocol calls (each ``method(seq)``)."""
    style = next((s for s in nano_styles() if s.style == target.api), None)
    if style is None:
        return
    names = getattr(target, "names", None)
    cls = target.manager_cls

    def resolve(name: str) -> Optional[str]:
        return names.resolve(cls, name) if names is not None else None

    calls = [c for c in style.calls if c.method != "__init__"]
    for methods in (getattr(target, "protocol", None) or {}).values():
        for m in (methods if isinstance(methods, (tuple, list)) else (methods,)):
            calls.append(Call(m, ("seq: Sequence",), "anything (ignored)"))
    check_calls(spec, cls, calls, resolve)


def check_v1(spec: str, api: str, vllm_style: bool, cls: type, build: Any = None) -> None:
    """The impl-style or vLLM-style contract of a BlockPool or KVCacheManager class."""
    style = V1_STYLES[(api, vllm_style)]
    # vLLM-style constructors and cache_full_blocks get only the names they take (kvspec.vllm.compat.call)
    calls = [c for c in style.calls if not (vllm_style and c.keywords)]
    check_calls(spec, cls, calls, build=build)


# -- at call time --------------------------------------------------------------------------
_KVSPEC_DIR = str(Path(__file__).resolve().parents[1])
_BINDING = re.compile(r"(positional argument|keyword argument|required (positional|keyword-only) argument"
                      r"|takes no arguments|unexpected keyword)")


def binding_error(exc: BaseException) -> Optional[str]:
    """A one-line reason when ``exc`` is a TypeError raised by binding kvspec's own call to
    the target (the innermost frame is kvspec's, so the target's code never ran), else
    None: then the TypeError is the target's own."""
    if not isinstance(exc, TypeError) or not _BINDING.search(str(exc)):
        return None
    tb = exc.__traceback__
    last = None
    while tb is not None:
        last = tb
        tb = tb.tb_next
    if last is None:
        return None
    fname = str(Path(last.tb_frame.f_code.co_filename).resolve())
    if not fname.startswith(_KVSPEC_DIR) or "nano_sequence" in fname:
        return None
    return f"kvspec's call to the target does not fit its signature: {exc} (kvspec api lists the calls kvspec makes)"


def describe_exception(e: BaseException) -> str:
    """``Type: message``; for an empty message (a bare ``assert``), where it was raised
    and the source line: "AssertionError at block_manager.py:12: assert block_size == 256"."""
    text = str(e)
    if text:
        return f"{type(e).__name__}: {text}"
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return f"{type(e).__name__} (no message)"
    f = frames[-1]
    line = (f.line or linecache.getline(f.filename, f.lineno or 0)).strip()
    return f"{type(e).__name__} at {Path(f.filename).name}:{f.lineno}" + (f": {line}" if line else "")


# -- kvspec api --------------------------------------------------------------------------
API_TITLES = {"blockpool": "BlockPool (--api blockpool)", "kvcachemanager": "KVCacheManager (--api kvcachemanager)",
              "nanovllm": "nano-vllm BlockManager (--api nanovllm)",
              "allocator": "an allocator with an API of its own (--api allocator; the allocator level)"}


def _call_line(c: Call) -> str:
    shown = list(c.args) + [k.replace(": ", "=") for k in c.keywords]
    head = f"{c.method}({', '.join(shown)})" if c.method != "__init__" else f"constructor({', '.join(shown)})"
    bits = [f"  {head} -> {c.returns}"]
    for a in c.alternatives:
        bits.append(f"      or {c.method}({', '.join(a)})")
    tail = "; ".join(x for x in (("optional: called only if present" if c.optional else ""), c.when) if x)
    if tail:
        bits.append(f"      ({tail})")
    return "\n".join(bits)


def render_text(apis: Iterable[str]) -> str:
    out = []
    for api in apis:
        out.append(f"== {API_TITLES[api]} ==")
        shown: tuple = ()
        for s in styles(api):
            out.append(f"-- {s.style}: {s.applies}")
            out.append(" calls (defaults and extra keyword parameters with defaults are fine):")
            out.extend(_call_line(c) for c in s.calls)
            if (s.fields, s.extra) == shown:
                out.append(" reads: as above")
                continue
            shown = (s.fields, s.extra)
            out.append(" reads:")
            out.extend(f"  {f.owner}.{f.name}: {f.type}" + (f"  ({f.note})" if f.note else "") for f in s.fields)
            out.extend(f" {x}" for x in s.extra)
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def render_json(apis: Iterable[str]) -> dict:
    return {api: [{"style": s.style, "applies": s.applies,
                   "calls": [{"method": c.method, "args": list(c.args), "keywords": list(c.keywords),
                              "alternatives": [list(a) for a in c.alternatives], "returns": c.returns,
                              "optional": c.optional, "when": c.when} for c in s.calls],
                   "reads": [{"owner": f.owner, "name": f.name, "type": f.type, "note": f.note} for f in s.fields],
                   "notes": list(s.extra)} for s in styles(api)] for api in apis}


APIS = ("blockpool", "kvcachemanager", "nanovllm", "allocator")


def cmd_api(a: Any) -> int:
    """``kvspec api [API] [--json]``."""
    apis = (a.api,) if getattr(a, "api", None) else APIS
    if getattr(a, "json", False):
        print(json.dumps(render_json(apis), indent=1))
    else:
        print(render_text(apis), end="")
    return 0

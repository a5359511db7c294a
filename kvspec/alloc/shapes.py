"""Which allocator API a class has, read from its method names and signatures.

Two shapes (issue 31), each a set of roles kvspec fills with the class's own methods:

- ``free_list``: ``allocate(n) -> ids`` (or ``allocate() -> id``, called n times) and
  ``free(ids)`` (or ``free(id)``, called per id); optional ``can_allocate(n)`` and a free
  count (``num_free()``, ``get_num_free_blocks()``, a ``num_free_blocks`` attribute...).
  Driven at the pool level (``Alloc``/``Free``).
- ``sequence``: ``allocate_sequence(seq_id, n_tokens)``, ``append_token(seq_id)``,
  ``free_sequence(seq_id)`` and the table, ``get_block_table(seq_id)`` (or a dict
  attribute ``seq_id -> [block ids]``); optional ``can_allocate(n_tokens)`` /
  ``can_append(seq_id)`` and a free count. Driven at the cache level (``Admit``/``Step``/
  ``Finish``), prefix caching off. Optional copy-on-write: ``fork(parent_id, child_id)``
  sharing every block, with ``append_slot(s)`` returning the copies (src, dst) it asks
  for; kvspec probes it after each admission and step (``kvspec.alloc.cow``).

A role is filled by the first of its candidate names the class has whose signature takes
kvspec's call (``inspect.Signature.bind``): the mapping is bound to the signatures at load,
never guessed past them. ``describe`` is the mapping in one line (always shown);
``proposal`` is the ``[tool.kvspec.alloc]`` table a user pastes where nothing fits.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

FREE_LIST, SEQUENCE = "free_list", "sequence"

# role -> candidate method names, most specific first
FREE_LIST_ROLES: dict[str, tuple[str, ...]] = {
    "allocate": ("allocate", "alloc", "allocate_blocks", "alloc_blocks", "allocate_many", "alloc_many", "get_blocks",
                 "take", "acquire", "allocate_block", "alloc_block", "get_free_block", "pop_free_block",
                 "allocate_pages", "alloc_pages", "allocate_page", "alloc_page", "get_page", "get_free_page"),
    # a ref-counted pool frees by dropping a holder (decref: the pool level's Free)
    "free": ("free", "free_blocks", "release", "release_blocks", "deallocate", "dealloc", "free_block",
             "release_block", "put", "give_back", "recycle", "decref_many", "free_many", "release_many", "decref",
             "dec_ref", "deref", "unref", "decrease_ref", "decrement_ref", "free_pages", "release_pages",
             "free_page", "release_page", "return_page"),
}
# a free list with ref counts: one holder more for each block (the pool level's Touch)
SHARE = ("incref", "inc_ref", "increase_ref", "increment_ref", "add_ref", "retain", "share", "acquire_ref", "ref",
         "fork_blocks", "incref_blocks", "share_blocks")
SEQUENCE_ROLES: dict[str, tuple[str, ...]] = {
    "allocate_sequence": ("allocate_sequence", "allocate_seq", "alloc_sequence", "add_sequence", "allocate_for",
                          "allocate_request", "add_request", "allocate", "alloc"),
    "append_token": ("append_token", "append_slot", "append_slots", "append", "append_tokens", "add_token", "grow",
                     "extend", "allocate_token", "allocate_slot", "alloc_token"),
    "free_sequence": ("free_sequence", "free_seq", "release_sequence", "remove_sequence", "free_request",
                      "release_request", "free", "release", "deallocate"),
}
TABLE_METHODS = ("get_block_table", "block_table", "get_blocks", "get_table", "blocks_of", "get_block_ids",
                 "table_of")
TABLE_FIELDS = ("block_tables", "tables", "seq_blocks", "seq_to_blocks", "sequences", "seqs", "block_table",
                "seq_block_tables", "request_blocks", "req_to_blocks", "allocations", "allocated_blocks",
                "allocated", "page_tables", "seq_to_pages", "request_to_blocks", "req_blocks", "owner_blocks",
                "block_map", "seq_block_map")
CAN_ALLOCATE = ("can_allocate", "can_alloc", "has_free", "can_allocate_blocks")
# copy-on-write: the child shares every block of the parent (one holder more each)
FORK = ("fork", "fork_sequence", "fork_seq", "fork_request", "fork_req", "clone_sequence", "clone_seq",
        "copy_sequence", "share_sequence", "clone")
CAN_APPEND = ("can_append", "can_append_token", "can_append_slot", "can_grow")
# an explicit copy-on-write its engine calls before writing into a shared block:
# copy_on_write(seq_id, block_idx) -> (src, dst)
COPY_ON_WRITE = ("copy_on_write", "cow_block", "cow", "copy_block_on_write")
FREE_COUNT = ("num_free", "get_num_free_blocks", "num_free_blocks", "free_count", "get_free_count",
              "num_free_pages", "available", "num_available", "n_free", "get_num_free", "free_blocks_count",
              "available_size", "free_blocks")
ID_FIELDS = ("block_number", "block_id", "block_idx", "page_id", "idx", "id", "index")  # a block object's id


def is_object(x: Any) -> bool:
    """A block object (vLLM v0's PhysicalTokenBlock): not an int, but with an int id field."""
    return not isinstance(x, int) and any(isinstance(getattr(x, f, None), int) for f in ID_FIELDS)


FREE_FIELDS = ("free_block_ids", "free_blocks", "free_list", "free_ids", "free", "_free", "free_pages",
               "free_queue", "_free_blocks", "_free_list", "available_blocks", "pool")
REF_FIELDS = ("ref_counts", "refcounts", "ref_count", "refcount", "refs", "_ref_counts", "_refcounts", "_refs",
              "_ref_count", "_refcount", "ref", "_ref")
NUM_BLOCKS_PARAMS = ("num_blocks", "n_blocks", "num_gpu_blocks", "total_blocks", "num_total_blocks", "capacity",
                     "num_pages", "n_pages", "size", "max_blocks", "pool_size", "blocks", "num_kv_blocks")
# the shape of KV tensors an allocator owns: built as small as it goes (1), whatever their defaults
TENSOR_DIM_PARAMS = ("num_layers", "n_layers", "num_hidden_layers", "num_heads", "n_heads", "num_kv_heads",
                     "n_kv_heads", "num_key_value_heads", "head_dim", "head_size", "hidden_dim", "hidden_size",
                     "d_model", "d_head", "kv_dim", "embed_dim", "dim")
BLOCK_SIZE_PARAMS = ("block_size", "page_size", "tokens_per_block", "kv_block_size", "kvcache_block_size")
ALL_ROLES = tuple(FREE_LIST_ROLES) + tuple(SEQUENCE_ROLES) + ("block_table", "can_allocate", "can_append", "fork",
                                                               "num_free", "free_ids", "ref_counts", "share",
                                                               "copy_on_write")
_SINGLE_ID = ("block_id", "block", "id", "idx", "bid", "page", "page_id", "index", "b")


def one_id(p: inspect.Parameter) -> bool:
    """Whether a free/share parameter takes one block id, not a collection: by its annotation
    (``int`` / a list type), else by its name (``block_idx``, ``page_id``: one; ``block_ids``,
    ``blocks``: many)."""
    ann = p.annotation
    text = ann if isinstance(ann, str) else getattr(ann, "__name__", None) or repr(ann)
    if ann is not p.empty:
        if text in ("int", "builtins.int") or ann is int:
            return True
        if any(w in text.lower() for w in ("list", "sequence", "iterable", "tuple", "set", "tensor", "ndarray")):
            return False
    name = p.name.lower()
    if name in _SINGLE_ID:
        return True
    if name.endswith(("ids", "idxs", "indices", "blocks", "pages", "list")):
        return False
    return name.endswith(("_id", "_idx", "_index", "_no", "_num", "_number"))
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


@dataclass
class AllocMap:
    """A shape and the class's name for each of its roles (``None``: absent)."""
    shape: str
    methods: dict[str, Optional[str]]
    per_id: dict[str, bool] = field(default_factory=dict)  # allocate() -> id, free(id): called once per block
    where: str = "inferred"  # or the declaration's place

    def get(self, role: str) -> Optional[str]:
        return self.methods.get(role)

    def describe(self, cls: type) -> str:
        """The mapping in one line, as kvspec drives it."""
        m, c = self.methods, cls.__name__
        if self.shape == FREE_LIST:
            parts = [f"Alloc(n) -> {c}.{m['allocate']}(" + (")" + " x n" if self.per_id.get("allocate") else "n)"),
                     f"Free(ids) -> {c}.{m['free']}(" + ("id) per id" if self.per_id.get("free") else "ids)")]
        else:
            grow = self.per_id.get("add_then_grow")
            step = ("Step: none (it has no decode growth: not drawn)" if self.per_id.get("no_append") else
                    f"Step -> {c}.{m['append_token']}(seq_id" + (", 1)" if self.per_id.get("grow_by_one") else ")"))
            parts = [f"Admit -> {c}.{m['allocate_sequence']}" + (f"(seq_id) + {c}.{m['append_token']}(seq_id, n_tokens)"
                                                                  if grow else "(seq_id, n_tokens)"),
                     step, f"Finish/Preempt -> {c}.{m['free_sequence']}(seq_id)",
                     f"table <- {c}.{m['block_table']}" + ("(seq_id)" if callable(getattr(cls, m["block_table"] or "", None))
                                                           else "[seq_id]")]
        if self.shape == FREE_LIST and m.get("share"):
            parts.append(f"Touch(ids) -> {c}.{m['share']}(" + ("id) per id" if self.per_id.get("share") else "ids)"))
        if self.shape == SEQUENCE and m.get("fork"):
            parts.append(f"fork <- {c}.{m['fork']}(parent_id, child_id) (copy-on-write: probed after each admission "
                         f"and step)")
        if self.shape == SEQUENCE and m.get("copy_on_write"):
            parts.append(f"before a write into a partial last block -> {c}.{m['copy_on_write']}(seq_id, block_idx)")
        if self.per_id.get("can_allocate_blocks"):
            parts.append("can_allocate asked in blocks")
        for role, shown in (("can_allocate", "can_allocate"), ("can_append", "can_append"), ("num_free", "free count"),
                            ("free_ids", "free list"), ("ref_counts", "ref counts")):
            if m.get(role):
                parts.append(f"{shown} <- {c}.{m[role]}")
        missing = [w for r, w in (("num_free", "free count"), ("free_ids", "free list")) if not m.get(r)]
        tail = f"; not found: {', '.join(missing)}" if missing else ""
        return f"{self.shape.replace('_', ' ')} allocator ({self.where}): " + ", ".join(parts) + tail


def _sig(fn: Any) -> Optional[inspect.Signature]:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def required(cls: type, name: str) -> Optional[list[inspect.Parameter]]:
    """The required positional parameters of ``cls.name`` (self excluded); None if not a method."""
    fn = getattr(cls, name, None)
    if not callable(fn) or isinstance(fn, type):
        return None
    sig = _sig(fn)
    if sig is None:
        return []
    params = list(sig.parameters.values())
    if params and params[0].name in ("self", "cls") and not isinstance(inspect.getattr_static(cls, name, None),
                                                                         staticmethod):
        params = params[1:]
    return [p for p in params if p.kind in _POSITIONAL and p.default is p.empty]


def takes(cls: type, name: str, n: int) -> bool:
    """Whether ``cls.name`` can be called with ``n`` positional arguments."""
    fn = getattr(cls, name, None)
    sig = _sig(fn) if callable(fn) else None
    if sig is None:
        return callable(fn)
    first = next(iter(sig.parameters.values()), None)
    args = [object()] * (n + (1 if first is not None and first.name in ("self", "cls")
                              and not isinstance(inspect.getattr_static(cls, name, None), staticmethod) else 0))
    try:
        sig.bind(*args)
        return True
    except TypeError:
        return False


def _first(cls: type, names: tuple[str, ...], nargs: tuple[int, ...], exclude: set) -> Optional[str]:
    for name in names:
        if name in exclude:
            continue
        req = required(cls, name)
        if req is None:
            continue
        if len(req) in nargs and all(takes(cls, name, len(req)) for _ in (0,)):
            return name
    return None


def _counter(cls: type) -> Optional[str]:
    """The free count: a method taking nothing, or a property (read on the instance)."""
    for name in FREE_COUNT:
        raw = inspect.getattr_static(cls, name, None)
        if isinstance(raw, property):
            return name
        req = required(cls, name)
        if req is not None and not req:
            return name
    return None


def infer(cls: type) -> Optional[AllocMap]:
    """The shape and mapping of ``cls``, or None where neither shape fits."""
    seq = _infer_sequence(cls)
    return seq if seq is not None else _infer_free_list(cls)


def _infer_free_list(cls: type) -> Optional[AllocMap]:
    alloc = _first(cls, FREE_LIST_ROLES["allocate"], (1,), set())
    per_alloc = False
    if alloc is not None and (required(cls, alloc)[0].name in ("seq", "sequence", "seq_id", "request", "req")
                              or "token" in required(cls, alloc)[0].name):  # a count of tokens is not of blocks
        alloc = None
    if alloc is None:
        alloc = _first(cls, FREE_LIST_ROLES["allocate"], (0,), set())
        per_alloc = alloc is not None and not _optional_count(cls, alloc)  # allocate(num_blocks=1): called with n
    free = _first(cls, FREE_LIST_ROLES["free"], (1,), {alloc})
    if alloc is None or free is None:
        return None
    per_free = one_id(required(cls, free)[0])
    share = _first(cls, SHARE, (1,), {alloc, free})
    methods = {"allocate": alloc, "free": free, "can_allocate": _first(cls, CAN_ALLOCATE, (1,), set()),
               "num_free": _counter(cls), "share": share}
    return AllocMap(FREE_LIST, methods, {"allocate": per_alloc, "free": per_free,
                                         "share": bool(share) and one_id(required(cls, share)[0])})


def _optional_count(cls: type, name: str) -> bool:
    """Whether ``cls.name``'s first parameter is an optional count of blocks (``num_blocks=1``)."""
    sig = _sig(getattr(cls, name))
    params = [p for p in (sig.parameters.values() if sig else ()) if p.name not in ("self", "cls")]
    return bool(params) and params[0].kind in _POSITIONAL and params[0].default is not params[0].empty and \
        params[0].name in ("n", "num", "count", "k", "size", "num_blocks", "n_blocks", "num_pages", "n_pages")


def _infer_sequence(cls: type) -> Optional[AllocMap]:
    alloc = _first(cls, SEQUENCE_ROLES["allocate_sequence"], (2,), set())
    if alloc is None:  # add the sequence, then grow it: add_sequence(seq_id), append_tokens(seq_id, n=1)
        return _infer_add_and_grow(cls)
    append = _first(cls, SEQUENCE_ROLES["append_token"], (1,), {alloc})
    free = _first(cls, SEQUENCE_ROLES["free_sequence"], (1,), {alloc, append})
    table = _first(cls, TABLE_METHODS, (1,), {alloc, append, free})
    # no decode growth (allocate(request_id, n_tokens) / free(request_id) only): Step is not drawn
    no_append = append is None and _seq_id_param(required(cls, alloc)[0])
    if alloc is None or (append is None and not no_append) or free is None:
        return None
    methods = {"allocate_sequence": alloc, "append_token": append, "free_sequence": free, "block_table": table,
               "can_allocate": _first(cls, CAN_ALLOCATE, (1,), set()),
               "can_append": _first(cls, CAN_APPEND, (1,), set()), "num_free": _counter(cls),
               "fork": None if no_append else _first(cls, FORK, (2,), {alloc, append, free})}
    if methods["fork"]:
        methods["copy_on_write"] = _first(cls, COPY_ON_WRITE, (2,), {alloc, append, free})
    per = {"no_append": True} if no_append else {}
    can = methods["can_allocate"]
    if can and "block" in required(cls, can)[0].name.lower():  # can_allocate(num_blocks): asked in blocks
        per["can_allocate_blocks"] = True
    return AllocMap(SEQUENCE, methods, per)


def _seq_id_param(p: inspect.Parameter) -> bool:
    """A parameter naming a sequence or request (``seq_id``, ``request_id``, ``rid``...)."""
    name = p.name.lower()
    return name in ("seq", "sid", "rid", "uid", "key", "owner", "handle") or any(
        w in name for w in ("seq", "req", "request")) or name.endswith("_id") and "block" not in name


ADD_SEQUENCE = ("add_sequence", "add_seq", "new_sequence", "create_sequence", "register_sequence", "start_sequence",
                "add_request", "allocate_sequence", "add")


def _infer_add_and_grow(cls: type) -> Optional[AllocMap]:
    add = _first(cls, ADD_SEQUENCE, (1,), set())
    grow = next((n for n in SEQUENCE_ROLES["append_token"] if n != add and required(cls, n) is not None
                 and len(required(cls, n)) in (1, 2) and takes(cls, n, 2)), None)
    free = _first(cls, SEQUENCE_ROLES["free_sequence"], (1,), {add, grow})
    if add is None or grow is None or free is None:
        return None
    methods = {"allocate_sequence": add, "append_token": grow, "free_sequence": free,
               "block_table": _first(cls, TABLE_METHODS, (1,), {add, grow, free}),
               "can_allocate": _first(cls, CAN_ALLOCATE, (1,), set()),
               "can_append": _first(cls, CAN_APPEND, (1,), set()), "num_free": _counter(cls),
               "fork": _first(cls, FORK, (2,), {add, grow, free})}
    return AllocMap(SEQUENCE, methods, {"add_then_grow": True, "grow_by_one": len(required(cls, grow)) == 2})


def returns_value(cls: type, name: Optional[str]) -> bool:
    """Whether ``cls.name`` returns something on some path (``return x``, x not None): then a
    ``None`` return is a refusal; a method that returns nothing succeeds with ``None``."""
    import ast
    import textwrap
    fn = getattr(cls, name, None) if name else None
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (TypeError, OSError, SyntaxError, IndentationError):
        return True
    top = tree.body[0] if tree.body else None
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and node is not top:
            continue
        if isinstance(node, ast.Return) and node.value is not None and not (
                isinstance(node.value, ast.Constant) and node.value.value is None):
            return True
    return False


def fill_fields(amap: AllocMap, obj: Any, num_blocks: int) -> None:
    """The internals read on a built instance: the free list, ref counts and (for the
    sequence shape without a table method) the table dict."""
    def ints(v: Any) -> bool:
        try:
            items = list(v.keys()) if isinstance(v, Mapping) else list(v)
        except TypeError:
            return False
        return all(type(x) is int or is_object(x) for x in items)

    attrs = vars(obj) if hasattr(obj, "__dict__") else {}
    if not amap.get("free_ids"):
        for name in FREE_FIELDS + tuple(k for k in attrs if "free" in k.lower() and k not in FREE_FIELDS):
            v = attrs.get(name)
            mask = isinstance(v, list) and len(v) == num_blocks and v and all(type(x) is bool for x in v)
            if v is not None and not isinstance(v, (str, bytes, int)) and hasattr(v, "__len__") and (
                    ints(v) and len(v) <= num_blocks or mask) and not callable(v):
                amap.methods["free_ids"] = name
                break
    if not amap.get("num_free"):  # a counter kept as a plain int attribute
        for name in FREE_COUNT:
            v = attrs.get(name)
            if type(v) is int:
                amap.methods["num_free"] = name
                break
    if not amap.get("ref_counts"):
        for name in REF_FIELDS:
            v = attrs.get(name)
            if isinstance(v, (list, tuple)) and len(v) == num_blocks and ints(v):
                amap.methods["ref_counts"] = name
                break
    if amap.shape == SEQUENCE and not amap.get("block_table"):
        def named(words: tuple) -> tuple:
            return tuple(k for k in attrs if any(w in k.lower() for w in words) and k not in TABLE_FIELDS
                         and "free" not in k.lower() and k.lower().strip("_") not in ("blocks", "pages"))
        for name in TABLE_FIELDS + named(("table", "seq", "req", "alloc")) + named(("block", "page")):
            if isinstance(attrs.get(name), dict):
                amap.methods["block_table"] = name
                break


def declared(cls: type, table: Mapping[str, Any], where: str) -> AllocMap:
    """A mapping declared as ``[tool.kvspec.alloc]`` / ``kvspec_alloc``: ``shape`` plus role
    = method name. Raises ValueError (a one-line reason) for a mistake."""
    shape = table.get("shape")
    roles = {FREE_LIST: FREE_LIST_ROLES, SEQUENCE: SEQUENCE_ROLES}.get(shape)
    if roles is None:
        raise ValueError(f"{where}: shape must be \"{FREE_LIST}\" or \"{SEQUENCE}\", not {shape!r}")
    methods: dict[str, Optional[str]] = {}
    per_id: dict[str, bool] = {}
    for key, value in table.items():
        if key == "shape":
            continue
        if key in ("allocate_per_id", "free_per_id", "share_per_id", "add_then_grow", "grow_by_one"):
            per_id[key[:-7] if key.endswith("_per_id") else key] = bool(value)
            continue
        if key not in ALL_ROLES:
            raise ValueError(f"{where}: unknown role {key!r} (known: shape, {', '.join(ALL_ROLES)}, "
                             f"allocate_per_id, free_per_id)")
        if not isinstance(value, str) or not value.isidentifier():
            raise ValueError(f"{where}: {key} must name a method or attribute, not {value!r}")
        methods[key] = value
    for role in roles:
        if role not in methods:
            raise ValueError(f"{where}: the {shape} shape needs {role} = \"<your method>\"")
        if not callable(getattr(cls, methods[role], None)):
            raise ValueError(f"{where}: {role} = {methods[role]!r}, but {cls.__name__} has no method {methods[role]!r}")
    if shape == SEQUENCE and "block_table" not in methods:
        raise ValueError(f"{where}: the sequence shape needs block_table = \"<method(seq_id) or dict attribute>\"")
    if shape == FREE_LIST:
        for role in ("allocate", "free"):
            if role not in per_id:
                req = required(cls, methods[role]) or []
                per_id[role] = len(req) == 0 if role == "allocate" else bool(req) and one_id(req[0])
    return AllocMap(shape, methods, per_id, where)


# Radix / trie prefix caches (kvspec.alloc.radix): method and node-field names, read by name.
MATCH = ("match_prefix", "match", "lookup_prefix", "find_prefix", "longest_prefix", "match_blocks")
MATCH_NODE = ("match_node", "match_prefix_node", "match_and_lock")
INSERT = ("insert", "insert_prefix", "cache_blocks", "add_prefix", "cache_prefix")
EVICT = ("evict", "evict_lru", "evict_blocks", "evict_tokens", "evict_n")
LOCK = ("inc_lock_ref", "lock", "lock_node", "inc_ref", "inc_ref_path", "pin")
UNLOCK_NODE = ("dec_lock_ref", "unlock", "unlock_node", "dec_ref_path", "dec_ref", "release_node", "unpin")
UNLOCK_TOKENS = ("release", "release_prefix", "unlock_prefix", "unmatch")
EVICTABLE = ("evictable_size", "num_evictable", "num_evictable_blocks", "evictable_blocks", "get_evictable_size",
             "evictable_tokens", "num_evictable_tokens")
ROOT_FIELDS = ("root", "root_node", "_root", "tree", "head")
KEY_FIELDS = ("token_ids", "key", "tokens", "edge", "label", "keys", "prefix")
VALUE_FIELDS = ("kv_block_ids", "value", "values", "block_ids", "blocks", "kv_indices", "pages", "page_ids")
LOCK_FIELDS = ("ref_count", "lock_ref", "lock", "locks", "refs", "ref", "lock_count", "refcount")

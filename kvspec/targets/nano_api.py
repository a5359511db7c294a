"""The nano-vllm API as kvspec drives it: the generations of ``can_allocate``/``allocate``
(boolean, counted, chunked, layout), the exact calls the driver makes in each (``NANO_CALLS``,
which ``kvspec.targets.contract`` checks at load and ``kvspec api`` prints), how a
generation is detected from a class's signatures, and how a manager is built (its own
block size where it insists on one, requests scaled to it). See ``nanovllm_target``
for the whole adapter. It is longer than 450 lines because the generations, their call
tables and the code reading that tells them apart (admission gates included) are one
decision, read together; splitting them would scatter it."""
from __future__ import annotations

import ast
import bisect
import inspect
import sys
import textwrap
from typing import Any, Callable, NamedTuple, Optional

from kvspec.targets.base import TargetError
from kvspec.targets.names import Names

BOOLEAN, COUNTED, CHUNKED = "boolean", "counted", "chunked"  # the can_allocate/allocate generations
LAYOUT = "layout"  # v1-style: the scheduler counts tokens (get_token_layout) and asks can_allocate(num_tokens)
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
    LAYOUT: (
        NanoCall("get_token_layout", ("seq",), "(tokens hit in held blocks, tokens hit in free cached blocks, "
                                               "new tokens): read-only"),
        NanoCall("can_allocate", ("num_tokens",), "bool: that many tokens fit (kvspec passes the free hit + new "
                                                  "tokens, as the scheduler does)"),
        NanoCall("allocate", ("seq",), "None; reads seq.num_new_tokens (kvspec sets the layout's new tokens first), "
                                       "sets seq.block_table and seq.num_cached_tokens (the hit)"),
        NanoCall("deallocate", ("seq",), "None"),
        NanoCall("can_append", ("seq", "num_new_tokens"), "bool: num_new_tokens more tokens fit (after "
                                                          "seq.append_token)"),
        NanoCall("may_append", ("seq",), "None; reads seq.num_new_tokens (kvspec sets it first): blocks for the "
                                         "new tokens, hashes the blocks they fill"),
    ),
}

NANO_GENERATIONS: dict[str, str] = {
    BOOLEAN: "can_allocate(seq) -> bool and allocate(seq) (nano-vllm 2025, nano-vllm-fork)",
    COUNTED: "can_allocate(seq) -> cached blocks or -1, allocate(seq, num_cached_blocks), hash_blocks after "
             "each forward (later nano-vllm)",
    CHUNKED: "can_allocate(seq, num_tokens) and allocate(seq, num_tokens): prefill in chunks of one block of "
             "tokens (chunked-prefill forks)",
    LAYOUT: "can_allocate(num_tokens) with get_token_layout(seq), allocate(seq) and can_append(seq, num_new_tokens) "
            "/ may_append(seq) reading seq.num_new_tokens (v1-style nano-vllm: the scheduler counts the tokens; after "
            "each forward num_cached_tokens += num_new_tokens)",
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


_COUNT_NAMES = ("num_tokens", "num_new_tokens", "n_tokens", "n", "count", "tokens_needed", "num_required_tokens")


def counts_tokens(fn: Any) -> bool:
    """Whether ``fn``'s one argument is a number of tokens, not a Sequence: annotated
    ``int``, or named as a count (``can_allocate(self, num_tokens: int)``, v1-style
    nano-vllm, whose scheduler counts the tokens with ``get_token_layout``)."""
    params = [p for p in _params(fn) or () if p.kind in _POSITIONAL]
    if not params:
        return False
    p = params[0]
    a = p.annotation
    ann = "" if a is p.empty else a if isinstance(a, str) else getattr(a, "__name__", str(a))
    ann = ann.strip().strip("'\"")
    if ann:
        return ann == "int"
    return p.name in _COUNT_NAMES or (p.name.startswith("num_") and p.name.endswith("tokens"))


def gate_counts_hits(cls: type, names: Optional[Names] = None) -> Optional[bool]:
    """Whether the admission gate (``can_allocate``) can see prefix hits, read from its code:
    False when it takes the Sequence and neither it nor a method of the manager it calls reads
    anything hash-named (it can only count every block of the prompt against the free ones:
    nano-vllm's admission, ``admit_all_blocks``); True when it reads one; None when the gate
    takes a count (the scheduler counts the hits: v1-style) or its code cannot be read."""
    import ast
    import textwrap
    gate = _method(cls, names, "can_allocate")
    if gate is None or counts_tokens(gate):
        return None
    todo, seen = [gate], set()
    while todo:
        fn = todo.pop()
        if fn in seen:
            continue
        seen.add(fn)
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        except (TypeError, OSError, SyntaxError, IndentationError):
            return None
        for node in ast.walk(tree):
            name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
            if "hash" in name.lower():
                return True
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                attr = inspect.getattr_static(cls, node.attr, None)
                target = attr.fget if isinstance(attr, property) else attr
                if inspect.isfunction(target):
                    todo.append(target)
    return False


_COUNT_PARAMS = ("num_tokens", "n_tokens", "num_new_tokens", "new_tokens", "count", "n", "tokens", "num")


def optional_count(fn: Any) -> bool:
    """Whether ``fn(seq, num_tokens=None)`` takes an optional token count second: the chunked
    generation with a default (RichardHuang2006/Mini-vLLM's ``can_allocate(sequence,
    num_tokens=None)``, which its scheduler asks with 1 before a decode step)."""
    params = [p for p in (_params(fn) or []) if p.kind in _POSITIONAL]
    return len(params) >= 2 and params[0].default is params[0].empty and params[1].default is not params[1].empty \
        and params[1].name in _COUNT_PARAMS


def chunked_by_default(cls: type, names: Optional[Names] = None) -> bool:
    """can_allocate and allocate both take ``(seq, num_tokens=None)`` and there is no
    can_append: driven as the chunked generation, decode = ``can_allocate(seq, 1)`` /
    ``allocate(seq, 1)``, as such a manager's scheduler does."""
    ca, al = _method(cls, names, "can_allocate"), _method(cls, names, "allocate")
    return ca is not None and al is not None and _method(cls, names, "can_append") is None \
        and _required(ca) == 1 and _required(al) == 1 and optional_count(ca) and optional_count(al)


def missing_nano_methods(cls: type, names: Optional[Names] = None) -> list[str]:
    """The nano-vllm methods ``cls`` lacks (by kvspec's names, through ``names``); a chunked
    manager may do without can_append/may_append."""
    missing = [m for m in NANO_METHODS if _method(cls, names, m) is None]
    ca = _method(cls, names, "can_allocate")
    if ca is not None and (_required(ca) >= 2 or chunked_by_default(cls, names)):
        missing = [m for m in missing if m not in ("can_append", "may_append")]
    return missing


def detect_nano_api(cls: type, names: Optional[Names] = None) -> str:
    """BOOLEAN, COUNTED, CHUNKED or LAYOUT (see the module doc); raises TargetError for none."""
    missing = missing_nano_methods(cls, names)
    if missing:
        raise TargetError(f"{cls.__name__} lacks the nano-vllm BlockManager methods {', '.join(missing)}")
    ca = _method(cls, names, "can_allocate")
    nc, n = _required(ca), _required(_method(cls, names, "allocate"))
    if chunked_by_default(cls, names):
        return CHUNKED
    if nc == 1 and n == 1 and counts_tokens(ca):
        if _method(cls, names, "get_token_layout") is None:  # then no generation kvspec drives fits
            try:
                shown = str(inspect.signature(ca).replace(return_annotation=inspect.Signature.empty))
            except (TypeError, ValueError):
                shown = "(...)"
            raise TargetError(f"{cls.__name__}.can_allocate{shown} cannot be called as can_allocate(seq: Sequence) "
                              f"-> bool; a can_allocate(num_tokens) is driven as the v1-style generation, whose "
                              f"scheduler counts the tokens with get_token_layout(seq), which {cls.__name__} does "
                              f"not have (kvspec api lists the calls kvspec makes)")
        return LAYOUT  # the contract check then asks for can_append(seq, num_new_tokens) too
    if nc >= 2 and n in (2, 3):
        return CHUNKED
    if nc == 1 and n == 2 and _method(cls, names, "hash_blocks") is not None:
        return COUNTED
    if nc == 1 and n == 1:
        return BOOLEAN
    raise TargetError(f"{cls.__name__}: can_allocate takes {nc} and allocate takes {n} required arguments: expected "
                      f"can_allocate(seq) with allocate(seq), or with allocate(seq, num_cached_blocks) and "
                      f"hash_blocks(seq), or the chunked can_allocate(seq, num_tokens) with allocate(seq, num_tokens)")


# -- reading a manager -------------------------------------------------------------------
def free_tiers(cls: type, free_attr: str) -> tuple[str, ...]:
    """The manager's other free pools, as its own code counts free blocks: the attributes
    whose ``len`` its source adds to ``len(self.<free_attr>)``. A manager that keeps freed
    cached blocks apart (``num_free_blocks = len(self.free_block_ids) +
    len(self.cached_blocks)``, an LRU OrderedDict of hash -> block id, evicted when the free
    list is empty) has two tiers; the free queue is both, the free list first."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (TypeError, OSError, SyntaxError, IndentationError):
        return ()

    def terms(node: ast.AST) -> list:
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return terms(node.left) + terms(node.right)
        return [node]

    def len_of(node: ast.AST) -> Optional[str]:
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "len"
                and len(node.args) == 1 and isinstance(node.args[0], ast.Attribute)
                and isinstance(node.args[0].value, ast.Name) and node.args[0].value.id == "self"):
            return node.args[0].attr
        return None

    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            attrs = [a for a in map(len_of, terms(node)) if a is not None]
            if free_attr in attrs:  # a sum with the held blocks (a total, in an assert) is no free pool
                out += [a for a in attrs if a != free_attr and a not in out and not any(
                    w in a.lower() for w in ("used", "alloc", "held", "active", "running"))]
    return tuple(out)


def tier_ids(pool: Any, num_blocks: int) -> list:
    """The block ids of a free tier in reuse order: a list or deque as is; a mapping's
    values where they are block ids (hash -> block id), else its keys."""
    if isinstance(pool, dict):
        values = list(pool.values())
        if all(type(v) is int and 0 <= v < num_blocks for v in values):
            return values
        return list(pool.keys())
    return list(pool)


# -- building a manager ------------------------------------------------------------------
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def caching_switch(cls: type) -> Optional[str]:
    """The constructor's prefix-caching switch parameter (or its config's field), if it has one."""
    params = _params(cls.__init__) if isinstance(cls, type) else _params(cls)
    found = next((p.name for p in params or () if p.name in CACHING_SWITCHES), None)
    if found is None and config_parameter(cls) is not None:
        found = next((f for f in config_fields(cls, read_only=True) if f in CACHING_SWITCHES), None)
    return found


# -- a constructor that takes a config object ----------------------------------------------
# The config's fields kvspec fills, by meaning, as nano-vllm-style engines name them.
CONFIG_BLOCKS = ("num_kvcache_blocks", "num_blocks", "num_gpu_blocks", "num_cache_blocks", "max_cached_blocks",
                 "total_blocks", "num_kv_blocks")
CONFIG_BLOCK_SIZE = ("kvcache_block_size", "block_size", "page_size", "tokens_per_block", "kv_block_size")


def config_parameter(build: Any) -> Optional[inspect.Parameter]:
    """The one required parameter of a constructor that takes a config object
    (``BlockManager(config)``, as MinivLLM-style engines build it), else None."""
    params = _params(build.__init__) if isinstance(build, type) else _params(build)
    required = [p for p in params or () if p.kind in _POSITIONAL and p.default is p.empty]
    if len(required) != 1:
        return None
    p = required[0]
    a = p.annotation
    ann = "" if a is p.empty else a if isinstance(a, str) else getattr(a, "__name__", "")
    return p if ("config" in p.name.lower() or p.name in ("cfg", "conf") or ann.endswith("Config")) else None


def config_class(build: Any) -> Optional[type]:
    """The package's Config class: the parameter's annotation, else a ``Config`` in the
    constructor's module, else ``<package>.config.Config`` (imported only if already
    importable without error)."""
    p = config_parameter(build)
    owner = build if isinstance(build, type) else None
    modname = getattr(owner or build, "__module__", "") or ""
    module = sys.modules.get(modname)
    a = p.annotation if p is not None else inspect.Parameter.empty
    if isinstance(a, type):
        return a
    names = [a.strip("'\"").rsplit(".", 1)[-1]] if isinstance(a, str) and a else []
    for n in names + ["Config"]:
        c = getattr(module, n, None)
        if isinstance(c, type):
            return c
    top = modname.split(".", 1)[0]
    for cand in (f"{top}.config", f"{modname.rpartition('.')[0]}.config"):
        if not cand or cand.startswith("."):
            continue
        try:
            from kvspec.targets.nano_loader import import_module_light
            c = getattr(import_module_light(cand), "Config", None)
        except Exception:
            continue
        if isinstance(c, type):
            return c
    return None


def config_fields(build: Any, read_only: bool = False) -> list[str]:
    """The config attributes the constructor reads (``config.num_kvcache_blocks``), then
    (unless ``read_only``) the Config class's own fields."""
    p = config_parameter(build)
    if p is None:
        return []
    out: list[str] = []
    try:
        src = textwrap.dedent(inspect.getsource(build.__init__ if isinstance(build, type) else build))
        for node in ast.walk(ast.parse(src)):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == p.name
                    and node.attr not in out):
                out.append(node.attr)
    except (TypeError, OSError, SyntaxError, IndentationError):
        pass
    cfg = None if read_only else config_class(build)
    if cfg is not None:
        import dataclasses
        fields = [f.name for f in dataclasses.fields(cfg)] if dataclasses.is_dataclass(cfg) else [
            k for k, v in vars(cfg).items() if not k.startswith("_") and not callable(v)]
        out += [f for f in fields if f not in out]
    return out


def build_config(build: Any, num_blocks: int, block_size: int, caching: Optional[bool] = None) -> Any:
    """A config object for ``build``: the package's Config with its defaults (its
    ``__init__``/``__post_init__``, which load model files, is not run), the block count,
    block size and caching switch set to the run's."""
    import dataclasses
    cfg_cls = config_class(build)
    values: dict[str, Any] = {}
    if cfg_cls is not None and dataclasses.is_dataclass(cfg_cls):
        for f in dataclasses.fields(cfg_cls):
            if f.default is not dataclasses.MISSING:
                values[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                values[f.name] = f.default_factory()  # type: ignore[misc]
    for name in config_fields(build):
        if name in CONFIG_BLOCKS:
            values[name] = num_blocks
        elif name in CONFIG_BLOCK_SIZE:
            values[name] = block_size
        elif name in CACHING_SWITCHES and caching is not None:
            values[name] = caching
    if cfg_cls is None:
        from types import SimpleNamespace
        return SimpleNamespace(**values)
    try:
        obj = cfg_cls.__new__(cfg_cls)
    except TypeError:
        from types import SimpleNamespace
        return SimpleNamespace(**values)
    for k, v in values.items():
        object.__setattr__(obj, k, v)
    return obj


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


def tied_block_size(seq_cls: Optional[type]) -> Optional[int]:
    """The package Sequence's own block size where other sizes of the class are tied to it
    (``block_size = 256; logical_page_size = 32``: pages divide blocks). The package's
    scheduler sets them together from its config; kvspec sets only block_size, so a run at
    another block size would break the tie (a page larger than a block) and report kvspec's
    inconsistency as the manager's crash. Such a Sequence runs at its own block size, with
    the machines' requests scaled to it (``Scale``)."""
    from kvspec.targets.nano_sequence import Sequence as OwnSequence
    if seq_cls is None or seq_cls is OwnSequence:
        return None
    own = getattr(seq_cls, "block_size", None)
    if not isinstance(own, int) or isinstance(own, bool) or own <= 1:
        return None
    for klass in seq_cls.__mro__:
        for name, v in vars(klass).items():
            if (name != "block_size" and "size" in name and isinstance(v, int) and not isinstance(v, bool)
                    and 1 < v < own and own % v == 0):
                return own
    return None


def build_manager(cls: type, make: Optional[Callable[..., Any]], num_blocks: int, block_size: int,
                  caching: bool, seq_cls: Optional[type] = None) -> Any:
    """``(make or cls)(num_blocks, block_size[, enable_prefix_caching=caching])``; where the
    constructor refuses ``block_size`` (AssertionError, ValueError), with the class's own;
    where the package's Sequence ties other sizes to its block size, with that one."""
    build = make or cls
    tied = tied_block_size(seq_cls)
    if tied is not None and tied > block_size:
        block_size = tied
    if config_parameter(build) is not None:  # BlockManager(config), built as the package's engine builds it
        try:
            return build(build_config(build, num_blocks, block_size, caching))
        except (AssertionError, ValueError):
            own = own_block_size(cls, seq_cls)
            if own is None or own == block_size:
                raise
            return build(build_config(build, num_blocks, own, caching))
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



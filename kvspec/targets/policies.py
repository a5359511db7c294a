"""Policies as declared traits: what a target states about itself, validated, and never
read off the code under test.

A declaration is a mapping (a class attribute ``kvspec_traits`` or the ``[tool.kvspec]``
table of the ``pyproject.toml`` nearest the target's file) with these keys, all optional:

====================  ==================================================================
key                   values
====================  ==================================================================
prefix_caching        "on", "off" or "both": the modes the target supports (the
                      machines draw one per example; ``kvspec mc --caching``)
free_order            "lru_tail_first" (vLLM: freed blocks to the back, a request's tail
                      first), "mru" (a free call's blocks to the front: most recently
                      freed reused first), "fifo" (to the back, a request's head first),
                      "sorted" (the free queue kept in block-id order), "any" (no order:
                      kvspec follows the target's choice of free blocks and checks only
                      that they were free; the default for code that states no order)
unhashed_free_first   true: freed blocks without a hash go to the front (vLLM >= 0.11);
                      with prefix caching off every block is unhashed
whole_prompt_hits     true: a prefix hit may cover the whole prompt (the last token's KV
                      is then read from the cache, and KV_INTEGRITY checks it)
null_block            the null block's id, or "none" / false
misuse_errors         misuse kind -> exception class (or its name): the documented error
                      for that misuse ("*": every misuse); a class or a list of classes
                      means every misuse. Kinds: ``kvspec.spec.misuse.MISUSE_KINDS``
admit_all_blocks      (cache level) admission needs free blocks for the whole request,
                      its cached prefix included (nano-vllm's boolean can_allocate)
free_evicts           (cache level) a block leaves the prefix cache when freed
partial_block_caching true: the last, partly filled block is hashed and cached too
                      (copy-on-write): I3 and MAX_HIT relaxed, KV_INTEGRITY still checked
lru_refresh_on_lookup true: the admission check or a lookup moves a hit free block to
                      the MRU end (back) of the free queue
index                 "all" (vLLM: every block with a content is in the index),
                      "latest_wins" (one block per hash, the latest cached replaces it:
                      nano-vllm's dict), "first_wins" (one block per hash, the first keeps it)
====================  ==================================================================

Sub-tables ``[tool.kvspec.names]`` and ``[tool.kvspec.protocol]`` (a name map and extra
protocol calls, read by the loader) pass through validation untouched.

Undeclared keys take the target kind's defaults (vLLM's policies); a user target that
declares nothing at all gets them with a note on stderr, printed once. The one exception
is ``free_order``: which free block a user's own allocator reuses first is a cache-hit
policy, not correctness, and nothing in unknown code says which order it means, so code
that does not declare one is checked under "any" (the note says so). kvspec's shipped
declarations keep the order their release documents. A declaration
kvspec ships (``KNOWN``) applies only to the files of the installed distribution it was
written for, found by the module's file, never by its name: a fork that keeps the
package name ``nanovllm`` is the user's own code. ``Traits.declaration`` says which
declaration was used, and every output shows it.
"""
from __future__ import annotations

import builtins
import dataclasses
import functools
import importlib
import sys
from pathlib import Path
from typing import Any, Mapping, Optional

from kvspec.errors import UsageError
from kvspec.spec.misuse import MISUSE_KINDS

FREE_ORDERS = ("lru_tail_first", "mru", "fifo", "sorted", "any")
# what a user's code that states no free order is checked under (see the module doc)
UNDECLARED_FREE_ORDER = "any"
CACHING_MODES = ("on", "off", "both")
INDEX_POLICIES = ("all", "latest_wins", "first_wins")
BOOL_KEYS = ("unhashed_free_first", "whole_prompt_hits", "admit_all_blocks", "free_evicts",
             "partial_block_caching", "lru_refresh_on_lookup")
KEYS = ("prefix_caching", "free_order", "null_block", "misuse_errors") + BOOL_KEYS + ("index",)
# Sub-tables other parts of kvspec read from the same [tool.kvspec] table (the loader's
# name map and extra protocol calls): not policies, passed through validation untouched.
SUBTABLES = ("names", "protocol")

# vLLM's policies, what a target that declares nothing is checked against: LRU with a
# request's tail first, everything freed to the back (vLLM >= 0.11 also sends unhashed
# blocks to the front: its own classes get that from KNOWN["vllm"]), null block 0.
VLLM_DEFAULTS: dict[str, Any] = {
    "prefix_caching": "both", "free_order": "lru_tail_first", "unhashed_free_first": False,
    "whole_prompt_hits": False, "null_block": 0, "misuse_errors": {}, "admit_all_blocks": False,
    "free_evicts": False,
}

# Declarations kvspec ships for released packages, keyed by distribution name: what each
# release documents (its docstrings and design notes), not what a probe of its code saw.
KNOWN: dict[str, dict[str, Any]] = {
    # vllm.v1.core.block_pool.free_blocks: "LIFO reuse of non-cached blocks" to the front
    # BlockPool.get_new_blocks over capacity: raise ValueError("Cannot get N free blocks from the pool")
    "vllm": {"unhashed_free_first": True, "misuse_errors": {"over_alloc": "ValueError"}},
    # boolean can_allocate counts every block; deallocate's "Fix" drops a freed block's entry
    "nano-vllm-fork": {"admit_all_blocks": True, "free_evicts": True},
    # "runs a fully cached prompt as a decode step": the scheduler skips prefill when
    # num_cached_tokens == len(seq), and may_append leaves a hashed last block alone
    "nano-vllm-voxcpm": {"admit_all_blocks": True, "free_evicts": False, "whole_prompt_hits": True},
    "nano-vllm-voxcpm-hifi": {"admit_all_blocks": True, "free_evicts": False, "whole_prompt_hits": True},
    # upstream nano-vllm's 2025 block manager: freed blocks stay in hash_to_block_id
    "nano-vllm-npu": {"admit_all_blocks": True, "free_evicts": False},
}

_NOTED: set[str] = set()


def note_once(key: str, text: str) -> None:
    """Print ``text`` on stderr the first time ``key`` is seen in this process."""
    if key not in _NOTED:
        _NOTED.add(key)
        print(f"kvspec: note: {text}", file=sys.stderr)


# -- validation --------------------------------------------------------------------------
def _resolve_error(value: Any, where: str, module: Optional[str]) -> type:
    if isinstance(value, type) and issubclass(value, BaseException):
        return value
    if not isinstance(value, str) or not value:
        raise UsageError(f"{where}: misuse_errors values are exception classes or their names, not {value!r}")
    name = value.replace(":", ".")
    modname, _, attr = name.rpartition(".")
    places = []
    if modname:
        places.append(lambda: importlib.import_module(modname))
    else:
        places.append(lambda: builtins)
        if module:
            places.append(lambda: sys.modules.get(module) or importlib.import_module(module))
            pkg = module.rpartition(".")[0]
            if pkg:
                places.append(lambda: sys.modules.get(pkg) or importlib.import_module(pkg))
    for place in places:
        try:
            found = getattr(place(), attr or name, None)
        except Exception:
            found = None
        if isinstance(found, type) and issubclass(found, BaseException):
            return found
    raise UsageError(f"{where}: misuse_errors names {value!r}, which is not an exception class kvspec can find "
                     f"(use a builtin name, a name in the target's module, or module.Name)")


def _errors(value: Any, where: str, module: Optional[str]) -> tuple[tuple[str, type], ...]:
    if isinstance(value, Mapping):
        out = []
        for kind, cls in value.items():
            if kind != "*" and kind not in MISUSE_KINDS:
                raise UsageError(f"{where}: misuse_errors has unknown misuse kind {kind!r} "
                                 f"(known: *, {', '.join(MISUSE_KINDS)})")
            out.append((str(kind), _resolve_error(cls, where, module)))
        return tuple(out)
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise UsageError(f"{where}: misuse_errors as a list takes one class for every misuse; "
                             f"map misuse kinds to classes for more")
        value = value[0]
    return (("*", _resolve_error(value, where, module)),)


def validate(decl: Mapping[str, Any], where: str, module: Optional[str] = None) -> dict[str, Any]:
    """A declaration -> ``Traits`` keyword arguments; one-line UsageError for anything
    unknown or mistyped. ``module`` is where bare exception names are looked up."""
    if not isinstance(decl, Mapping):
        raise UsageError(f"{where}: the policy declaration must be a table/dict, not {type(decl).__name__}")
    out: dict[str, Any] = {}
    for key, value in decl.items():
        if key in SUBTABLES and isinstance(value, Mapping):
            continue
        if key not in KEYS:
            raise UsageError(f"{where}: unknown policy {key!r} (known: {', '.join(KEYS)})")
        if key == "prefix_caching":
            if value is True or value is False:
                value = "on" if value else "off"
            if value not in CACHING_MODES:
                raise UsageError(f"{where}: prefix_caching {value!r} is not one of {', '.join(CACHING_MODES)}")
            out[key] = value
        elif key == "free_order":
            if value not in FREE_ORDERS:
                raise UsageError(f"{where}: free_order {value!r} is not one of {', '.join(FREE_ORDERS)}")
            out[key] = value
        elif key in BOOL_KEYS:
            if not isinstance(value, bool):
                raise UsageError(f"{where}: {key} must be true or false, not {value!r}")
            out[key] = value
        elif key == "null_block":
            if value is None or value is False or value == "none":
                out["null_block"], out["null_block_id"] = False, 0
            elif value is True:
                out["null_block"], out["null_block_id"] = True, 0
            elif isinstance(value, int) and value >= 0:
                out["null_block"], out["null_block_id"] = True, value
            else:
                raise UsageError(f"{where}: null_block must be a block id (an int >= 0) or \"none\", not {value!r}")
        elif key == "index":
            if value not in INDEX_POLICIES:
                raise UsageError(f"{where}: index {value!r} is not one of {', '.join(INDEX_POLICIES)}")
            out["index_latest_wins"], out["index_first_wins"] = value == "latest_wins", value == "first_wins"
        elif key == "misuse_errors":
            pairs = _errors(value, where, module)
            out["misuse_error_map"] = pairs
            out["misuse_errors"] = tuple(dict.fromkeys(cls for _, cls in pairs))
    return out


def with_policies(base: Any, decl: Mapping[str, Any], where: str, module: Optional[str] = None,
                  declaration: Optional[str] = None) -> Any:
    """``base`` (a Traits) with ``decl`` validated and applied over it; ``declaration``
    (default: ``where``) is what outputs show as the declaration used."""
    return dataclasses.replace(base, **validate(decl, where, module), declaration=declaration or where)


def policy_keys(decl: Optional[Mapping[str, Any]]) -> frozenset[str]:
    """The policy keys a declaration states (its sub-tables are not policies)."""
    return frozenset(k for k in (decl or {}) if k not in SUBTABLES)


# -- finding a declaration -----------------------------------------------------------------
def nearest_pyproject(path: Optional[Path]) -> Optional[Path]:
    if path is None:
        return None
    d = path.resolve().parent if path.suffix else path.resolve()
    for p in (d, *d.parents):
        f = p / "pyproject.toml"
        if f.is_file():
            return f
    return None


def _pyproject_table(path: Path) -> Optional[dict]:
    import tomllib

    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise UsageError(f"{path}: cannot read [tool.kvspec]: {e}") from None
    table = data.get("tool", {}).get("kvspec")
    return table if table is None or isinstance(table, dict) else {"": table}


@functools.lru_cache(maxsize=None)
def _installed_files(dist: str) -> tuple[str, frozenset[Path]]:
    """(version, the resolved paths of the files) of installed distribution ``dist``;
    ("", empty) where it is not installed."""
    from importlib.metadata import PackageNotFoundError, distribution
    try:
        d = distribution(dist)
    except PackageNotFoundError:
        return "", frozenset()
    out = set()
    for f in d.files or ():
        try:
            out.add(Path(d.locate_file(f)).resolve())
        except (OSError, ValueError):
            continue
    return d.version or "", frozenset(out)


def module_file(cls: Optional[type], module: Optional[str] = None) -> Optional[Path]:
    """The file that defines ``cls`` (or ``module``), where there is one."""
    name = module or getattr(cls, "__module__", None)
    f = getattr(sys.modules.get(name or ""), "__file__", None)
    return Path(f) if f else None


def shipped_distribution(path: Optional[Path]) -> Optional[tuple[str, str]]:
    """(distribution, version) of the KNOWN distribution whose installed files include
    ``path``; None for any other file, whatever its package is called."""
    if path is None:
        return None
    try:
        where = Path(path).resolve()
    except (OSError, ValueError):
        return None
    for dist in KNOWN:
        version, files = _installed_files(dist)
        if where in files:
            return dist, version
    return None


def find_declaration(cls: Optional[type], source: Optional[Path] = None,
                     module: Optional[str] = None) -> tuple[Optional[Mapping[str, Any]], str]:
    """(the declaration, where it was found, in words) in precedence order:
    ``cls.kvspec_traits``, ``[tool.kvspec]`` of the pyproject.toml nearest ``source``,
    kvspec's table for the released distribution whose installed files include the
    target's file (``source``, else the module's file); (None, "") when there is none.
    A table that holds only sub-tables (names, protocol) declares no policies."""
    decl = getattr(cls, "kvspec_traits", None) if cls is not None else None
    if decl is not None:
        return decl, f"{cls.__name__}.kvspec_traits"
    py = nearest_pyproject(source)
    if py is not None:
        table = _pyproject_table(py)
        if table is not None and (policy_keys(table) or not isinstance(table, Mapping)):
            return table, f"[tool.kvspec] in {py}"
    shipped = shipped_distribution(source if source is not None else module_file(cls, module))
    if shipped is not None:
        dist, version = shipped
        return KNOWN[dist], f"kvspec's declaration for {dist} {version} (installed files)".replace("  ", " ")
    return None, ""


def declared_traits(base: Any, *, cls: Optional[type], source: Optional[Path], name: str,
                    module: Optional[str] = None, defaults: Optional[Mapping[str, Any]] = None,
                    defaults_name: str = "vLLM's", note: bool = True) -> Any:
    """``base`` with the target's declaration applied, or with ``defaults`` (vLLM's unless
    given) and a note on stderr when it declares nothing."""
    decl, where = find_declaration(cls, source, module)
    mod = module or getattr(cls, "__module__", None)
    if decl is None:
        dflt = {**(VLLM_DEFAULTS if defaults is None else defaults), "free_order": UNDECLARED_FREE_ORDER}
        if note:
            shown = ", ".join(f"{k}={v!r}" for k, v in dflt.items() if k not in ("misuse_errors", "free_order"))
            note_once(name, f"{name} declares no policies (a kvspec_traits class attribute or [tool.kvspec] "
                            f"in pyproject.toml); checking it against {defaults_name} defaults: {shown}; "
                            f"free order: not stated, so any (kvspec follows which free blocks it takes and "
                            f"checks they were free; declare free_order to check an order)")
        t = with_policies(base, dflt, f"{defaults_name} defaults", mod, declaration=f"none: {defaults_name} defaults")
        return dataclasses.replace(t, hintable=frozenset(HINTABLE))
    if not isinstance(decl, Mapping):  # before merging: "not a dict" is the user's one-line mistake
        raise UsageError(f"{where}: the policy declaration must be a table/dict, not {type(decl).__name__}")
    merged = dict(defaults or {})
    # only what the user's declaration leaves open is open to hints; kvspec's shipped
    # declaration states a whole release's documented policies: nothing is left open
    shipped = any(decl is table for table in KNOWN.values())
    if not shipped:
        merged["free_order"] = UNDECLARED_FREE_ORDER  # unless the user's declaration states one
    merged.update(decl)
    t = with_policies(base, merged, where, mod)
    return dataclasses.replace(t, hintable=frozenset() if shipped else frozenset(HINTABLE) - policy_keys(decl))


# The declared policies a finding's repro is replayed under (kvspec.check.hints), with
# the values each may take: never null_block, prefix_caching or misuse_errors (what the
# API itself fixes, or a misuse's error class, is not a policy difference).
HINTABLE: dict[str, tuple[Any, ...]] = {
    "admit_all_blocks": (True, False), "free_evicts": (True, False), "whole_prompt_hits": (True, False),
    "free_order": tuple(o for o in FREE_ORDERS if o != "any"), "unhashed_free_first": (True, False), "partial_block_caching": (True, False),
    "lru_refresh_on_lookup": (True, False), "index": INDEX_POLICIES,
}


def policy_value(traits: Any, key: str) -> Any:
    """The value of declarable policy ``key`` in ``traits``, as a declaration writes it."""
    if key == "index":
        return "latest_wins" if traits.index_latest_wins else "first_wins" if traits.index_first_wins else "all"
    return getattr(traits, key)


def declaration_of(target: Any) -> str:
    """The declaration a target is checked under, in words, for every output."""
    d = getattr(getattr(target, "traits", None), "declaration", "")
    return d or f"kvspec's own traits for target {getattr(target, 'name', '?')}"


def describe(traits: Any) -> str:
    """One line: the policies a run checks against."""
    null = f"null block {traits.null_block_id}" if traits.null_block else "no null block"
    return (f"prefix caching {traits.prefix_caching}, free order {traits.free_order}"
            + (", unhashed first" if traits.unhashed_free_first else "")
            + (", whole-prompt hits allowed" if traits.whole_prompt_hits else "") + f", {null}")

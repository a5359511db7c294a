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
                      "sorted" (the free queue kept in block-id order)
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
====================  ==================================================================

Undeclared keys take the target kind's defaults (vLLM's policies); a user target that
declares nothing at all gets them with a note on stderr, printed once.
"""
from __future__ import annotations

import builtins
import dataclasses
import importlib
import sys
from pathlib import Path
from typing import Any, Mapping, Optional

from kvspec.errors import UsageError
from kvspec.spec.misuse import MISUSE_KINDS

FREE_ORDERS = ("lru_tail_first", "mru", "fifo", "sorted")
CACHING_MODES = ("on", "off", "both")
BOOL_KEYS = ("unhashed_free_first", "whole_prompt_hits", "admit_all_blocks", "free_evicts")
KEYS = ("prefix_caching", "free_order", "null_block", "misuse_errors") + BOOL_KEYS

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
    "vllm": {"unhashed_free_first": True},
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
        elif key == "misuse_errors":
            pairs = _errors(value, where, module)
            out["misuse_error_map"] = pairs
            out["misuse_errors"] = tuple(dict.fromkeys(cls for _, cls in pairs))
    return out


def with_policies(base: Any, decl: Mapping[str, Any], where: str, module: Optional[str] = None) -> Any:
    """``base`` (a Traits) with ``decl`` validated and applied over it."""
    return dataclasses.replace(base, **validate(decl, where, module))


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


def _distribution(module: Optional[str]) -> Optional[str]:
    top = (module or "").split(".", 1)[0]
    if not top:
        return None
    try:
        from importlib.metadata import packages_distributions
        dists = packages_distributions().get(top) or []
    except Exception:
        return None
    return next((d for d in dists if d in KNOWN), None)


def find_declaration(cls: Optional[type], source: Optional[Path] = None,
                     module: Optional[str] = None) -> tuple[Optional[Mapping[str, Any]], str]:
    """(the declaration, where it was found) in precedence order: ``cls.kvspec_traits``,
    ``[tool.kvspec]`` of the pyproject.toml nearest ``source``, kvspec's table for the
    released distribution that ships ``module``; (None, "") when there is none."""
    decl = getattr(cls, "kvspec_traits", None) if cls is not None else None
    if decl is not None:
        return decl, f"{cls.__name__}.kvspec_traits"
    py = nearest_pyproject(source)
    if py is not None:
        table = _pyproject_table(py)
        if table is not None:
            return table, f"{py} [tool.kvspec]"
    dist = _distribution(module or getattr(cls, "__module__", None))
    if dist is not None:
        return KNOWN[dist], f"kvspec's declaration for {dist}"
    return None, ""


def declared_traits(base: Any, *, cls: Optional[type], source: Optional[Path], name: str,
                    module: Optional[str] = None, defaults: Optional[Mapping[str, Any]] = None,
                    defaults_name: str = "vLLM's", note: bool = True) -> Any:
    """``base`` with the target's declaration applied, or with ``defaults`` (vLLM's unless
    given) and a note on stderr when it declares nothing."""
    decl, where = find_declaration(cls, source, module)
    mod = module or getattr(cls, "__module__", None)
    if decl is None:
        dflt = dict(VLLM_DEFAULTS if defaults is None else defaults)
        if note:
            shown = ", ".join(f"{k}={v!r}" for k, v in dflt.items() if k != "misuse_errors")
            note_once(name, f"{name} declares no policies (a kvspec_traits class attribute or [tool.kvspec] "
                            f"in pyproject.toml); checking it against {defaults_name} defaults: {shown}")
        return with_policies(base, dflt, f"{defaults_name} defaults", mod)
    merged = dict(defaults or {})
    merged.update(decl)
    return with_policies(base, merged, where, mod)


def describe(traits: Any) -> str:
    """One line: the policies a run checks against."""
    null = f"null block {traits.null_block_id}" if traits.null_block else "no null block"
    return (f"prefix caching {traits.prefix_caching}, free order {traits.free_order}"
            + (", unhashed first" if traits.unhashed_free_first else "")
            + (", whole-prompt hits allowed" if traits.whole_prompt_hits else "") + f", {null}")

"""Adapting kvspec to a block manager without forking it: a name map, an observation
hook and extra protocol calls, all declared by the manager's author.

Name map. kvspec drives and reads a nano-vllm-style manager by nano-vllm's names. A
class whose names differ declares the map from kvspec's name to its own, either as a
class attribute ``kvspec_names = {"hash_to_block_id": "_prefix_index", ...}`` or as the
table ``[tool.kvspec.names]`` in the pyproject.toml nearest the class's file (the class
attribute wins). The names kvspec knows (``VOCABULARY``):

==============  ==========================================================================
where           kvspec's names
==============  ==========================================================================
manager         methods ``can_allocate allocate deallocate can_append may_append
                hash_blocks``; fields ``blocks free_block_ids used_block_ids
                hash_to_block_id block_size`` and ``free_block_set`` (the set that holds
                the truth beside a lazily cleaned free deque, see below)
block           ``ref_count hash token_ids`` (a key may be written ``Block.hash``)
sequence        ``append_token block_table num_cached_tokens num_scheduled_tokens``
==============  ==========================================================================

Undeclared names fall back to the kvspec name itself, then, conservatively, to an obvious
alias (``ALIASES``): the name with a leading underscore, ``hash_value``/``block_hash`` for
``hash``, ``ref_cnt`` for ``ref_count``, ``hash_block`` for ``hash_blocks``, ``append``
for a Sequence's ``append_token``. An alias is used only when it is the one candidate
present, and a one-line note on stderr says which was used; with two candidates kvspec
never guesses and asks for a declaration instead.

Observation hook. A manager whose state is not shaped like nano-vllm's (another free list,
another index) may define ``kvspec_observe(self) -> dict``; kvspec then reads the state
from it alone, after every operation:

``{"blocks": [(ref_count, hash_or_None, token_ids), ...],   # one per block id, in id order
  "free": [block ids, in eviction order: next reused first],
  "index": {hash: block_id or [block ids]}}                # what a prefix lookup would hit``

A hash is any hashable value; ``None`` (or -1) means the block holds no cached content.
``free`` must list each free block once; the hook reports, it must not change anything.

Free lists read without a hook. ``free_block_ids`` may be a deque or list of ids, or an
``OrderedDict``/dict whose keys are ids, in eviction order. A lazily cleaned deque (entries
whose block is no longer free are skipped when popped, and a companion set holds the
truth) is recognized only when the manager also has a set named ``free_block_set`` in the
name map, or ``<free list name>_set`` / ``<free list name minus _ids>_set`` (each also with a
leading underscore), or else the one set-valued attribute whose name contains "free": the free
queue is then the deque's entries that are in the set, each block at its first
occurrence (where a lazy pop would find it), and a block in the set that the deque never
yields is reported as a free-list problem. A bare set of free ids has no order: kvspec
refuses it and asks for the hook. Which end is reused next: the start, except for a plain
``list`` under ``free_order = "mru"``, which is read as a stack (popped from the end);
where the structure cannot say, the name map can: ``free_next = "end"`` (or ``"start"``)
in ``[tool.kvspec.names]`` or ``kvspec_names``.

Extra protocol calls. A scheduler that calls more than the nano-vllm protocol declares
those calls, ``[tool.kvspec.protocol]`` or a ``kvspec_protocol`` class attribute, mapping
a hook point to a method name (or a list of names), each called with the Sequence:

=====================  ==================================================================
hook point             when kvspec calls it
=====================  ==================================================================
after_allocate         after each successful ``allocate`` (each chunk's, when chunked)
after_prefill_chunk    after each prefill chunk is computed (the whole prompt is one
                       chunk in the unchunked generations)
after_append           after each decode token's ``may_append`` (alias: ``after_step``)
before_deallocate      before ``deallocate`` (preemption and finish)
=====================  ==================================================================

Every mistake in a declaration is a one-line UsageError (exit 2).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Mapping, Optional

from kvspec.errors import UsageError

MANAGER_METHODS = ("can_allocate", "allocate", "deallocate", "can_append", "may_append", "hash_blocks")
MANAGER_FIELDS = ("blocks", "free_block_ids", "used_block_ids", "hash_to_block_id", "block_size",
                  "free_block_set")
BLOCK_FIELDS = ("ref_count", "hash", "token_ids")
SEQUENCE_NAMES = ("append_token", "block_table", "num_cached_tokens", "num_scheduled_tokens")
VOCABULARY = MANAGER_METHODS + MANAGER_FIELDS + BLOCK_FIELDS + SEQUENCE_NAMES
FREE_NEXT = "free_next"      # [tool.kvspec.names] free_next = "start" | "end": the free list's end reused next
FREE_ENDS = ("start", "end")

# Obvious aliases beyond the leading underscore, tried only where the kvspec name is absent.
ALIASES: dict[str, tuple[str, ...]] = {
    "hash": ("hash_value", "block_hash"),
    "ref_count": ("ref_cnt",),
    "hash_blocks": ("hash_block",),
    "append_token": ("append",),
    # nano-vllm variants' other spellings of the manager's calls (issue 31): MinivLLM's decode
    # call is ``append``; incremental-prefill managers grow a table with ensure_blocks_for_prefill.
    "may_append": ("append_slot", "append_slots", "append"),
    "can_append": ("can_append_slot", "can_append_slots"),
    "can_allocate": ("can_allocate_blocks", "can_allocate_prefill"),
    "allocate": ("allocate_blocks", "ensure_blocks_for_prefill", "allocate_prefill"),
    "deallocate": ("free_blocks", "deallocate_blocks", "free"),
}

HOOK_POINTS = ("after_allocate", "after_prefill_chunk", "after_append", "before_deallocate")
HOOK_ALIASES = {"after_step": "after_append"}
OBSERVE_HOOK = "kvspec_observe"


# -- reading declarations ------------------------------------------------------------------
def _pyproject_subtable(source: Optional[Path], key: str) -> tuple[Optional[Mapping[str, Any]], str]:
    """``[tool.kvspec.<key>]`` of the pyproject.toml nearest ``source``, and where it is."""
    from kvspec.targets.policies import nearest_pyproject
    py = nearest_pyproject(Path(source)) if source is not None else None
    if py is None:
        return None, ""
    import tomllib
    try:
        data = tomllib.loads(py.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise UsageError(f"{py}: cannot read [tool.kvspec.{key}]: {e}") from None
    table = data.get("tool", {}).get("kvspec", {})
    sub = table.get(key) if isinstance(table, dict) else None
    return sub, f"[tool.kvspec.{key}] in {py}"


def _declared(cls: type, attr: str, source: Optional[Path], key: str) -> tuple[dict[str, Any], str]:
    decl = getattr(cls, attr, None)
    where = f"{cls.__name__}.{attr}"
    if decl is None:
        decl, where = _pyproject_subtable(source, key)
    if decl is None:
        return {}, ""
    if not isinstance(decl, Mapping):
        raise UsageError(f"{where}: must be a table/dict, not {type(decl).__name__}")
    return dict(decl), where


def read_names(cls: type, source: Optional[Path] = None) -> tuple[dict[str, str], str]:
    """(kvspec name -> the class's name, where it was declared); validated."""
    decl, where = _declared(cls, "kvspec_names", source, "names")
    out: dict[str, str] = {}
    for key, value in decl.items():
        if key == FREE_NEXT:  # not a name: which end of the free list is reused next
            if value not in FREE_ENDS:
                raise UsageError(f"{where}: {FREE_NEXT} must be one of {', '.join(map(repr, FREE_ENDS))}, not {value!r}")
            out[key] = value
            continue
        name = key.split(".", 1)[1] if key.startswith(("Block.", "Sequence.")) else key
        if name not in VOCABULARY:
            raise UsageError(f"{where}: unknown name {key!r} (known: {', '.join(VOCABULARY)})")
        if not isinstance(value, str) or not value.isidentifier():
            raise UsageError(f"{where}: {key} must name an attribute (a Python name), not {value!r}")
        out[name] = value
    return out, where


def read_protocol(cls: type, source: Optional[Path] = None) -> tuple[dict[str, tuple[str, ...]], str]:
    """(hook point -> method names, where it was declared); validated against ``cls``."""
    decl, where = _declared(cls, "kvspec_protocol", source, "protocol")
    out: dict[str, tuple[str, ...]] = {}
    for key, value in decl.items():
        point = HOOK_ALIASES.get(key, key)
        if point not in HOOK_POINTS:
            raise UsageError(f"{where}: unknown hook point {key!r} (known: {', '.join(HOOK_POINTS)}, after_step)")
        methods = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, (list, tuple)) else None
        if not methods or not all(isinstance(m, str) and m.isidentifier() for m in methods):
            raise UsageError(f"{where}: {key} must name a method or a list of methods, not {value!r}")
        for m in methods:
            if not callable(getattr(cls, m, None)):
                raise UsageError(f"{where}: {key} = {m!r}, but {cls.__name__} has no method {m!r}")
        out[point] = out.get(point, ()) + methods
    return out, where


# -- resolving names -----------------------------------------------------------------------
_NOTED: set = set()


def _note(text: str) -> None:
    if text not in _NOTED:
        _NOTED.add(text)
        print(f"kvspec: note: {text}", file=sys.stderr)


def _name(obj: Any) -> str:
    return obj.__name__ if isinstance(obj, type) else type(obj).__name__


class Names:
    """kvspec's names resolved against one class (and its blocks, its Sequences)."""

    def __init__(self, declared: Optional[Mapping[str, str]] = None, where: str = "", quiet: bool = False) -> None:
        self.declared = dict(declared or {})
        self.where = where
        self.quiet = quiet  # API detection probes names without saying so (the load that follows does)
        self._resolved: dict[tuple[str, str], Optional[str]] = {}

    def resolve(self, obj: Any, name: str) -> Optional[str]:
        """The attribute of ``obj`` that stands for kvspec's ``name``; None if it has none.
        Declared, else the name itself, else the one alias present (noted once). Resolved
        once per class: the instances of a class share their attribute names."""
        key = (obj if isinstance(obj, type) else type(obj), name)
        if key in self._resolved:
            return self._resolved[key]
        if name in self.declared:
            found: Optional[str] = self.declared[name]
            if not hasattr(obj, found):
                raise UsageError(f"{self.where}: {name} = {found!r}, but {_name(obj)} has no {found!r}")
        elif hasattr(obj, name):
            found = name
        else:
            present = [a for a in ("_" + name,) + ALIASES.get(name, ()) if hasattr(obj, a)]
            if len(present) > 1:
                raise UsageError(f"{_name(obj)} has no {name!r} but several candidates "
                                 f"({', '.join(present)}): declare which in [tool.kvspec.names] or kvspec_names")
            found = present[0] if present else None
            if found is not None and not self.quiet:
                _note(f"{_name(obj)}.{found} is read as kvspec's {name!r} (an alias; declare it in "
                      f"[tool.kvspec.names] to silence this)")
        self._resolved[key] = found
        return found

    def get(self, obj: Any, name: str, default: Any = AttributeError) -> Any:
        attr = self.resolve(obj, name)
        if attr is None:
            if default is AttributeError:
                raise AttributeError(f"{type(obj).__name__} has no {name!r}")
            return default
        return getattr(obj, attr)

    def has(self, obj: Any, name: str) -> bool:
        return self.resolve(obj, name) is not None

    def set(self, obj: Any, name: str, value: Any) -> None:
        setattr(obj, self.resolve(obj, name) or name, value)


def load_names(cls: type, source: Optional[Path] = None) -> Names:
    names, where = read_names(cls, source)
    return Names(names, where)


# -- free lists ------------------------------------------------------------------------------
def companion_set(owner: Any, free_attr: str, names: Optional[Names] = None) -> Optional[set]:
    """The set that holds the truth beside a lazily cleaned free deque (see the module doc):
    declared as ``free_block_set``, else ``<free_attr>_set`` or ``<free_attr minus _ids>_set``."""
    if names is not None and "free_block_set" in names.declared:
        s = getattr(owner, names.declared["free_block_set"], None)
        return s if isinstance(s, (set, frozenset)) else None
    stem = free_attr[:-4] if free_attr.endswith("_ids") else free_attr
    for cand in dict.fromkeys((f"{free_attr}_set", f"{stem}_set")):
        for name in (cand, "_" + cand.lstrip("_")):
            s = getattr(owner, name, None)
            if isinstance(s, (set, frozenset)):
                return s
    # Otherwise the one set-valued attribute whose name speaks of "free" (``_free_set``,
    # ``free_ids``): with two or more, which one holds the truth is for a declaration.
    sets = [v for k, v in vars(owner).items()
            if "free" in k.lower() and k != free_attr and isinstance(v, (set, frozenset))]
    return sets[0] if len(sets) == 1 else None


def free_next_end(free: Any, names: Optional["Names"] = None, free_order: str = "") -> bool:
    """Whether the *end* of ``free`` is the next block reused. Declared (``free_next`` in the
    name map), else read from the structure and the declared order: a plain ``list`` with
    ``free_order = "mru"`` is a stack (freed blocks appended, the next popped from the end);
    a deque, a dict and any other declared order are read from the start."""
    declared = (names.declared.get(FREE_NEXT) if names is not None else None)
    if declared is not None:
        return declared == "end"
    return type(free) is list and free_order == "mru"


def read_free_list(free: Any, truth: Optional[set] = None, key=None,
                   next_end: bool = False) -> tuple[list, list[str]]:
    """(the free queue in eviction order, problems) from a deque/list, an (Ordered)dict of
    ids, or a lazily cleaned deque with ``truth``. ``key`` maps an entry to its id.
    ``next_end``: the end of the structure is reused next (a stack; ``free_next_end``)."""
    if isinstance(free, (set, frozenset)):
        raise TypeError("the free list is a set, which has no eviction order: define kvspec_observe "
                        "(kvspec.targets.names) to give the order")
    entries = list(free.keys()) if isinstance(free, Mapping) else list(free)
    if next_end:
        entries.reverse()
    if key is not None:
        entries = [key(e) for e in entries]
    if truth is None:
        return entries, []
    seen: set = set()
    queue = []
    for e in entries:
        if e in truth and e not in seen:
            seen.add(e)
            queue.append(e)
    problems = [f"block {b} is in the free set but the free deque never yields it"
                for b in sorted(truth - seen, key=repr)]
    return queue, problems


__all__ = ["Names", "load_names", "read_names", "read_protocol", "read_free_list", "free_next_end", "companion_set",
           "VOCABULARY", "HOOK_POINTS", "OBSERVE_HOOK"]

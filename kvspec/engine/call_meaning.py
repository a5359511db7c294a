"""What a block manager's method does, read from its own code, for the engine level.

The engine level records every call a package's scheduler makes into its manager,
whatever the method is called (``kvspec.engine.recording``). What a call *means* is
read here from the method's source (never its name), as the cache-level loader reads a
manager's variants (``kvspec.targets.nano_api``):

- ``grows``: it adds blocks to a Sequence argument's ``block_table`` (``append``,
  ``extend``, ``+=``, an assignment of a list it built): an admission when the table was
  empty, a growth otherwise;
- ``clears``: it empties a Sequence argument's ``block_table`` (``clear()``, ``= []``,
  ``del``): a free (a preemption while ``schedule()`` runs, a finish otherwise);
- ``remaps``: it replaces an entry of a table in place (``seq.block_table[i] = b``:
  copy-on-write): the cache-level vocabulary has no op for it, so it is refused;
- ``publishes``: it writes an entry of the manager's hash index (an item assignment, or
  ``update``, on a field whose name holds ``hash``): a publication of hashes;
- ``mutates``: it changes the state kvspec observes at all (``scheduler_calls.mutates``);
  a method that does not is a query (``can_allocate``...).

Each Sequence method a manager method calls on its argument is followed too, and so is
each of the manager's own methods it calls (``self._take(...)``).

Arguments are bound by name and signature (``bind``); an int argument's meaning is read
from its name and, where the name says nothing, from the body: used as a count of blocks
(``range(n)`` next to ``block_table``, ``n * self.block_size``) or of tokens
(``argument_roles``).
"""
from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any, Optional

_GROW_CALLS = frozenset({"append", "extend", "insert", "__iadd__"})
_CLEAR_CALLS = frozenset({"clear"})
_INDEX_WRITES = frozenset({"update", "setdefault", "__setitem__"})


@dataclass(frozen=True)
class Meaning:
    """What one manager method does (see the module doc)."""
    method: str
    grows: bool = False
    clears: bool = False
    remaps: bool = False
    publishes: bool = False
    mutates: bool = True
    readable: bool = True     # its source could be read

    @property
    def interpretable(self) -> bool:
        """Whether kvspec can feed this call to the model: a query, or an allocation, a
        free or a publication (possibly together), never a remap."""
        return not self.remaps and (not self.mutates or self.grows or self.clears or self.publishes)

    def describe(self) -> str:
        said = [w for w, on in (("allocates blocks", self.grows), ("frees a table", self.clears),
                                 ("publishes hashes", self.publishes), ("remaps a table entry", self.remaps)) if on]
        return ", ".join(said) or ("changes state" if self.mutates else "reads only")


def _tree(fn: Any) -> Optional[ast.AST]:
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (TypeError, OSError, SyntaxError, IndentationError):
        return None


def _params(fn: Any) -> list[str]:
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []
    return names[1:] if names and names[0] in ("self", "cls") else names


def _is_table(node: ast.AST, holders: set[str]) -> bool:
    """``X.block_table`` where X is a parameter, a local bound from one, or ``self`` (a Sequence method)."""
    return isinstance(node, ast.Attribute) and node.attr == "block_table" and (
        isinstance(node.value, ast.Name) and node.value.id in holders)


def _empty(node: ast.AST) -> bool:
    return (isinstance(node, (ast.List, ast.Tuple)) and not node.elts) or (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("list", "deque")
        and not node.args)


def _read(fn: Any, holders: set[str], mgr_cls: Optional[type], seq_cls: Optional[type], seen: set) -> dict:
    """The effects of one function's body (see ``meaning``)."""
    out = {"grows": False, "clears": False, "remaps": False, "publishes": False}
    tree = _tree(fn)
    if tree is None:
        out["unreadable"] = True
        return out
    tables: set[str] = set()
    for node in ast.walk(tree):  # locals bound from a Sequence parameter's table: t = seq.block_table
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and _is_table(node.value, holders):
            tables |= {t.id for t in _targets(node) if isinstance(t, ast.Name)}

    def table(node: ast.AST) -> bool:
        return _is_table(node, holders) or (isinstance(node, ast.Name) and node.id in tables)

    def merge(other: dict) -> None:
        for k in ("grows", "clears", "remaps", "publishes", "unreadable"):
            out[k] = out.get(k, False) or other.get(k, False)

    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:  # t: list[int] = ... too
            for t in _targets(node):
                if _is_table(t, holders):
                    out["clears" if _empty(node.value) else "grows"] = True
                elif isinstance(t, ast.Subscript) and table(t.value):
                    if isinstance(t.slice, ast.Slice):
                        out["clears" if _empty(node.value) else "grows"] = True
                    else:
                        out["remaps"] = True
                elif isinstance(t, ast.Subscript) and _hash_field(t.value):
                    out["publishes"] = True
        elif isinstance(node, ast.AugAssign) and table(node.target):
            out["grows"] = True
        elif isinstance(node, ast.Delete):
            for t in node.targets:
                if table(t) or (isinstance(t, ast.Subscript) and table(t.value)):
                    out["clears"] = True
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner, attr = node.func.value, node.func.attr
            if table(owner):
                if attr in _GROW_CALLS:
                    out["grows"] = True
                elif attr in _CLEAR_CALLS or attr == "pop":
                    out["clears"] = True
            elif attr in _INDEX_WRITES and _hash_field(owner):
                out["publishes"] = True
            elif isinstance(owner, ast.Name) and owner.id == "self" and mgr_cls is not None \
                    and callable(getattr(mgr_cls, attr, None)) and (mgr_cls, attr) not in seen:
                seen.add((mgr_cls, attr))
                callee = getattr(mgr_cls, attr)
                passed = {p for p, a in zip(_params(callee), node.args) if isinstance(a, ast.Name) and a.id in holders}
                merge(_read(callee, passed, mgr_cls, seq_cls, seen))
            elif isinstance(owner, ast.Name) and owner.id in holders and seq_cls is not None \
                    and callable(getattr(seq_cls, attr, None)) and (seq_cls, attr) not in seen:
                seen.add((seq_cls, attr))
                merge(_read(getattr(seq_cls, attr), {"self"}, None, None, seen))
    return out


def _targets(node: ast.AST) -> list:
    """What an assignment binds: ``a = b = v`` or an annotated ``a: T = v``."""
    return list(node.targets) if isinstance(node, ast.Assign) else [node.target]


def _hash_field(node: ast.AST) -> bool:
    """``self.<a field whose name holds 'hash'>``: the manager's hash index."""
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
        and "hash" in node.attr.lower()


def meaning(mgr_cls: type, method: str, seq_cls: Optional[type] = None, observed: tuple = ()) -> Meaning:
    """What ``mgr_cls.method`` does (see the module doc)."""
    from kvspec.targets.scheduler_calls import mutates
    fn = getattr(mgr_cls, method, None)
    if not callable(fn):
        return Meaning(method, mutates=False)
    effects = _read(fn, set(_params(fn)), mgr_cls, seq_cls, {(mgr_cls, method)})
    changes = mutates(mgr_cls, method, frozenset(observed))
    return Meaning(method, grows=effects["grows"], clears=effects["clears"], remaps=effects["remaps"],
                   publishes=effects["publishes"],
                   mutates=bool(changes or effects["grows"] or effects["clears"] or effects["publishes"]),
                   readable=not effects.get("unreadable", False))


# -- arguments by meaning ---------------------------------------------------------------------
TOKENS, BLOCKS, CACHED_TOKENS, CACHED_BLOCKS, OTHER = "tokens", "blocks", "cached_tokens", "cached_blocks", "other"
_TOKEN_WORDS = ("token", "chunk", "len", "n_new", "num_new")
_CACHED_WORDS = ("cached", "hit", "prefix", "computed")


def argument_roles(mgr_cls: type, method: str) -> dict[str, str]:
    """Each parameter (``self`` aside) -> TOKENS, BLOCKS, CACHED_TOKENS, CACHED_BLOCKS or
    OTHER (a Sequence, a flag...): from its name, else from how the body uses it."""
    fn = getattr(mgr_cls, method, None)
    tree = _tree(fn) if callable(fn) else None
    roles = {}
    for p in _params(fn) if callable(fn) else []:
        low = p.lower()
        cached = any(w in low for w in _CACHED_WORDS)
        if "block" in low and low not in ("block_table",) and (low.startswith("num") or low.startswith("n_")
                                                                or cached or low.endswith("blocks")):
            roles[p] = CACHED_BLOCKS if cached else BLOCKS
        elif any(w in low for w in _TOKEN_WORDS) or low in ("n", "num", "count"):
            roles[p] = CACHED_TOKENS if cached else TOKENS
        elif tree is not None and _used_as_blocks(tree, p):
            roles[p] = CACHED_BLOCKS if cached else BLOCKS
        else:
            roles[p] = OTHER
    return roles


def _used_as_blocks(tree: ast.AST, name: str) -> bool:
    """``name * self.block_size``, ``seq.block_table[:name]``, or ``range(name)`` whose loop indexes a table."""
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            sides = (node.left, node.right)
            if any(isinstance(s, ast.Name) and s.id == name for s in sides) and any(
                    isinstance(s, ast.Attribute) and "block_size" in s.attr for s in sides):
                return True
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) \
                and node.value.attr == "block_table" and isinstance(node.slice, ast.Slice):
            if any(isinstance(b, ast.Name) and b.id == name for b in (node.slice.lower, node.slice.upper)):
                return True
    return False


def bind(fn: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by parameter name (positional ones bound by the signature)."""
    try:
        b = inspect.signature(fn).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return {f"arg{i}": a for i, a in enumerate(args)} | dict(kwargs)
    b.apply_defaults()
    return dict(b.arguments)


__all__ = ["Meaning", "meaning", "argument_roles", "bind", "TOKENS", "BLOCKS", "CACHED_TOKENS", "CACHED_BLOCKS"]

"""The calls a package's own scheduler makes on its block manager that kvspec does not.

kvspec's cache level plays the scheduler: it calls the nano-vllm protocol
(``can_allocate``, ``allocate``, ``may_append``, ``deallocate``...) and the extra calls a
manager declares (``[tool.kvspec.protocol]``). A fork whose scheduler also calls, say,
``block_manager.may_prefill(seq, end)`` after each chunk keeps part of its state up to
date there; driven without that call, the manager looks broken when it is not (a false
I4 on a block the hook would have hashed). Such a finding would be kvspec's, not the
user's, so it must not be reported.

This module reads the scheduler's source (never runs it): the ``.py`` files beside the
manager's file (and one folder up), the attributes that hold the manager
(``self.block_manager = BlockManager(...)``, or any attribute named ``*block_manager*``),
and the methods called on them. A called method that kvspec does not call and that
changes the manager's state (assigns to an attribute or an item, or calls a mutating
container method, directly or through another of the class's methods) is an *undriven
call*. The loader refuses such a target in one line (exit 2), naming the call and the
two ways on: declare when it happens, or let the package's own scheduler drive
(``--level engine``). Read-only calls (``get_num_free_blocks``) are fine.
"""
from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

# Container methods that change their receiver: a hook calling them changes state.
MUTATORS = frozenset({"append", "appendleft", "pop", "popleft", "remove", "add", "discard", "update", "clear",
                      "insert", "extend", "extendleft", "setdefault", "popitem", "move_to_end", "rotate",
                      "sort", "reverse", "reset", "__setitem__", "__delitem__", "put", "push"})
MAX_FILES = 40  # a package's engine folder, not a monorepo


@dataclass(frozen=True)
class UndrivenCall:
    method: str
    file: Path
    line: int
    text: str  # the call as written, e.g. "self.block_manager.may_prefill(seq, seq.scheduled_prefill_end)"
    flag: str = ""  # the scheduler's feature switch it sits under ("self.offload"), if any: optional

    def where(self, root: Optional[Path] = None) -> str:
        try:
            shown = self.file.relative_to(root) if root is not None else self.file
        except ValueError:
            shown = self.file
        return f"{shown}:{self.line}"


def _method_tree(cls: type, name: str) -> Optional[ast.AST]:
    fn = getattr(cls, name, None)
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (TypeError, OSError, SyntaxError, IndentationError):
        return None


def _root(node: ast.AST) -> Optional[ast.AST]:
    """The innermost ``self.<field>`` (an Attribute on ``self``) or bare Name under a chain of
    attributes, items and calls: ``self.blocks[i].hash`` -> ``self.blocks``."""
    while True:
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            return node
        if isinstance(node, ast.Name):
            return node
        if isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        else:
            return None


def mutates(cls: type, name: str, observed: frozenset = frozenset(), _seen: Optional[set] = None) -> bool:
    """Whether ``cls.name`` may change the state kvspec observes, read from its source
    (unreadable: True). ``observed``: the manager's fields kvspec reads (blocks, free list,
    index...). A write counts when it lands on one of them, on a local bound from one
    (``block = self.blocks[i]``), or on a Sequence's ``block_table``; calling another of
    the class's methods that does so counts too. Counters and caches of its own do not."""
    seen = _seen if _seen is not None else set()
    if name in seen:
        return False
    seen.add(name)
    tree = _method_tree(cls, name)
    if tree is None:
        return True  # no source to read: assume the worst, the call may matter
    tainted: set[str] = set()
    for node in ast.walk(tree):  # locals bound from observed state
        if isinstance(node, ast.For):
            value, targets = node.iter, [node.target]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            value = node.value
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        else:
            continue
        if any(_touches(v, observed, tainted) for v in ast.walk(value) if isinstance(v, (ast.Attribute, ast.Name))):
            tainted |= {t.id for t in targets if isinstance(t, ast.Name)}

    def lands(target: ast.AST) -> bool:
        if isinstance(target, ast.Attribute) and target.attr == "block_table":
            return True
        r = _root(target)
        return r is not None and r is not target and _touches(r, observed, tainted)

    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            flat = [e for t in targets for e in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])]
            if any(isinstance(t, (ast.Attribute, ast.Subscript)) and lands(t) for t in flat):
                return True
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if node.func.attr in MUTATORS and lands(node.func):
                return True
            if isinstance(owner, ast.Name) and owner.id == "self" and callable(getattr(cls, node.func.attr, None)):
                if mutates(cls, node.func.attr, observed, seen):
                    return True
    return False


def _touches(node: ast.AST, observed: frozenset, tainted: set) -> bool:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return not observed or node.attr in observed or "free" in node.attr.lower()  # free lists, their sets
    return isinstance(node, ast.Name) and node.id in tainted


def _scheduler_files(source: Path) -> Iterable[Path]:
    here = source.parent
    seen = 0
    for folder in (here, here.parent):
        for f in sorted(folder.glob("*.py")):
            if f.resolve() == source.resolve():
                continue
            seen += 1
            if seen > MAX_FILES:
                return
            yield f


def _holders(tree: ast.AST, cls_name: str) -> set[str]:
    """Attribute names that hold the manager in this file."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            f = node.value.func
            called = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if called == cls_name:
                out |= {t.attr for t in node.targets if isinstance(t, ast.Attribute)}
    return out


def _scheduler_nodes(tree: ast.AST, path: Path) -> list[ast.AST]:
    """The scheduler's code in one file: the whole file when its name says scheduler, else
    the classes that define ``schedule`` or ``postprocess`` (an engine's optional
    features, called from elsewhere, are not the protocol)."""
    if "sched" in path.stem.lower():
        return [tree]
    return [c for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
            and any(isinstance(f, ast.FunctionDef) and f.name in ("schedule", "postprocess") for f in c.body)]


def undriven_calls(cls: type, source: Optional[Path], driven: Iterable[str],
                   observed: Iterable[str] = ()) -> list[UndrivenCall]:
    """The state-changing calls the package's scheduler makes on ``cls`` that are not in
    ``driven`` (kvspec's calls and the declared protocol), first occurrence of each.
    ``observed``: the manager's fields kvspec reads (see ``mutates``)."""
    observed = frozenset(observed)
    if source is None or not Path(source).is_file():
        return []
    driven = set(driven)
    found: dict[str, UndrivenCall] = {}
    for f in _scheduler_files(Path(source)):
        try:
            text = f.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        if cls.__name__ not in text and "block_manager" not in text:
            continue
        holders = _holders(tree, cls.__name__)
        parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
        for node in (n for part in _scheduler_nodes(tree, f) for n in ast.walk(part)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            owner = node.func.value
            held = owner.attr if isinstance(owner, ast.Attribute) else owner.id if isinstance(owner, ast.Name) else ""
            if not (held in holders or "block_manager" in held):
                continue
            m = node.func.attr
            if m in driven or m in found or m.startswith("__") or not callable(getattr(cls, m, None)):
                continue
            if mutates(cls, m, observed):
                found[m] = UndrivenCall(m, f, node.lineno, ast.get_source_segment(text, node) or f"{held}.{m}(...)",
                                        _switch(node, parents, text))
    return list(found.values())


def _switch(node: ast.AST, parents: dict, text: str) -> str:
    """The feature switch a call sits under: an enclosing ``if`` whose test is a plain
    attribute of ``self`` (``if self.offload:``, ``elif not self.config.x:``). Such a call
    belongs to an optional feature, not to the protocol every run follows."""
    child, p = node, parents.get(node)
    while p is not None and not isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef)):
        if isinstance(p, ast.If) and child is not p.test:
            test = p.test.operand if isinstance(p.test, ast.UnaryOp) and isinstance(p.test.op, ast.Not) else p.test
            r = _root(test) if isinstance(test, ast.Attribute) else None
            if r is not None and isinstance(r, ast.Attribute):
                return ast.get_source_segment(text, p.test) or "a switch"
        child, p = p, parents.get(p)
    return ""


def refusal(spec: str, calls: list[UndrivenCall], root: Optional[Path] = None) -> str:
    """The one line that refuses a target whose scheduler makes ``calls`` (none optional)."""
    c = calls[0]
    more = f" (and {', '.join(x.method for x in calls[1:])})" if len(calls) > 1 else ""
    return (f"target {spec}: {c.where(root)} calls {c.text.strip()}{more}, which changes the manager's state and "
            f"which kvspec's cache level does not call, so its findings could be kvspec's: declare when your "
            f"scheduler calls it in [tool.kvspec.protocol] (hook points: `kvspec api nanovllm`), or let your "
            f"package's own scheduler drive it with --level engine")


def engine_note(calls: list[UndrivenCall], root: Optional[Path] = None) -> str:
    """The note when the default levels go to the engine level because of ``calls``."""
    c = calls[0]
    return (f"{c.where(root)} calls {c.text.strip()}, which only the package's own scheduler knows when to "
            f"call: checking through it (--level engine)")


def optional_note(calls: list[UndrivenCall], root: Optional[Path] = None) -> str:
    """The note for calls that sit under a feature switch: run, but say what is not played."""
    said = "; ".join(f"{c.where(root)} calls {c.method} when {c.flag}" for c in calls)
    return (f"your scheduler makes calls kvspec does not, behind feature switches ({said}): kvspec checks "
            f"the manager as if those features were off")


__all__ = ["UndrivenCall", "undriven_calls", "mutates", "refusal", "engine_note", "optional_note"]

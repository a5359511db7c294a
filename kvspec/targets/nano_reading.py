"""Policies kvspec reads from a nano-vllm-style package's own code, where its code decides
them, instead of reporting the engine's deliberate choice as a finding with a hint.

Only what the code settles is read; anything else stays open to a hint (``Traits.hintable``).
A policy the user declared is never read over. What was read is shown with the declaration
(``Traits.declaration``: "none: vLLM's defaults; read from its code: ...") and kept in
``Traits.read``, so a finding that the other value would have accepted says why it is a bug.

- **Admission** (``admit_all_blocks``): a ``can_allocate(seq)`` gate whose code, and the
  manager methods it calls, read nothing hash-named cannot count prefix hits: the engine
  admits a prompt only when all its blocks are free (nano-vllm's admission).
  (``nano_api.gate_counts_hits``.)
- **Whole-prompt hits** (``whole_prompt_hits``): how the package's model runner builds a
  row's query tokens. A row computed from ``seq[seq.num_cached_tokens:]`` has no token left
  when a hit covers the whole prompt (no logits to sample): where such a slice is reached
  with no check of the cached count, a whole-prompt hit is a bug of that engine, and the
  policy that would accept it is closed (read as false). Where every such slice sits under
  ``if cached < prompt`` with another branch that feeds the row one token (a decode row that
  recomputes the last token in place), the engine handles it: read as true. No slice found:
  nothing read.
"""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Any, Iterator, Optional

from kvspec.targets.names import Names

READ_MARK = "read from its code: "  # in Traits.declaration, before what was read
MAX_FILES = 400  # a package larger than this is not read (the policy stays open to a hint)


@dataclasses.dataclass(frozen=True)
class Reading:
    """One policy read from code: its value, and where and why, in words."""
    key: str
    value: Any
    why: str


def read_admission(cls: type, names: Optional[Names] = None) -> Optional[Reading]:
    """``admit_all_blocks = true`` where the gate cannot see prefix hits, else None."""
    from kvspec.targets.nano_api import gate_counts_hits
    if gate_counts_hits(cls, names) is not False:
        return None
    gate = (names or Names()).resolve(cls, "can_allocate") or "can_allocate"
    return Reading("admit_all_blocks", True, f"{cls.__name__}.{gate} reads no hash, so it counts every block of "
                                             f"the prompt, cached ones too")


# -- whole-prompt hits ---------------------------------------------------------------------
def _cached_name(name: str) -> bool:
    n = name.lower()
    return "cached_tokens" in n or n in ("num_cached", "cached_len", "num_cached_tok")


def _aliases(fn: ast.AST) -> set[str]:
    """Local names bound to a row's cached-token count: assigned it directly
    (``start = seq.num_cached_tokens``) or asserted equal to it (``assert start == seq.num_cached_tokens``)."""
    out: set[str] = set()
    grew = True
    while grew:
        grew = False
        for node in ast.walk(fn):
            pairs: list[tuple[ast.AST, ast.AST]] = []
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                pairs = [(node.targets[0], node.value)]
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                pairs = [(node.target, node.value)]
            elif (isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare) and len(node.test.ops) == 1
                  and isinstance(node.test.ops[0], ast.Eq)):
                a, b = node.test.left, node.test.comparators[0]
                pairs = [(a, b), (b, a)]
            for target, value in pairs:
                if isinstance(target, ast.Name) and target.id not in out and _is_cached(value, out):
                    out.add(target.id)
                    grew = True
    return out


def _is_cached(node: Optional[ast.AST], aliases: set[str]) -> bool:
    """Whether ``node`` is (exactly) a row's cached-token count."""
    if isinstance(node, ast.Attribute):
        return _cached_name(node.attr)
    if isinstance(node, ast.Name):
        return node.id in aliases or _cached_name(node.id)
    return False


def _inputs(node: ast.AST) -> bool:
    """``input_ids.extend(...)`` / ``tokens.append(...)``: a call that feeds a row's tokens."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("extend", "append")
            and isinstance(node.func.value, ast.Name) and any(w in node.func.value.id.lower() for w in ("input", "token")))


def _query_slices(fn: ast.AST, aliases: set[str]) -> Iterator[ast.Call]:
    """The calls that feed a row the tokens from its cached count on: ``input_ids.extend(seq[cached:...])``."""
    for node in ast.walk(fn):
        if _inputs(node) and node.args and isinstance(node.args[0], ast.Subscript):
            s = node.args[0].slice
            if isinstance(s, ast.Slice) and _is_cached(s.lower, aliases):
                yield node


def _full_excluded(test: ast.AST, in_body: bool, aliases: set[str]) -> bool:
    """Whether the branch (body, else orelse) of ``if test`` never runs for a row whose cached
    tokens cover it: ``cached < n`` (or ``n > cached``, ``cached != n``) guards the body,
    ``cached >= n`` (``n <= cached``, ``cached == n``) the orelse."""
    if in_body and isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return any(_full_excluded(v, True, aliases) for v in test.values)
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return False
    left, op, right = test.left, test.ops[0], test.comparators[0]
    if _is_cached(left, aliases) and not _is_cached(right, aliases):
        body_ops, else_ops = (ast.Lt, ast.NotEq), (ast.GtE, ast.Eq)
    elif _is_cached(right, aliases) and not _is_cached(left, aliases):
        body_ops, else_ops = (ast.Gt, ast.NotEq), (ast.LtE, ast.Eq)
    else:
        return False
    return isinstance(op, body_ops if in_body else else_ops)


def _guard(call: ast.AST, parents: dict[ast.AST, ast.AST], aliases: set[str]) -> Optional[ast.If]:
    """The ``if`` that keeps a fully cached row out of ``call``'s branch and feeds it one token in
    the other branch (a decode row), else None."""
    child, node = call, parents.get(call)
    while node is not None and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        if isinstance(node, ast.If):
            in_body = any(child is s for s in node.body)
            other = node.orelse if in_body else node.body
            if (_full_excluded(node.test, in_body, aliases)
                    and any(_inputs(n) for s in other for n in ast.walk(s))):
                return node
        child, node = node, parents.get(node)
    return None


def package_files(source: Optional[Path]) -> list[Path]:
    """The .py files of ``source``'s top-level package (``nanovllm/`` for
    ``nanovllm/engine/block_manager.py``), or the file alone where it is in no package."""
    if source is None or not Path(source).is_file():
        return []
    top = Path(source).resolve().parent
    if not (top / "__init__.py").is_file() and not any(top.glob("scheduler*.py")):
        return [Path(source).resolve()]
    while (top.parent / "__init__.py").is_file():
        top = top.parent
    files = sorted(p for p in top.rglob("*.py") if "test" not in p.name.lower() and "tests" not in p.parts)
    return files if len(files) <= MAX_FILES else []


def _lowers_cached(tree: ast.AST) -> bool:
    """Whether code lowers a row's cached count (``seq.num_cached_tokens -= 1``,
    ``= min(...)``, ``= n - 1``): a scheduler that keeps the last token to compute after a
    whole hit, so the runner's slice is never empty; the reading is then left open."""
    for node in ast.walk(tree):
        if (isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Sub)
                and isinstance(node.target, ast.Attribute) and _cached_name(node.target.attr)):
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Attribute) and _cached_name(t.attr)
                                                for t in node.targets):
            for n in ast.walk(node.value):
                if (isinstance(n, ast.BinOp) and isinstance(n.op, ast.Sub)) or (
                        isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "min"):
                    return True
    return False


def read_whole_prompt(source: Optional[Path]) -> Optional[Reading]:
    """``whole_prompt_hits`` as the package's model runner settles it (see the module doc), else None."""
    guarded: list[str] = []
    unguarded: Optional[Reading] = None
    for f in package_files(source):
        try:
            text = f.read_text(errors="replace")
            tree = ast.parse(text)
        except (SyntaxError, ValueError, OSError):
            continue
        if _lowers_cached(tree):
            return None
        parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            aliases = _aliases(fn)
            for call in _query_slices(fn, aliases):
                where = f"{f.name}:{call.lineno} ({fn.name})"
                shown = ast.get_source_segment(text, call) or "the query slice"
                if _guard(call, parents, aliases) is None:
                    unguarded = unguarded or Reading("whole_prompt_hits", False,
                                   f"{where} computes `{shown}`, which holds no token when a hit covers the whole "
                                   f"prompt, and nothing before it checks the cached count: that row gets no logits")
                else:
                    guarded.append(where)
    if unguarded is not None:
        return unguarded
    if guarded:
        return Reading("whole_prompt_hits", True, f"{guarded[0]} computes a row's tokens from its cached count only "
                                                  f"while the cached tokens fall short of it; a fully cached row is fed "
                                                  f"one token, as a decode row")
    return None


def read_policies(traits: Any, cls: type, names: Optional[Names], source: Optional[Path]) -> Any:
    """``traits`` with the policies its package's code settles (see the module doc), for the keys
    it leaves open to hints; each read key is closed to hints and named in the declaration."""
    open_keys = set(getattr(traits, "hintable", frozenset()))
    readings: list[Reading] = []
    if "admit_all_blocks" in open_keys and not traits.admit_all_blocks:
        r = read_admission(cls, names)
        readings += [r] if r else []
    if "whole_prompt_hits" in open_keys and not traits.whole_prompt_hits:
        r = read_whole_prompt(source)
        readings += [r] if r else []
    if not readings:
        return traits
    shown = "; ".join(f"{r.key} = {'true' if r.value else 'false'} ({r.why})" for r in readings)
    from kvspec.targets.policies import note_once
    note_once(f"read:{getattr(cls, '__module__', '')}.{getattr(cls, '__name__', '')}",
              f"{getattr(cls, '__name__', 'the manager')}: {READ_MARK}{shown} (declare the policy to check another value)")
    return dataclasses.replace(traits, **{r.key: r.value for r in readings},
                               hintable=frozenset(open_keys - {r.key for r in readings}),
                               read=tuple(getattr(traits, "read", ())) + tuple((r.key, r.value, r.why) for r in readings),
                               declaration=f"{traits.declaration}; {READ_MARK}{shown}")

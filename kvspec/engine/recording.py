"""A recording proxy in front of a package's block manager (engine level, nano-vllm style).

Every public method the scheduler calls on its manager goes through, whatever its name,
and is recorded (``RawCall``): the method, its arguments bound by name, the Sequence it
was called for, that Sequence's block table before and after, its tokens, the result,
and the manager's state right after. What the call meant is decided later, once the
step's decisions are known (``NanoEngineDriver``), from the method's own code
(``kvspec.engine.call_meaning``) and what it did to the table.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from kvspec.engine.call_meaning import Meaning, bind, meaning
from kvspec.errors import TargetError


@dataclass
class RawCall:
    method: str
    meaning: Meaning
    args: dict
    req: Optional[str]             # the request whose Sequence the call was for, if any
    phase: str                     # "schedule", "update" (postprocess), "abort"
    before: tuple = ()             # its block table before the call
    after: tuple = ()              # and after
    tokens: tuple = ()             # its tokens at the call
    result: Any = None
    obs: Any = None                # the manager right after the call (state-changing calls)
    cached: int = 0                # the Sequence's num_cached_tokens after the call
    changed: bool = False          # an uninterpretable call changed what kvspec observes
    extra: dict = field(default_factory=dict)


class RecordingManager:
    """Stands in front of the scheduler's ``block_manager`` (see the module doc)."""

    def __init__(self, mgr: Any, engine: Any) -> None:
        self._mgr, self._engine = mgr, engine

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_mgr", "_engine"):  # copying builds one without them
            raise AttributeError(name)
        attr = getattr(self._mgr, name)
        if name.startswith("_") or not callable(attr) or self._engine is None:
            return attr
        engine = self._engine

        def recorded(*args: Any, **kwargs: Any) -> Any:
            return engine.record(name, attr, args, kwargs)
        return recorded

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("_mgr", "_engine"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._mgr, name, value)


def leading_published(obs: Any, table: tuple, bs: int) -> int:
    """Tokens up to the end of ``table``'s last block that carries a hash: what the engine
    has published of the request (a hit block whose index entry went away still counts:
    the invariants judge the index, this says only how far hashing has gone)."""
    last = -1
    for i, b in enumerate(table):
        if 0 <= b < len(obs.blocks) and obs.blocks[b].hash is not None:
            last = i
    return (last + 1) * bs


# -- the calls a scheduler's source makes, checked at load ---------------------------------------
def scheduler_manager_calls(source: Optional[Path]) -> list[tuple[str, int, str]]:
    """(method, line, the call as written) for each call the scheduler file makes on an
    attribute holding its manager (``self.block_manager.X(...)``)."""
    if source is None or not Path(source).is_file():
        return []
    try:
        text = Path(source).read_text(encoding="utf-8", errors="replace")
        tree = ast.parse(text)
    except (OSError, SyntaxError, ValueError):
        return []
    out, seen = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            held = owner.attr if isinstance(owner, ast.Attribute) else owner.id if isinstance(owner, ast.Name) else ""
            if "block_manager" in held and node.func.attr not in seen and not node.func.attr.startswith("__"):
                seen.add(node.func.attr)
                out.append((node.func.attr, node.lineno, ast.get_source_segment(text, node) or node.func.attr))
    return out


def refuse_uninterpretable(name: str, mgr_cls: type, seq_cls: type, source: Optional[Path]) -> None:
    """One line (exit 2) before the first step when the scheduler calls a manager method
    that changes state in a way kvspec cannot feed to the model (a copy-on-write remap, a
    change that is neither an allocation, a free nor a hash publication)."""
    for method, line, text in scheduler_manager_calls(source):
        if not callable(getattr(mgr_cls, method, None)):
            continue
        m = meaning(mgr_cls, method, seq_cls)
        if m.remaps:  # certain from the code; other changes are judged when they happen (record)
            where = f"{Path(source).name}:{line}" if source else "its scheduler"
            raise TargetError(f"target {name}: {where} calls {text.strip()}, which {m.describe()} in a way kvspec "
                              f"cannot read as an allocation, a free or a hash publication, so the engine level "
                              f"cannot follow it")


__all__ = ["RawCall", "RecordingManager", "leading_published", "scheduler_manager_calls", "refuse_uninterpretable"]

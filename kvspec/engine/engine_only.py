"""A block manager only its own package's scheduler can drive: checked at the engine level.

A fork whose manager admits with ``allocate_and_hash(seq, n)`` and grows with
``allocate_incremental(seq, chunk)`` has none of the nano-vllm calls the cache level
plays, so the cache level cannot load it. Where a ``scheduler.py`` beside it calls that
manager, the engine level can: it records every call the scheduler makes and reads each
one from its code (``kvspec.engine.call_meaning``). Such a target runs at the engine level
only; the cache level refuses it in one line naming the call it cannot play, and the
default levels go to the engine level with a note (as for a scheduler whose hooks the
cache level does not call, ``kvspec.targets.scheduler_calls``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

from kvspec.errors import TargetError
from kvspec.targets.nanovllm_target import NanoTarget


class EngineOnlyNanoTarget(NanoTarget):
    """A NanoTarget whose manager has no cache-level API (see the module doc)."""

    def __init__(self, manager_cls: type, seq_cls: type, name: str, source: Any,
                 make: Optional[Callable[..., Any]] = None, why: str = "") -> None:
        from kvspec.targets.nano_api import BOOLEAN
        from kvspec.targets.nanovllm_target import caching_support, declared_nano_traits
        from kvspec.targets.names import load_names, read_protocol
        self.manager_cls, self.seq_cls, self.name, self.make, self.source = manager_cls, seq_cls, name, make, source
        self.names = load_names(manager_cls, source)
        self.protocol, _ = read_protocol(manager_cls, source)
        self.api = BOOLEAN  # never driven: the engine level reads each call from its own code
        self.caching_support = caching_support(manager_cls, seq_cls, make, self.names)
        self.traits = declared_nano_traits(manager_cls, seq_cls, BOOLEAN, name, source=source, make=make)
        self.why = why

    def check_internals(self) -> None:  # the engine's observer checks them when it is built
        return None

    def driver(self, config: Any) -> Any:
        """The cache level cannot play this manager: why, and the two ways on."""
        why = self.why.split(": ", 1)[1] if self.why.startswith("target ") and ": " in self.why else self.why
        raise TargetError(f"target {self.name}: {why}; declare the names kvspec's calls stand for in "
                          f"[tool.kvspec.names] (`kvspec api nanovllm`), or let the package's own scheduler drive it "
                          f"with --level engine")


def engine_only_target(cls: Any, seq_cls: type, spec: str, source: Optional[Path],
                       make: Optional[Callable[..., Any]], why: str) -> Optional[NanoTarget]:
    """An engine-only target for ``cls`` when a ``scheduler.py`` beside ``source`` calls its
    state-changing methods; None otherwise (the caller's refusal stands)."""
    from kvspec.engine.call_meaning import meaning
    from kvspec.engine.nano_load import scheduler_file
    from kvspec.engine.recording import scheduler_manager_calls
    from kvspec.targets.scheduler_calls import UndrivenCall
    if not isinstance(cls, type) or source is None:
        return None
    try:
        sched = scheduler_file(Path(source))
    except TargetError:
        return None
    every = scheduler_manager_calls(sched)
    if any(not callable(getattr(cls, c[0], None)) for c in every):
        return None  # the scheduler calls what this class lacks: it is not the manager that scheduler drives
    calls = every
    from kvspec.targets.nano_api import NANO_METHODS
    changing = [c for c in calls if meaning(cls, c[0], seq_cls).mutates]
    if not any(meaning(cls, c[0], seq_cls).grows for c in changing):
        return None  # the scheduler allocates nothing through it: not its block manager
    unplayed = [c for c in changing if c[0] not in NANO_METHODS] or changing
    try:
        target = EngineOnlyNanoTarget(cls, seq_cls, spec, Path(source), make, why)
    except TargetError as e:
        msg = str(e)
        raise TargetError(msg if msg.startswith("target ") else f"target {spec}: {msg}") from None
    method, line, text = unplayed[0]
    target.undriven = (UndrivenCall(method, sched, line, text),)
    return target


__all__ = ["EngineOnlyNanoTarget", "engine_only_target"]

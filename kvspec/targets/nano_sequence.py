"""A Sequence for nano-vllm-style block managers whose module brings none.

A nano-vllm BlockManager reads a request through a small surface: its tokens
(``len(seq)``, ``seq.block(i)``, ``seq.num_blocks``), its ``block_table`` and its
``num_cached_tokens``; newer managers also read ``num_scheduled_tokens``. This class
provides that surface and nothing else (no sampling parameters, no status).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable

from kvspec.errors import TargetError


class Sequence:
    block_size: int = 16  # the driver sets it on each instance to the manager's block size

    def __init__(self, token_ids: Iterable[int], block_size: int | None = None) -> None:
        self.token_ids: list[int] = list(token_ids)
        if not self.token_ids:
            raise ValueError("a sequence needs at least one token")
        if block_size is not None:
            self.block_size = block_size
        self.num_prompt_tokens = len(self.token_ids)
        self.num_cached_tokens = 0     # KV already in the table (the prefix hit, right after allocate)
        self.num_scheduled_tokens = 0  # tokens the current step computes (newer managers' hash_blocks)
        self.block_table: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    def __len__(self) -> int:
        return len(self.token_ids)

    def __getitem__(self, key):
        return self.token_ids[key]

    @property
    def num_blocks(self) -> int:
        return -(-len(self.token_ids) // self.block_size)

    @property
    def num_cached_blocks(self) -> int:
        return self.num_cached_tokens // self.block_size

    @property
    def last_block_num_tokens(self) -> int:
        return len(self.token_ids) - (self.num_blocks - 1) * self.block_size

    def block(self, i: int) -> list[int]:
        """The tokens of logical block ``i`` (the last one may be partial)."""
        if not 0 <= i < self.num_blocks:
            raise IndexError(f"block {i} of a sequence with {self.num_blocks} blocks")
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def pop_token(self) -> int:
        """Undo ``append_token`` (the driver's refused decode step)."""
        return self.token_ids.pop()


# -- building a package's own Sequence ---------------------------------------------------
# Constructor parameters kvspec knows how to fill, by name (nano-vllm: ``Sequence(token_ids,
# sampling_params=...)``; nano-vllm-voxcpm: ``Sequence(seq_id, token_ids, block_size, ...)``).
TOKEN_PARAMS = ("token_ids", "tokens", "prompt_token_ids", "input_ids", "prompt")
BLOCK_SIZE_PARAMS = ("block_size", "kvcache_block_size")
ID_PARAMS = ("seq_id", "sequence_id", "request_id", "req_id", "id")
SAMPLING_PARAMS = ("sampling_params", "sampling_param", "sampling", "params")
# What a Sequence may read off its sampling parameters, where the package has no
# SamplingParams kvspec can build: greedy, no end-of-sequence stop, no length cap.
PLAIN_SAMPLING = {"temperature": 1.0, "max_tokens": 1 << 20, "ignore_eos": True}


def default_sampling_params(seq_cls: type) -> Any:
    """The package's own default ``SamplingParams()``: the class in the Sequence module's
    globals, else ``sampling_params.py`` beside the module or up to two directories above
    (executed alone: such a module holds a small dataclass); else a plain object with
    ``PLAIN_SAMPLING``'s fields."""
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    module = sys.modules.get(seq_cls.__module__)
    candidates = [getattr(module, "SamplingParams", None)]
    f = getattr(module, "__file__", None)
    if f:
        here = Path(f).resolve().parent
        for d in (here, here.parent, here.parent.parent):
            sp = d / "sampling_params.py"
            if sp.is_file():
                candidates.append(_light_class(sp, "SamplingParams"))
                break
    for cls in candidates:
        if isinstance(cls, type):
            for kwargs in ({}, PLAIN_SAMPLING):
                try:
                    return cls(**kwargs)
                except Exception:
                    continue
    return SimpleNamespace(**PLAIN_SAMPLING)


def _light_class(path: Any, name: str) -> Any:
    """``name`` from the file at ``path`` executed as a standalone module (None on failure)."""
    import importlib.util
    import sys

    alias = f"_kvspec_sampling_{abs(hash(str(path)))}"
    if alias in sys.modules:
        return getattr(sys.modules[alias], name, None)
    spec = importlib.util.spec_from_file_location(alias, path)
    if spec is None or spec.loader is None:
        return None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[alias] = mod  # dataclasses look their module up
    try:
        spec.loader.exec_module(mod)
    except Exception:
        del sys.modules[alias]
        return None
    return getattr(mod, name, None)


def sequence_factory(seq_cls: type) -> Callable[[list, int, int], Any]:
    """``make(tokens, block_size, n)`` building ``seq_cls`` by its constructor's signature:
    tokens, block size and a sequence id (``n``, as a str where the parameter is annotated
    str) go to the parameters so named, and a required ``sampling_params`` gets the
    package's default ``SamplingParams()`` (``default_sampling_params``); any other
    parameter must have a default. Raises
    TargetError naming a parameter kvspec cannot fill."""
    try:
        params = list(inspect.signature(seq_cls).parameters.values())
    except (TypeError, ValueError):
        return lambda tokens, bs, n: seq_cls(list(tokens))
    plan: list[tuple[inspect.Parameter, str]] = []
    for p in params:
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        role = ("tokens" if p.name in TOKEN_PARAMS else "block_size" if p.name in BLOCK_SIZE_PARAMS
                else "id" if p.name in ID_PARAMS else None)
        if role is None and p.default is inspect.Parameter.empty and (
                p.name in SAMPLING_PARAMS or "SamplingParams" in str(p.annotation)):
            role = "sampling"
        if role is None:
            if p.default is inspect.Parameter.empty:
                raise TargetError(f"cannot build {seq_cls.__module__}.{seq_cls.__name__}: its constructor needs "
                                  f"{p.name!r}, and kvspec fills only token_ids, block_size, seq_id and "
                                  f"sampling_params")
            continue
        plan.append((p, role))
    if not any(role == "tokens" for _, role in plan):
        raise TargetError(f"cannot build {seq_cls.__module__}.{seq_cls.__name__}: its constructor has no "
                          f"token_ids parameter")
    id_is_str = any(role == "id" and p.annotation in (str, "str") for p, role in plan)
    sampling = default_sampling_params(seq_cls) if any(role == "sampling" for _, role in plan) else None

    def make(tokens: list, block_size: int, n: int) -> Any:
        values = {"tokens": list(tokens), "block_size": block_size, "id": f"kvspec-{n}" if id_is_str else n,
                  "sampling": sampling}
        args, kwargs = [], {}
        for p, role in plan:
            if p.kind is inspect.Parameter.POSITIONAL_ONLY:
                args.append(values[role])
            else:
                kwargs[p.name] = values[role]
        return seq_cls(*args, **kwargs)

    return make

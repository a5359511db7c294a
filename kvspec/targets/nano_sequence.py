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


def sequence_factory(seq_cls: type) -> Callable[[list, int, int], Any]:
    """``make(tokens, block_size, n)`` building ``seq_cls`` by its constructor's signature:
    tokens, block size and a sequence id (``n``, as a str where the parameter is annotated
    str) go to the parameters so named; any other parameter must have a default. Raises
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
        if role is None:
            if p.default is inspect.Parameter.empty:
                raise TargetError(f"cannot build {seq_cls.__module__}.{seq_cls.__name__}: its constructor needs "
                                  f"{p.name!r}, and kvspec fills only token_ids, block_size and seq_id")
            continue
        plan.append((p, role))
    if not any(role == "tokens" for _, role in plan):
        raise TargetError(f"cannot build {seq_cls.__module__}.{seq_cls.__name__}: its constructor has no "
                          f"token_ids parameter")
    id_is_str = any(role == "id" and p.annotation in (str, "str") for p, role in plan)

    def make(tokens: list, block_size: int, n: int) -> Any:
        values = {"tokens": list(tokens), "block_size": block_size, "id": f"kvspec-{n}" if id_is_str else n}
        args, kwargs = [], {}
        for p, role in plan:
            if p.kind is inspect.Parameter.POSITIONAL_ONLY:
                args.append(values[role])
            else:
                kwargs[p.name] = values[role]
        return seq_cls(*args, **kwargs)

    return make

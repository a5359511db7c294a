"""Building an allocator of any shape for a run: its constructor's parameters are filled
by name (``num_blocks``/``capacity``/... with the run's block count, ``block_size``/
``page_size``/... with its block size, ``device`` with "cpu" and the dimensions of KV
tensors it owns, ``num_layers``/``head_dim``/..., with 1), a config object as the package's engine builds one
(``kvspec.targets.nano_api.build_config``), and otherwise the first required parameter gets
the block count and the second the block size. ``plan`` says how, in words, for the
mapping line."""
from __future__ import annotations

import inspect
from typing import Any, Callable

from kvspec.alloc.shapes import BLOCK_SIZE_PARAMS, NUM_BLOCKS_PARAMS, TENSOR_DIM_PARAMS
from kvspec.targets.base import TargetError

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _params(build: Any) -> list[inspect.Parameter]:
    try:
        params = list(inspect.signature(build).parameters.values())
    except (TypeError, ValueError):
        return []
    return [p for p in params if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]


def plan(build: Any) -> tuple[Callable[[int, int], Any], str]:
    """(``make(num_blocks, block_size)``, the call in words). Raises TargetError for a
    constructor kvspec cannot fill."""
    from kvspec.targets.nano_api import build_config, config_parameter
    name = getattr(build, "__name__", "the factory")
    if config_parameter(build) is not None:
        return (lambda n, bs: build(build_config(build, n, bs))), f"{name}(config with num_blocks, block_size)"
    params = _params(build)
    kw: dict[str, str] = {}
    free_required = []
    for p in params:
        if p.name in NUM_BLOCKS_PARAMS and "n" not in kw.values():
            kw[p.name] = "n"
        elif p.name in BLOCK_SIZE_PARAMS and "bs" not in kw.values():
            kw[p.name] = "bs"
        elif p.name == "device":
            # vLLM v0's BlockAllocator(device, ...) keeps it as a label; an allocator owning its
            # KV tensors puts them there: kvspec runs on the CPU, whatever the default says
            kw[p.name] = "device"
        elif p.name in TENSOR_DIM_PARAMS and (p.default is p.empty or isinstance(p.default, int)):
            kw[p.name] = "dim"  # the KV tensors it owns: their shape is not what is checked
        elif p.default is p.empty and p.kind in _POSITIONAL:
            free_required.append(p.name)
    if "n" not in kw.values() and free_required:  # an unnamed count: the first required parameter
        kw[free_required.pop(0)] = "n"
    if free_required and "bs" not in kw.values():
        kw[free_required.pop(0)] = "bs"
    if free_required:
        raise TargetError(f"{name} needs {', '.join(free_required)}, which kvspec cannot fill (it passes the "
                          f"number of blocks and the block size)")

    def make(n: int, bs: int) -> Any:
        return build(**{k: (n if v == "n" else bs if v == "bs" else 1 if v == "dim" else "cpu") for k, v in kw.items()})
    shown = ", ".join(f"{k}=" + {"n": "<num_blocks>", "bs": "<block_size>", "device": "'cpu'", "dim": "1"}[v]
                      for k, v in kw.items())
    return make, f"{name}({shown})"


def takes_block_size(build: Any) -> bool:
    return any(p.name in BLOCK_SIZE_PARAMS for p in _params(build))


def build_probe(make: Callable[[int, int], Any], spec: str, n: int = 8, bs: int = 2) -> Any:
    try:
        return make(n, bs)
    except Exception as e:
        from kvspec.targets.contract import describe_exception
        raise TargetError(f"target {spec}: building it with {n} blocks of {bs} tokens raised "
                          f"{describe_exception(e)}") from None


__all__ = ["plan", "build_probe", "takes_block_size"]

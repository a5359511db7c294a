"""A Sequence for nano-vllm-style block managers whose module brings none.

A nano-vllm BlockManager reads a request through a small surface: its tokens
(``len(seq)``, ``seq.block(i)``, ``seq.num_blocks``), its ``block_table`` and its
``num_cached_tokens``; newer managers also read ``num_scheduled_tokens`` (or
``num_new_tokens``). This class
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
        self.num_new_tokens = 0        # the same, as the layout generation's scheduler sets it
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


def split_sequence(seq_cls: type) -> Any:
    """A subclass giving kvspec's Sequence surface to a Sequence that keeps its prompt and
    its output apart (``prompt_token_ids`` + ``output_token_ids``, ``token_ids`` a derived
    property, ``num_computed_tokens``, no ``append_token``: RichardHuang2006/Mini-vLLM's), or
    None for any other class. The engine appends a sampled token to ``output_token_ids`` and
    its scheduler advances ``num_computed_tokens``; the subclass adds what it lacks of
    ``append_token`` / ``pop_token`` / ``num_cached_tokens`` / ``num_blocks``."""
    fields = set(getattr(seq_cls, "__dataclass_fields__", {}))
    if not {"prompt_token_ids", "output_token_ids", "num_computed_tokens"} <= fields:
        return None

    def append_token(self: Any, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def pop_token(self: Any) -> int:
        return self.output_token_ids.pop() if self.output_token_ids else self.prompt_token_ids.pop()

    def _get(self: Any) -> int:
        return self.num_computed_tokens

    def _set(self: Any, v: int) -> None:
        self.num_computed_tokens = v

    ns: dict = {"__module__": seq_cls.__module__, "__doc__": seq_cls.__doc__}
    for name, value in (("append_token", append_token), ("pop_token", pop_token),
                        ("num_cached_tokens", property(_get, _set))):
        if not hasattr(seq_cls, name) and name not in fields:  # only what it lacks
            ns[name] = value
    if len(ns) == 2 and hasattr(seq_cls, "num_blocks"):
        return None
    if not hasattr(seq_cls, "num_blocks"):
        ns["num_blocks"] = property(lambda self: -(-len(self) // getattr(self, "block_size", 16)))
    return type(seq_cls.__name__, (seq_cls,), ns)


def sequence_factory(seq_cls: type) -> Callable[[list, int, int], Any]:
    """``make(tokens, block_size, n)`` building ``seq_cls`` by its constructor's signature:
    tokens, block size and a sequence id (``n``, as a str where the parameter is annotated
    str) go to the parameters so named, and a required ``sampling_params`` gets the
    package's default ``SamplingParams()`` (``default_sampling_params``); any other
    parameter must have a default. Raises
    TargetError naming a parameter kvspec cannot fill."""
    seq_cls = split_sequence(seq_cls) or seq_cls
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

    def build(tokens: list, block_size: int, n: int) -> Any:
        values = {"tokens": list(tokens), "block_size": block_size, "id": f"kvspec-{n}" if id_is_str else n,
                  "sampling": sampling}
        args, kwargs = [], {}
        for p, role in plan:
            if p.kind is inspect.Parameter.POSITIONAL_ONLY:
                args.append(values[role])
            else:
                kwargs[p.name] = values[role]
        return seq_cls(*args, **kwargs)

    def make(tokens: list, block_size: int, n: int) -> Any:
        try:
            return build(tokens, block_size, n)
        except Exception:
            if not tokens or not init_global_config(seq_cls, block_size):
                raise
            return build(tokens, block_size, n)  # the package's global config is set now

    return make


# -- a package's global config -------------------------------------------------------------
# Some forks keep their Config in a module global that the engine sets before building any
# Sequence (``init_config(model, **kwargs)`` in ``LLMEngine.__init__``; the Sequence's
# constructor calls ``get_config()``, which raises while it is unset). kvspec does what the
# engine does, without loading a model: see init_global_config.
BLOCK_SIZE_FIELDS = ("block_size", "kvcache_block_size")


def _stored_globals(fn: Any) -> set:
    import dis
    try:
        return {i.argval for i in dis.get_instructions(fn) if i.opname == "STORE_GLOBAL"}
    except TypeError:
        return set()


def _config_object(home: Any, init: Any, block_size: int) -> Any:
    """The package's own Config with its declared defaults and the run's block size, built
    without its ``__post_init__`` (which loads a model directory): the class the
    initializer is annotated to return, else ``home.Config``."""
    import dataclasses
    from types import SimpleNamespace
    ret = inspect.signature(init).return_annotation
    cls = ret if isinstance(ret, type) else getattr(home, ret, None) if isinstance(ret, str) else None
    cls = cls if isinstance(cls, type) else getattr(home, "Config", None)
    if not isinstance(cls, type):
        return SimpleNamespace(**{f: block_size for f in BLOCK_SIZE_FIELDS})
    obj = object.__new__(cls)
    if dataclasses.is_dataclass(cls):
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                object.__setattr__(obj, f.name, f.default)
            elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                object.__setattr__(obj, f.name, f.default_factory())  # type: ignore[misc]
    for f in BLOCK_SIZE_FIELDS:
        if hasattr(obj, f) or (dataclasses.is_dataclass(cls) and f in {x.name for x in dataclasses.fields(cls)}):
            object.__setattr__(obj, f, block_size)
    return obj


def init_global_config(seq_cls: type, block_size: int) -> bool:
    """Set the package's global config the Sequence module reads, as the package's engine
    does before it builds a Sequence; True if one was set (with a note). Found by what the
    code does, not by name: a function the Sequence module uses reads a module global that
    is still None, and a function of that global's module stores it (the initializer). The
    initializer is called where it needs no argument (with the run's block size where it
    takes one); otherwise (``init_config(model, **kwargs)``: a model directory) the global
    gets the package's Config class with its declared defaults and the run's block size,
    built without the model."""
    import sys
    from types import FunctionType
    module = sys.modules.get(seq_cls.__module__)
    if module is None:
        return False
    for fn in list(vars(module).values()):
        if not isinstance(fn, FunctionType):
            continue
        home = sys.modules.get(fn.__module__)
        if home is None:
            continue
        unset = [g for g in fn.__code__.co_names if g in vars(home) and vars(home)[g] is None]
        for g in unset:
            init = next((f for f in vars(home).values() if isinstance(f, FunctionType)
                         and f.__module__ == home.__name__ and g in _stored_globals(f)), None)
            if init is None:
                continue
            params = [p for p in inspect.signature(init).parameters.values()
                      if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
            how = ""
            if all(p.default is not p.empty or p.name in BLOCK_SIZE_FIELDS for p in params):
                try:
                    init(**{p.name: block_size for p in params if p.name in BLOCK_SIZE_FIELDS})
                    how = f"called {home.__name__}.{init.__name__}()"
                except Exception:
                    how = ""
            if vars(home).get(g) is None:
                setattr(home, g, _config_object(home, init, block_size))
                how = (f"set {home.__name__}.{g} as {init.__name__} would, to the package's Config with its "
                       f"defaults and block size {block_size}, without loading a model")
            print(f"kvspec: note: {seq_cls.__module__}.{seq_cls.__name__} reads the package's global config "
                  f"({fn.__name__}), which its engine sets before building a Sequence: kvspec {how}",
                  file=sys.stderr)
            return True
    return False


def table_ids(value: Any) -> Any:
    """A Sequence's block table as block ids: a list as is; ``None`` (not allocated yet) as
    empty; a table object (``BlockTable`` with ``block_ids``, RichardHuang2006/Mini-vLLM-like)
    as its ids."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        for attr in ("block_ids", "blocks", "physical_block_ids", "ids"):
            ids = getattr(value, attr, None)
            if ids is not None and not callable(ids):
                return list(ids)
    return value

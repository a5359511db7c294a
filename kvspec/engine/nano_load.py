"""Loading a nano-vllm package's scheduler for the engine level (``nano_engine``), the
stand-in config it is built with, and the check that the built Scheduler takes the calls
the engine level makes.

Loading. As for the cache level (``kvspec.targets.nano_loader``): the package's
``__init__`` is never run (torch models, flash-attn, torch_npu); the scheduler module's
own imports of the package's ``config`` module (transformers' AutoConfig) get a stand-in
whose ``Config`` cannot be built: the scheduler reads its settings off the object it is
given and names the class only in annotations. A FILE target is imported as the cache
level imports it (``file_import.import_in_package``: stand-ins for missing modules). A
``patch`` is applied to temporary copies, scheduler included.

The config. nano-vllm's ``Config`` needs a Hugging Face model directory, so the driver
builds a stand-in with exactly the fields the scheduler reads: ``config.X`` in the
``Scheduler`` class's source, found with ``ast`` at load. Each gets kvspec's value where
kvspec sets it (the pool, the block size, an ``eos`` the sampler never produces, a token
budget and model length of the whole pool, which is what nano-vllm's own ``Config`` asks:
``max_num_batched_tokens >= max_model_len``), else the default of that field in the
package's ``config.py`` (read with ``ast``), else the load fails in one line.
"""
from __future__ import annotations

import ast
import inspect
import sys
import textwrap
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from kvspec.errors import TargetError


@dataclass
class EngineParts:
    """What the engine level loads from a package: its Scheduler, the BlockManager and
    Sequence classes that scheduler module uses, and the package's ``config.py``."""
    scheduler_cls: type
    manager_cls: type
    seq_cls: type
    config_file: Optional[Path]
    name: str
    scheduler_file: Optional[Path] = None  # the source the Scheduler was loaded from (a patched copy too)


# -- loading -------------------------------------------------------------------------------
class _UnbuildableConfig:
    """Stands in for the package's ``Config`` in its scheduler module: building it would load
    a model directory."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TargetError("the scheduler builds its package's Config, which needs a model directory: "
                          "kvspec gives it a stand-in config object instead")


def _parts(module: types.ModuleType, name: str, config_file: Optional[Path]) -> EngineParts:
    sched = getattr(module, "Scheduler", None)
    if not isinstance(sched, type):
        raise TargetError(f"target {name}: {module.__name__} defines no class Scheduler")
    found = {}
    for attr in ("BlockManager", "Sequence"):
        v = module.__dict__.get(attr)
        if not isinstance(v, type):
            raise TargetError(f"target {name}: {module.__name__} does not import a class {attr} "
                              f"(the engine level reads the manager and the Sequence its scheduler uses)")
        found[attr] = v
    f = getattr(module, "__file__", None)
    return EngineParts(sched, found["BlockManager"], found["Sequence"], config_file, name, Path(f) if f else None)


def load_package_engine(package: str = "nanovllm", patch_text: Optional[str] = None) -> EngineParts:
    """The Scheduler of the installed ``package`` (``PKG/engine/scheduler.py``), with the
    BlockManager and Sequence its module imports; patched if ``patch_text``."""
    import importlib

    from kvspec.targets.nano_loader import import_overlay, module_name, package_dir, patched_files
    from kvspec.targets.stub_import import stand_ins

    name = "nanovllm" if package == "nanovllm" else f"nanovllm:{package}"
    pkg_dir = package_dir(package)
    engine = pkg_dir / "engine"
    if not (engine / "scheduler.py").is_file():
        raise TargetError(f"target {name}: {engine}/scheduler.py does not exist (the engine level drives the "
                          f"package's own Scheduler)")
    mods = [f"{package}.engine.{m}" for m in ("sequence", "block_manager", "scheduler")]
    leaves = {f"{package}.config": {"Config": _UnbuildableConfig}}
    try:
        with stand_ins(pkg_dir, (package, f"{package}.engine"), leaves):
            if patch_text is None:
                mod = [importlib.import_module(m) for m in mods][-1]
            else:
                files = {module_name(rel): f for rel, f in
                         patched_files(pkg_dir.parent, f"{package}/", patch_text, f"nanoengine_{package}").items()}
                for m in mods:  # re-run all three, so each binds the patched others
                    files.setdefault(m, engine / f"{m.rsplit('.', 1)[1]}.py")
                with import_overlay(files):
                    mod = [importlib.import_module(m) for m in mods][-1]
    except TargetError:
        raise
    except Exception as e:  # a missing dependency, or the module's own failure
        raise TargetError(f"target {name}: cannot import {mods[-1]}: {type(e).__name__}: {e}") from None
    cfg = pkg_dir / "config.py"
    return _parts(mod, name, cfg if cfg.is_file() else None)


def scheduler_file(path: Path) -> Path:
    """The ``scheduler.py`` of a FILE target: the file itself, or the one beside it."""
    path = path.resolve()
    f = path if path.name == "scheduler.py" else (path if path.is_dir() else path.parent) / "scheduler.py"
    if not f.is_file():
        raise TargetError(f"target {path}: no scheduler.py beside it (--level engine drives the package's own "
                          f"Scheduler; use --level cache for a block manager alone)")
    return f


def load_file_engine(path: Path, patch_text: Optional[str] = None) -> EngineParts:
    """The Scheduler in the ``scheduler.py`` beside ``path``, imported in its package (see
    the module doc); ``patch_text``: a diff relative to the package root's parent."""
    from kvspec.targets.file_import import import_in_package, package_root
    from kvspec.targets.nano_loader import module_name, patched_files

    sched = scheduler_file(Path(path))
    found = package_root(sched)
    if found is None:
        raise TargetError(f"target {path}: {sched} is in no package (its scheduler imports the block manager "
                          f"by the package's name)")
    root, modname = found
    files = None
    if patch_text is not None:
        files = {module_name(rel): f for rel, f in patched_files(root, "", patch_text, "nanoengine_file").items()}
        for f in sched.parent.glob("*.py"):  # re-run the engine modules so each binds the patched others
            files.setdefault(f"{modname.rsplit('.', 1)[0]}.{f.stem}", f)
    try:
        mod = import_in_package(root, modname, lambda line: print(line, file=sys.stderr), files)
    except TargetError:
        raise
    except Exception as e:
        raise TargetError(f"target {path}: cannot import {modname}: {type(e).__name__}: {e}") from None
    top = root / modname.split(".", 1)[0] / "config.py"
    return _parts(mod, str(path), top if top.is_file() else None)


# -- the stand-in config ---------------------------------------------------------------------
def config_reads(scheduler_cls: type, source: Optional[Path] = None) -> list[str]:
    """The ``config.X`` fields the Scheduler's source reads (the parameter ``config`` of its
    ``__init__``, or ``self.config``), in order of appearance. ``source``: the file it was
    loaded from (a patched module is gone from ``sys.modules`` once loaded)."""
    try:
        if source is not None:
            tree = next(n for n in ast.walk(ast.parse(source.read_text(encoding="utf-8", errors="replace")))
                        if isinstance(n, ast.ClassDef) and n.name == scheduler_cls.__name__)
        else:
            tree = ast.parse(textwrap.dedent(inspect.getsource(scheduler_cls)))
    except (OSError, TypeError, SyntaxError, ValueError, StopIteration):
        return []
    init = inspect.signature(scheduler_cls.__init__).parameters
    param = next((p for p in list(init)[1:2]), "config")
    out: list[str] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        direct = isinstance(v, ast.Name) and v.id == param
        via_self = isinstance(v, ast.Attribute) and v.attr == param and isinstance(v.value, ast.Name) \
            and v.value.id == "self"
        if (direct or via_self) and node.attr not in out:
            out.append(node.attr)
    return out


def config_defaults(config_file: Optional[Path]) -> dict[str, Any]:
    """Literal field defaults of the ``Config`` class in the package's ``config.py``."""
    if config_file is None:
        return {}
    try:
        tree = ast.parse(config_file.read_text(encoding="utf-8", errors="replace"))
    except (OSError, SyntaxError, ValueError):
        return {}
    out: dict[str, Any] = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Config"):
        for st in cls.body:
            if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.value is not None:
                try:
                    out[st.target.id] = ast.literal_eval(st.value)
                except ValueError:
                    continue
    return out


class StandInConfig:
    """The object a Scheduler is built with in place of its package's Config: only fields."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)

    def __repr__(self) -> str:
        return f"StandInConfig({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


def stand_in_config(parts: EngineParts, values: dict[str, Any]) -> StandInConfig:
    """The object the Scheduler is built with (see the module doc)."""
    defaults = config_defaults(parts.config_file)
    cfg = {}
    for f in config_reads(parts.scheduler_cls, parts.scheduler_file):
        if f in values:
            cfg[f] = values[f]
        elif f in defaults:
            cfg[f] = defaults[f]
        else:
            raise TargetError(f"target {parts.name}: its Scheduler reads config.{f}, which kvspec does not set and "
                              f"the package's Config gives no literal default for")
    cfg.update(tied_sizes(cfg, defaults, values))
    return StandInConfig(**cfg)


BLOCK_SIZE_FIELDS = ("kvcache_block_size", "block_size")

# A Scheduler built from separate numbers (``Scheduler(max_num_sequences, ..., block_size, eos)``)
# instead of one config: each parameter by its name, else by the BlockManager parameter it is
# passed on to (``BlockManager(max_cached_blocks, block_size)``: the pool's size).
_PARAM_VALUES = {"num_kvcache_blocks": ("num_kvcache_blocks", "num_blocks", "num_gpu_blocks", "total_blocks"),
                 "kvcache_block_size": ("kvcache_block_size", "block_size", "page_size"),
                 "max_num_seqs": ("max_num_seqs", "max_num_sequences", "max_seqs", "max_batch_size"),
                 "max_num_batched_tokens": ("max_num_batched_tokens", "max_batched_tokens", "max_tokens_per_batch"),
                 "max_model_len": ("max_model_len", "max_seq_len"),
                 "eos": ("eos", "eos_token_id", "eos_id")}


NANO_MAX_NUM_SEQS = 512  # nano-vllm's Config default


def _value_for(param: str, values: dict[str, Any]) -> Optional[str]:
    return next((k for k, names in _PARAM_VALUES.items() if param in names and k in values), None)


def scheduler_arguments(parts: "EngineParts", values: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The keyword arguments of a Scheduler built from separate numbers, or None when it takes
    one config object (the usual ``Scheduler(config)``). A required parameter kvspec cannot
    give a value is refused in one line naming it."""
    try:
        params = [q for q in inspect.signature(parts.scheduler_cls.__init__).parameters.values()
                  if q.name != "self" and q.kind in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD, q.KEYWORD_ONLY)]
    except (TypeError, ValueError):
        return None
    required = [q for q in params if q.default is q.empty]
    if not params or any(w in params[0].name.lower() for w in ("conf", "cfg")) or (
            len(required) <= 1 and not (required and _value_for(required[0].name, values))):
        return None  # Scheduler(config[, callbacks=None])
    passed = _passed_to_manager(parts)
    values = {"max_num_seqs": NANO_MAX_NUM_SEQS, **values}  # no Config to take its default from: nano-vllm's
    out: dict[str, Any] = {}
    for q in params:
        key = _value_for(q.name, values) or _value_for(passed.get(q.name, ""), values)
        if key is not None:
            out[q.name] = values[key]
        elif q.default is q.empty:
            raise TargetError(f"target {parts.name}: its Scheduler takes {q.name}, which kvspec cannot give a value "
                              f"(it sets {', '.join(sorted(values))}, by name or by the BlockManager parameter a "
                              f"Scheduler parameter is passed on to)")
    return out


def _passed_to_manager(parts: "EngineParts") -> dict[str, str]:
    """Scheduler.__init__ parameter -> the BlockManager parameter it is passed as
    (``BlockManager(max_cached_blocks, block_size)`` -> {max_cached_blocks: num_blocks, ...})."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(parts.scheduler_cls.__init__)))
        mparams = [q for q in inspect.signature(parts.manager_cls.__init__).parameters if q != "self"]
    except (TypeError, OSError, SyntaxError, IndentationError, ValueError):
        return {}
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == parts.manager_cls.__name__:
            for q, a in zip(mparams, node.args):
                if isinstance(a, ast.Name):
                    out[a.id] = q
            for kw in node.keywords:
                if kw.arg and isinstance(kw.value, ast.Name):
                    out[kw.value.id] = kw.arg
    return out


def add_method(sched: Any) -> Optional[str]:
    """The Scheduler's method that takes a new Sequence: ``add``, else the one public method
    of one argument whose body appends that argument to ``self.waiting`` (``add_sequence``)."""
    if callable(getattr(sched, "add", None)):
        return "add"
    for name in sorted(dir(type(sched))):
        fn = getattr(type(sched), name, None)
        if name.startswith("_") or not inspect.isfunction(fn):
            continue
        try:
            args = [q for q in inspect.signature(fn).parameters if q != "self"]
            tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        except (TypeError, OSError, SyntaxError, IndentationError, ValueError):
            continue
        if len(args) != 1:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in ("append", "appendleft") and isinstance(node.func.value, ast.Attribute) \
                    and node.func.value.attr == "waiting" and any(isinstance(a, ast.Name) and a.id == args[0]
                                                                  for a in node.args):
                return name
    return None



def tied_sizes(cfg: dict[str, Any], defaults: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """The config's other sizes tied to its block size, kept tied at the run's block size.

    A package whose Config ties a size to the block size (``kvcache_block_size = 256;
    logical_page_size = 32``, and its BlockManager asserts ``block_size %
    logical_page_size == 0``) refuses the run's block size with the tied size's default
    (a page of 32 in a block of 4). kvspec sets the block size, so it sets the sizes tied to
    it too, in the package's own ratio (8 pages per block) as far as the run's block size
    allows: the largest divisor of it no larger than ``block_size // ratio`` (at least 1).
    Tied: an int field named ``*size*`` whose default divides the block size's default and
    is smaller. (The cache level runs such a package at its own block size with scaled
    requests, ``nano_api.tied_block_size``; an engine step decodes one token of the
    package's, which cannot stand for a scaled run of them, so the engine level keeps the
    run's block size and scales the tie instead.)"""
    field = next((f for f in BLOCK_SIZE_FIELDS if f in cfg and f in values), None)
    own = defaults.get(field) if field else None
    run = cfg.get(field) if field else None
    if not (isinstance(own, int) and isinstance(run, int) and own > 1 and run >= 1):
        return {}
    out = {}
    for name, d in defaults.items():
        if (name in cfg and name not in values and name not in BLOCK_SIZE_FIELDS and "size" in name
                and isinstance(d, int) and not isinstance(d, bool) and 1 < d < own and own % d == 0):
            cap = max(1, run // (own // d))
            out[name] = max(v for v in range(1, cap + 1) if run % v == 0)
    return out


# -- the scheduler's shape ----------------------------------------------------------------------
SCHEDULER_CONTRACT = ("add(seq) (or a method that appends its one argument to self.waiting), schedule() -> seqs, "
                      "(seq, tokens) pairs, (seqs, is_prefill) or an object with a .sequences/.seqs/.scheduled "
                      "field, postprocess(seqs or that object, token_ids[, is_prefill]) or finish(seq), is_finished(); "
                      "attributes running, waiting, block_manager")
BATCH_FIELDS = ("sequences", "seqs", "scheduled", "scheduled_seqs", "batch")


def unreadable_batch(sched: Any) -> str:
    """Why kvspec could not read a batch out of what ``schedule()`` returns, read from its
    source before the first step ('' when it can, or cannot tell): a dict, a set or a
    constant, or an instance of a class of the scheduler's module without a batch field."""
    fn = getattr(type(sched), "schedule", None)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (TypeError, OSError, SyntaxError, IndentationError):
        return ""
    module = sys.modules.get(type(sched).__module__)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Return) or node.value is None:
            continue
        v = node.value
        if isinstance(v, (ast.Dict, ast.Set, ast.DictComp, ast.SetComp, ast.JoinedStr)) or (
                isinstance(v, ast.Constant) and v.value is not None):
            return f"schedule() returns {type(v).__name__.lower()}, not a batch of sequences"
        if isinstance(v, ast.Call) and isinstance(v.func, ast.Name):
            cls = getattr(module, v.func.id, None)
            if isinstance(cls, type) and cls.__module__ == getattr(module, "__name__", None) and not any(
                    f in getattr(cls, "__annotations__", {}) or hasattr(cls, f) for f in BATCH_FIELDS):
                return (f"schedule() returns a {cls.__name__}, which has none of the fields kvspec reads a batch "
                        f"from ({', '.join('.' + f for f in BATCH_FIELDS)})")
    return ""


def check_scheduler(name: str, sched: Any) -> None:
    """The calls the engine level makes on a package's Scheduler, checked before the first
    one (one line, exit 2): a fork whose scheduler is shaped otherwise is kvspec's mismatch,
    never a finding against it."""
    def arity_ok(fn: Any, n: int) -> bool:
        try:
            inspect.signature(fn).bind(*range(n))
            return True
        except TypeError:
            return False
        except ValueError:  # no signature to read: let the call decide
            return True

    problems = []
    for meth, n in ((add_method(sched) or "add", 1), ("schedule", 0), ("is_finished", 0)):
        fn = getattr(sched, meth, None)
        if not callable(fn):
            problems.append(f"no {meth}()")
        elif not arity_ok(fn, n):
            problems.append(f"{meth}{inspect.signature(fn)} cannot be called with {n} argument(s)")
    post, fin = getattr(sched, "postprocess", None), getattr(sched, "finish", None)
    if callable(post):
        if not (arity_ok(post, 2) or arity_ok(post, 3)):
            problems.append(f"postprocess{inspect.signature(post)} takes neither (seqs, token_ids) nor "
                            f"(seqs, token_ids, is_prefill)")
    elif not callable(fin):
        problems.append("neither postprocess() nor finish()")
    for attr in ("running", "waiting"):
        if not hasattr(sched, attr):
            problems.append(f"no {attr} queue")
    shape = unreadable_batch(sched)
    if shape:
        problems.append(shape)
    if problems:
        raise TargetError(f"target {name}: its Scheduler does not fit the calls kvspec's engine level makes "
                          f"({'; '.join(problems)}): it drives {SCHEDULER_CONTRACT}")

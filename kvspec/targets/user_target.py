"""User targets: ``FILE.py:NAME`` and ``module:NAME``, a user's own allocator class.

Loading, as the user's own code runs (``kvspec.targets.file_import``). A ``FILE.py`` in a
package (its own absolute imports name its top-level package, or a chain of
``__init__.py``, or relative imports say so) is imported under its real dotted name from
the package root, without running the parent packages' ``__init__`` unless the module
imports a name only an ``__init__`` defines; an installed package of the same name is set
aside for the import. A ``FILE.py`` in no package is executed as a fresh module (its
directory on ``sys.path`` while it runs, so it can import its neighbours). ``module`` is
imported by name, with the working directory first on ``sys.path``. A third-party module
the import needs that is not installed is stood in for, with a note on stderr (calling it
later is exit 2). The import is bounded by ``--op-timeout`` (the installed libraries the
file imports are imported first, untimed: torch's import is not the user's hang).
``NAME`` may be dotted (``Outer.Inner``). Nothing is cached between loads of different
patches.

The contract (``kvspec.targets.contract``, printed by ``kvspec api``). Before anything is
called, every call the driver will make is bound against the class's signatures; a call
that does not fit is a one-line TargetError giving the call kvspec makes.

What NAME may be. A class, built by kvspec with its API's constructor convention, or a
factory (any other callable) called with that same convention and returning the
allocator:

==================  ============================================  ====================
API (``--api``)     methods kvspec looks for                      built as
==================  ============================================  ====================
``nanovllm``        can_allocate, allocate, deallocate,           ``X(num_blocks, block_size)``
                    can_append, may_append
``kvcachemanager``  get_computed_blocks, allocate_slots, free     ``X(num_gpu_blocks, block_size, enable_caching=...)``
                                                                  (kvspec impl style), or vLLM's
                                                                  ``X(kv_cache_config, max_model_len, ...)``
``blockpool``       get_new_blocks, free_blocks, touch,           ``X(num_gpu_blocks, enable_caching=...)``
                    cache_full_blocks, get_cached_block,          (impl style), or vLLM's
                    reset_prefix_cache                            ``X(num_gpu_blocks, enable_caching, hash_block_size)``
==================  ============================================  ====================

Without ``--api`` the API is detected from the methods (on the class, or on what the
factory returns for ``(4, 2)``); a class with several is taken as the first of
nanovllm, kvcachemanager, blockpool. Which of the two signatures a vLLM-style class
has is read from its parameters: a ``cache_full_blocks`` whose first parameter is
``request``, or a constructor whose first is ``kv_cache_config``, is vLLM 0.33.0's,
and is driven exactly as ``--target vllm`` drives vLLM (vLLM's own Request objects and
hashing: vllm must be installed); otherwise it is kvspec's ``impl`` API (see
``impl/``), driven as ``--target impl`` is. The adapters are the same ones, handed
the user's class instead of the upstream one.

The nano-vllm API and Sequences. The manager reads requests through nano-vllm
``Sequence`` objects. If the module that defines the class also has a ``Sequence``
class (as ``nanovllm.engine.block_manager`` imports one), kvspec uses it, built as
``Sequence(token_ids)`` with ``block_size`` set on each instance to the manager's;
otherwise kvspec supplies ``kvspec.targets.nano_sequence.Sequence``, which has exactly
the surface nano-vllm's managers read (``len``, ``block(i)``, ``num_blocks``,
``block_table``, ``num_cached_tokens``, ``num_scheduled_tokens``, ``append_token``).
A Sequence class is built by its constructor's signature (``token_ids``, ``block_size``,
``seq_id``: ``nano_sequence.sequence_factory``).

Policies. Declared, never read off the class (``kvspec.targets.policies``): the class's
``kvspec_traits`` attribute (the patched class's, under ``--patch``), else ``[tool.kvspec]``
in the pyproject.toml nearest the file, else kvspec's declaration for the released package
that ships it, else vLLM's defaults with a note on stderr.

``module:NAME`` whose package ``__init__`` fails to import (GPU-only libraries such as
flash-attn or torch_npu) is imported again with its parent packages stubbed out
(``nano_loader.import_module_light``).

What the observation reads. Each adapter reads the allocator's internals, so a class
needs them too: nano-vllm's ``blocks`` (``ref_count``, ``hash``, ``token_ids``),
``free_block_ids``, ``used_block_ids``, ``hash_to_block_id``; or a vLLM-v1-shaped
pool's ``blocks`` (``block_id``, ``ref_cnt``, ``block_hash``), ``free_block_queue``
(a doubly linked list with head and tail sentinels), ``cached_block_hash_to_block``,
``get_num_free_blocks()``. A class without them is refused with one line.

``--patch`` for user targets. For ``FILE.py`` the diff may change only that file,
named by its path relative to the current directory (or by its bare name). For
``module:NAME`` the paths are relative to the ``sys.path`` directory holding the
module's top-level package (``mypkg/alloc.py``), as in that package's repository.
Patched copies live in kvspec's temporary directory; the user's files are never
written.

Every failure is a ``TargetError`` with one line.

This module is longer than 450 lines because it resolves one target spec through loading,
API detection and the three APIs' targets; the loading itself lives in ``file_import``.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, Callable, Optional

from kvspec.spec.config import Config
from kvspec.patching import PatchError, apply_unified_diff, parse_unified_diff, write_inside
from kvspec.targets.base import Driver, Target, TargetError, Traits
from kvspec.targets.nano_loader import import_overlay, module_name, patched_files
from kvspec.targets.nano_loader import import_module_light, stub_parents
from kvspec.targets.contract import check_nano, check_v1, describe_exception
from kvspec.targets.file_import import bounded, import_dependencies, import_in_package, import_limit, op_timeout, package_root, with_stand_ins
from kvspec.targets.nanovllm_target import NANO_METHODS, NanoTarget, declared_nano_traits
from kvspec.targets.policies import declared_traits

POOL_METHODS = ("get_new_blocks", "free_blocks", "touch", "cache_full_blocks", "get_cached_block",
                "reset_prefix_cache")
MANAGER_METHODS = ("get_computed_blocks", "allocate_slots", "free")
API_METHODS = {"nanovllm": NANO_METHODS, "kvcachemanager": MANAGER_METHODS, "blockpool": POOL_METHODS}
API_NAMES = {"nanovllm": "nano-vllm BlockManager", "kvcachemanager": "KVCacheManager", "blockpool": "BlockPool",
             "allocator": "allocator"}
PROBE_SIZE = (4, 2)  # what a factory is called with to see what it returns
_IMPL_ARGS = {"pool": (4,), "cache": (4, 2)}  # what the impl drivers' probe build passes (num_blocks[, block_size])


# -- loading -----------------------------------------------------------------------------
def parse_spec(spec: str) -> tuple[str, str]:
    """``FILE.py:NAME`` / ``module:NAME`` -> (where, NAME)."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise TargetError(f"target {spec!r}: expected FILE.py:NAME or module:NAME")
    if not all(part.isidentifier() for part in name.split(".")):
        raise TargetError(f"target {spec}: {name!r} is not a Python name")
    return where, name


def _alias(path: Path, patch_text: Optional[str]) -> str:
    digest = hashlib.sha1(f"{path}\0{patch_text or ''}".encode()).hexdigest()[:10]
    stem = "".join(c if c.isalnum() else "_" for c in path.stem)
    return f"_kvspec_user_{stem}_{digest}"


def _exec_file(spec: str, source: Path, run_from: Path, alias: str) -> ModuleType:
    """Execute ``source`` as module ``alias`` with ``run_from``'s directory on sys.path."""
    if alias in sys.modules:
        return sys.modules[alias]
    mspec = importlib.util.spec_from_file_location(alias, source)
    if mspec is None or mspec.loader is None:
        raise TargetError(f"target {spec}: cannot load {source} as Python")
    module = importlib.util.module_from_spec(mspec)
    sys.modules[alias] = module  # dataclasses and the like look themselves up here
    here = str(run_from.parent)
    sys.path.insert(0, here)
    try:
        mspec.loader.exec_module(module)
    except (SyntaxError, ImportError):
        del sys.modules[alias]
        raise
    except Exception as e:
        del sys.modules[alias]
        raise TargetError(f"target {spec}: importing {run_from} raised {type(e).__name__}: {e}") from None
    finally:
        try:
            sys.path.remove(here)
        except ValueError:
            pass
    return module


def _patched_file(spec: str, path: Path, patch_text: str) -> Path:
    """The patched copy of ``path``; the diff may name only that file."""
    from kvspec.targets.patched import _tmp_dir

    cwd = Path.cwd().resolve()
    for fp in parse_unified_diff(patch_text):
        if (cwd / fp.path).resolve() != path and fp.path != path.name:
            raise PatchError(f"{fp.path}: a --patch for target {spec} may change only {path.name} "
                             f"(named relative to the current directory)")

    def read(rel: str) -> str:
        return path.read_text()

    texts = apply_unified_diff(patch_text, read)
    return write_inside(_tmp_dir() / _alias(path, patch_text), path.name,
                        next(iter(texts.values())) if texts else path.read_text())


def _note(line: str) -> None:
    print(line, file=sys.stderr)


def _load_file(spec: str, where: str, patch_text: Optional[str]) -> ModuleType:
    """A file in a package is imported under its real name from its package root, without
    its parents' ``__init__`` (``file_import``); a file in no package is executed as a
    fresh module. Either import is bounded by ``--op-timeout``."""
    path = Path(where).expanduser()
    if not path.is_file():
        raise TargetError(f"target {spec}: no such file {where}")
    path = path.resolve()
    source = path if patch_text is None else _patched_file(spec, path, patch_text)
    found = package_root(path)
    import_dependencies(path, found[0] if found else path.parent, found[1].split(".")[0] if found else "")
    if found is None:
        alias = _alias(path, patch_text)
        return bounded(op_timeout(), f"target {spec}: importing {where}",
                       lambda: with_stand_ins(where, alias, _note, lambda: _exec_file(spec, source, path, alias)))
    root, modname = found
    files = None if patch_text is None else {modname: source}
    seconds, why = import_limit(modname.split(".", 1)[0], path)
    try:
        return bounded(seconds, f"target {spec}: importing {modname}",
                       lambda: import_in_package(root, modname, _note, files), why)
    except (SyntaxError, ImportError, TargetError, PatchError):
        raise
    except Exception as e:
        raise TargetError(f"target {spec}: importing {modname} (from {root}) raised "
                          f"{type(e).__name__}: {e}") from None


def _module_root(spec: str, modname: str) -> tuple[Path, str]:
    """(the sys.path directory holding ``modname``'s top-level package, that package's name)."""
    top = modname.split(".", 1)[0]
    try:
        found = importlib.util.find_spec(top)
    except (ImportError, ValueError) as e:
        raise TargetError(f"target {spec}: cannot import {modname}: {e}") from None
    if found is None:
        raise TargetError(f"target {spec}: no module named {top!r}")
    if found.submodule_search_locations:
        return Path(list(found.submodule_search_locations)[0]).parent, top
    if found.origin and found.origin not in ("built-in", "frozen"):
        return Path(found.origin).parent, top
    raise TargetError(f"target {spec}: {top} has no source files to patch")


def _cwd_on_path() -> None:
    """The working directory comes first on sys.path, as ``python -m`` puts it: ``module:NAME``
    names the user's module from where kvspec runs, without PYTHONPATH."""
    cwd = str(Path.cwd())
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def _load_module(spec: str, modname: str, patch_text: Optional[str]) -> ModuleType:
    _cwd_on_path()
    if patch_text is None:
        top = modname.split(".", 1)[0]
        seconds, why = import_limit(top)
        try:
            return bounded(seconds, f"target {spec}: importing {modname}",
                           lambda: with_stand_ins(modname, top, _note, lambda: import_module_light(modname)), why)
        except (SyntaxError, ImportError, TargetError):
            raise
        except Exception as e:
            raise TargetError(f"target {spec}: importing {modname} raised {type(e).__name__}: {e}") from None
    root, top = _module_root(spec, modname)
    is_pkg = (root / top).is_dir()
    prefix = f"{top}/" if is_pkg else f"{top}.py"
    for fp in parse_unified_diff(patch_text):
        if not fp.path.startswith(prefix):
            raise PatchError(f"{fp.path}: not under {prefix} (diff paths are relative to {root})")
    files = {module_name(rel): f for rel, f in patched_files(root, prefix, patch_text, f"user_{top}").items()}
    import_module_light(modname)  # the originals, put back after the window
    if modname not in files:  # re-run the target module too, so it binds the patched ones
        origin = getattr(sys.modules[modname], "__file__", None)
        if origin:
            files[modname] = Path(origin)
    try:
        with import_overlay(files), stub_parents(modname):
            return importlib.import_module(modname)
    except (SyntaxError, ImportError, PatchError):
        raise
    except Exception as e:
        raise TargetError(f"target {spec}: the patched {modname} raised {type(e).__name__} on import: {e}") from None


def load_object(spec: str, patch_text: Optional[str] = None) -> tuple[Any, ModuleType]:
    """(the object NAME names, the module it was found in)."""
    where, name = parse_spec(spec)
    from kvspec.targets.target_output import stdout_to_stderr
    with stdout_to_stderr():  # what the user's module prints at import never enters kvspec's stdout (--json)
        module = _load_file(spec, where, patch_text) if where.endswith(".py") else _load_module(spec, where, patch_text)
    obj: Any = module
    for part in name.split("."):
        if not hasattr(obj, part):
            raise TargetError(f"target {spec}: {where} has no {name}")
        obj = getattr(obj, part)
    return obj, module


# -- API detection -----------------------------------------------------------------------
def _params(fn: Any) -> list[str]:
    """Parameter names, ``self`` excluded."""
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []
    return names[1:] if names[:1] == ["self"] else names


def _missing(cls: type, api: str, source: Optional[Path] = None) -> list[str]:
    if api == "nanovllm":  # declared or aliased names, and a chunked manager without can_append/may_append
        from kvspec.targets.names import load_names
        from kvspec.targets.nanovllm_target import missing_nano_methods
        names = load_names(cls, source)
        names.quiet = True  # probing the API: the notes come with the load
        return missing_nano_methods(cls, names)
    return [m for m in API_METHODS[api] if not callable(getattr(cls, m, None))]


def resolve(obj: Any, spec: str, api: Optional[str], source: Optional[Path] = None
            ) -> tuple[str, type, Optional[Callable[..., Any]]]:
    """(api, the allocator's class, the factory or None); ``source`` is the file whose
    nearest pyproject.toml may declare ``[tool.kvspec.names]``."""
    if api is not None and api not in API_METHODS:
        raise TargetError(f"--api {api}: choose one of {', '.join(API_METHODS)}, allocator")
    if isinstance(obj, type):
        cls, make = obj, None
    elif callable(obj):
        make = obj
        try:
            ret = inspect.signature(obj).return_annotation
        except (TypeError, ValueError):
            ret = inspect.Signature.empty
        if isinstance(ret, type) and ret is not inspect.Signature.empty:
            cls = ret
        else:
            try:
                cls = type(obj(*PROBE_SIZE))
            except Exception as e:
                raise TargetError(f"target {spec}: calling the factory {getattr(obj, '__name__', obj)}"
                                  f"{PROBE_SIZE} raised {type(e).__name__}: {e}") from None
    else:
        raise TargetError(f"target {spec}: {type(obj).__name__} object is neither a class nor a factory")
    if api is not None:
        missing = _missing(cls, api, source)
        if missing:
            raise TargetError(f"target {spec}: {cls.__name__} lacks the {API_NAMES[api]} methods {', '.join(missing)}")
        return api, cls, make
    for a in API_METHODS:
        if not _missing(cls, a, source):
            return a, cls, make
    closest = min(API_METHODS, key=lambda a: len(_missing(cls, a, source)))
    raise NoKnownApi(cls, make, f"target {spec}: {cls.__name__} has none of the APIs kvspec drives (nano-vllm BlockManager, "
                      f"vLLM KVCacheManager, vLLM BlockPool); as a {API_NAMES[closest]} it lacks "
                      f"{', '.join(_missing(cls, closest, source))}")


class NoKnownApi(TargetError):
    """None of the three APIs fits: the allocator level (``kvspec.alloc``) is tried next."""

    def __init__(self, cls: type, make: Optional[Callable[..., Any]], message: str) -> None:
        super().__init__(message)
        self.cls, self.make = cls, make


def is_vllm_signature(cls: type, api: str) -> bool:
    if api == "blockpool":
        return _params(cls.cache_full_blocks)[:1] == ["request"] or "hash_block_size" in _params(cls.__init__)
    if api == "kvcachemanager":
        return _params(cls.__init__)[:1] == ["kv_cache_config"]
    return False


# -- targets -----------------------------------------------------------------------------
class _UpstreamView:
    """vLLM's ``Upstream`` (kvspec.vllm.target) with the user's class in place
    of vLLM's BlockPool or KVCacheManager: the vLLM drivers build from ``up.block_pool``
    and ``up.manager``, and take everything else (Request, hashing) from vLLM."""

    def __init__(self, up: Any, **replace: Any) -> None:
        self._up = up
        self.__dict__.update(replace)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._up, name)


class UserTarget(Target):
    """A user's BlockPool or KVCacheManager, driven by the impl or vLLM adapter."""

    def __init__(self, name: str, traits: Traits, make_driver: Callable[[Config], Driver], api: str, style: str) -> None:
        self.name, self.traits, self._make_driver, self.api, self.style = name, traits, make_driver, api, style

    def driver(self, config: Config) -> Driver:
        return self._make_driver(config)

    def describe(self) -> str:
        return f"{self.name} ({self.style} {API_NAMES[self.api]} API)"


def _vllm_target(spec: str, api: str, build: Any, cls: Optional[type] = None, source: Optional[Path] = None
                 ) -> UserTarget:
    try:
        from kvspec.vllm.patch import import_vllm
        from kvspec.vllm.target import Upstream, VllmCacheDriver, VllmPoolDriver
        up = Upstream(import_vllm(None))
    except ImportError as e:
        raise TargetError(f"target {spec}: a vLLM-style {API_NAMES[api]} is driven with vLLM's Request and "
                          f"hashing, and vllm cannot be imported: {e}") from None
    import logging
    logging.getLogger("vllm").setLevel(logging.ERROR)
    base = Traits(null_block=True, unhashed_free_first=True, misuse_errors=(),
                  documented_noops=frozenset({"null_block", "foreign_free", "free_unknown_request"}),
                  levels=("pool",) if api == "blockpool" else ("cache",))
    traits = base if cls is None else declared_traits(base, cls=cls, source=source, name=spec, note=False)
    if api == "blockpool":
        view = _UpstreamView(up, block_pool=SimpleNamespace(BlockPool=build))
        target = UserTarget(spec, traits, lambda c: VllmPoolDriver(view, c), api, "vLLM")
    else:
        view = _UpstreamView(up, manager=SimpleNamespace(KVCacheManager=build))
        target = UserTarget(spec, traits, lambda c: VllmCacheDriver(view, c), api, "vLLM")
    try:  # the shape the vLLM adapter reads (vLLM's own internals)
        target.driver(Config(level=traits.levels[0], num_blocks=4, block_size=2)).observe()
    except Exception as e:
        raise TargetError(f"target {spec}: kvspec cannot build or observe this vLLM-style {API_NAMES[api]} as it "
                          f"does vLLM's: {type(e).__name__}: {e}") from None
    if cls is not None:
        declared_traits(base, cls=cls, source=source, name=spec)  # the note, once the class is known to work
    return target


def _impl_target(spec: str, api: str, cls: type, build: Any, module: ModuleType, source: Optional[Path] = None,
                 note: bool = True) -> UserTarget:
    from kvspec.targets.impl_target import ImplCacheDriver, ImplPoolDriver
    from kvspec.targets.v1_driver import observe_pool

    if api == "kvcachemanager":
        missing = [m for m in ("make_request", "get_block_ids") if not callable(getattr(cls, m, None))]
        if missing:
            raise TargetError(f"target {spec}: {cls.__name__} has the KVCacheManager methods but not "
                              f"{', '.join(missing)} (kvspec's impl API: make_request(request_id, prompt_token_ids), "
                              f"get_block_ids(request_id)), nor vLLM's constructor (kv_cache_config, ...)")
        check_v1(spec, api, False, cls, build)
        ns = SimpleNamespace(KVCacheManager=build)
        make_driver: Callable[[Config], Driver] = lambda c: ImplCacheDriver(ns, c, features=False)  # noqa: E731
        level = "cache"
    else:
        check_v1(spec, api, False, cls, build)
        ns = SimpleNamespace(BlockPool=build)
        make_driver = lambda c: ImplPoolDriver(ns, c)  # noqa: E731
        level = "pool"
    try:
        probe = make_driver(Config(level=level, num_blocks=4, block_size=2))
    except Exception as e:
        raise TargetError(f"target {spec}: cannot build {cls.__name__} as kvspec's impl API does "
                          f"({cls.__name__}({', '.join(map(str, _IMPL_ARGS[level]))}, enable_caching=True)): "
                          f"{describe_exception(e)}") from None
    pool = probe.mgr.block_pool if level == "cache" else probe.pool
    try:
        observe_pool(pool)
    except Exception as e:
        raise TargetError(f"target {spec}: {cls.__name__} has the {API_NAMES[api]} methods but kvspec cannot read "
                          f"its internals (blocks, free_block_queue, cached_block_hash_to_block, "
                          f"get_num_free_blocks): {type(e).__name__}: {e}") from None
    # Declared policies (a class attribute or [tool.kvspec]), else vLLM's, with a note.
    traits = declared_traits(Traits(levels=(level,)), cls=cls, source=source, name=spec.split("+", 1)[0], note=note)
    return UserTarget(spec, traits, make_driver, api, "kvspec impl")


def load_user_target(spec: str, api: Optional[str] = None, patch_text: Optional[str] = None,
                     patch_name: Optional[str] = None) -> Target:
    obj, module = load_object(spec)
    source = _source_of(spec, module)  # where [tool.kvspec] is looked for: the unpatched file
    if api == "allocator" or api is None:
        alloc = _allocator_level(spec, obj, api, source, patch_text, patch_name, module)
        if alloc is not None:
            return alloc
    try:
        api, cls, make = resolve(obj, spec, api, source)
    except TargetError as e:  # no API the cache level drives: its package's scheduler may (i36)
        only = _engine_only(obj, module, spec, source, patch_text, str(e)) if api in (None, "nanovllm") else None
        if only is None:
            raise
        return only
    name = f"{spec}+{patch_name}" if patch_name else spec
    if patch_text is not None:
        pobj, pmodule = load_object(spec, patch_text)
        _, pcls, pmake = resolve(pobj, spec, api, source)
    else:
        pmodule, pcls, pmake = module, cls, make
    if api == "nanovllm":
        seq_cls = _sequence_class(module, cls)
        try:
            base = NanoTarget(cls, seq_cls, spec, make=make, source=source)
        except TargetError as e:  # no generation the cache level drives: its package's scheduler may (i36)
            from kvspec.engine.engine_only import engine_only_target
            only = engine_only_target(cls, seq_cls, spec, source, make, str(e))
            if only is None:
                raise TargetError(f"target {spec}: {e}") from None
            only.patch_text = patch_text
            return only
        check_nano(spec, base)  # kvspec's calls fit the class: before anything is built or called
        _note_config_build(make or cls)
        undriven = undriven_scheduler_calls(base)  # nor does the package's scheduler call what kvspec would not
        if pcls is not cls:
            check_nano(name, NanoTarget(pcls, _sequence_class(pmodule, pcls), name, make=pmake, source=source))
        try:
            base.check_internals()
            if getattr(base.manager_cls, "kvspec_pool_field", None):  # observed through its pool (nano_pool_observe)
                pcls = base.manager_cls if pcls is cls else type(pcls.__name__, (pcls,), {
                    "kvspec_observe": base.manager_cls.kvspec_observe, "__module__": pcls.__module__,
                    "kvspec_pool_field": base.manager_cls.kvspec_pool_field})
            # Declared policies (the patched class's kvspec_traits, [tool.kvspec], kvspec's
            # table of released derivatives), else vLLM's with a note; never probed.
            traits = declared_nano_traits(pcls, seq_cls, base.api, spec, source=source, make=make)
            target = NanoTarget(pcls, _sequence_class(pmodule, pcls), name, traits, make=pmake, source=source)
            target.undriven = undriven
        except TargetError as e:
            raise TargetError(f"target {spec}: {e}{_why_unbuilt(str(e), make or cls)}") from None
        return target
    if is_vllm_signature(cls, api):
        for c, m in ((cls, make), (pcls, pmake)):
            check_v1(spec, api, True, c, m)
        return _vllm_target(name, api, pmake or pcls, pcls, source)
    _impl_target(spec, api, cls, make or cls, module, source, note=False)  # the unpatched class must pass the shape checks
    return _impl_target(name, api, pcls, pmake or pcls, pmodule, source)


def _engine_only(obj: Any, module: Any, spec: str, source: Optional[Path], patch_text: Optional[str],
                 why: str) -> Optional[Target]:
    """An engine-only target where the package's own Scheduler drives a manager the cache
    level cannot (kvspec.engine.engine_only); None where there is no such scheduler."""
    from kvspec.engine.engine_only import engine_only_target
    only = engine_only_target(obj, _sequence_class(module, obj), spec, source, None, why)
    if only is not None:
        only.patch_text = patch_text
    return only


def _allocator_level(spec: str, obj: Any, api: Optional[str], source: Optional[Path], patch_text: Optional[str],
                     patch_name: Optional[str], module: Any = None) -> Optional[Target]:
    """The allocator level (``kvspec.alloc``) for a class with an API of its own: declared
    (``[tool.kvspec.alloc]``), asked for (``--api allocator``), or where none of the three
    APIs fits. None: one of them fits."""
    from kvspec.alloc.target import load_allocator, read_declaration
    if api is None:
        cls = obj if isinstance(obj, type) else None
        declared = read_declaration(cls, source) if cls is not None else None
        if declared is None:
            try:
                resolve(obj, spec, None, source)
                return None
            except NoKnownApi as e:
                # a package whose own Scheduler drives the class: its protocol, not a guessed one
                only = _engine_only(obj, module, spec, source, patch_text, str(e))
                if only is not None:
                    return only
                cls, make, why = e.cls, e.make, str(e)
            except TargetError as e:  # an API that fits but cannot be driven: the scheduler may (i36)
                only = _engine_only(obj, module, spec, source, patch_text, str(e))
                if only is not None:
                    return only
                raise
        else:
            make, why = None, f"target {spec}: declared in {declared.where}"
    else:
        if isinstance(obj, type):
            cls, make = obj, None
        else:
            try:
                cls, make = type(obj(*PROBE_SIZE)), obj
            except Exception as e:
                raise TargetError(f"target {spec}: calling the factory {getattr(obj, '__name__', obj)}"
                                  f"{PROBE_SIZE} raised {type(e).__name__}: {e}") from None
        why = f"target {spec}: --api allocator"
    if patch_text is not None:
        pobj, _ = load_object(spec, patch_text)
        pcls = pobj if isinstance(pobj, type) else cls
        base = load_allocator(spec, cls, make, source, why)
        amap = getattr(base, "amap", None)
        return load_allocator(f"{spec}+{patch_name}" if patch_name else spec, pcls,
                              None if isinstance(pobj, type) else pobj, source, why, amap)
    return load_allocator(spec, cls, make, source, why)


def undriven_scheduler_calls(target: Any) -> tuple:
    """The state-changing calls the package's scheduler makes that kvspec's cache level does
    not (``kvspec.targets.scheduler_calls``): there the cache level refuses, since its
    findings could be kvspec's missing call, not the user's bug. Calls behind a feature
    switch are left out, with a note."""
    from kvspec.targets.contract import nano_styles
    from kvspec.targets.names import MANAGER_FIELDS, MANAGER_METHODS
    from kvspec.targets.scheduler_calls import optional_note, undriven_calls
    cls = target.manager_cls
    style = next((s for s in nano_styles() if s.style == target.api), None)
    kvspec_calls = {c.method for c in style.calls} if style is not None else set()
    driven = {target.names.resolve(cls, m) or m for m in kvspec_calls | set(MANAGER_METHODS)}
    driven |= {m for ms in (target.protocol or {}).values() for m in ms}
    observed = {n for f in MANAGER_FIELDS for n in (target.names.declared.get(f, f), "_" + f)}
    calls = undriven_calls(cls, target.source, driven, observed)
    always = tuple(c for c in calls if not c.flag)
    if len(always) < len(calls):
        _note(f"kvspec: note: {optional_note([c for c in calls if c.flag], Path.cwd())}")
    return always


def _note_config_build(build: Any) -> None:
    """Where the manager is built from a config object, say how (the mapping kvspec used)."""
    from kvspec.targets.nano_api import CONFIG_BLOCKS, CONFIG_BLOCK_SIZE, config_class, config_fields, config_parameter
    if config_parameter(build) is None:
        return
    cfg = config_class(build)
    read = config_fields(build, read_only=True)
    set_ = [f"{f}=<num_blocks>" for f in read if f in CONFIG_BLOCKS] + \
        [f"{f}=<block_size>" for f in read if f in CONFIG_BLOCK_SIZE]
    _note(f"kvspec: note: {getattr(build, '__name__', build)}(config) is built with "
          f"{cfg.__name__ if cfg is not None else 'a namespace'}({', '.join(set_)}), its other fields at their "
          f"defaults and its __init__ not run")


def _why_unbuilt(message: str, build: Any) -> str:
    """Where a build that failed without a message (a bare ``assert``) failed, and what
    kvspec passed: built once more as kvspec's probe does, to read the traceback."""
    if "(no message)" not in message and not message.rstrip().endswith(":"):
        return ""
    try:
        build(*PROBE_SIZE)
    except Exception as e:
        return f" ({getattr(build, '__name__', 'the factory')}(num_blocks={PROBE_SIZE[0]}, " \
               f"block_size={PROBE_SIZE[1]}) raised {describe_exception(e)})"
    return ""


def _source_of(spec: str, module: ModuleType) -> Optional[Path]:
    where, _ = parse_spec(spec)
    if where.endswith(".py"):
        return Path(where).expanduser().resolve()
    f = getattr(module, "__file__", None)
    return Path(f) if f else None


def _sequence_class(module: ModuleType, cls: Optional[type] = None) -> type:
    """The module's own ``Sequence`` (or that of the module defining the class), else kvspec's."""
    for m in (module, sys.modules.get(getattr(cls, "__module__", "") or "")):
        seq = getattr(m, "Sequence", None)
        if isinstance(seq, type):
            return seq
    from kvspec.targets.nano_sequence import Sequence
    return Sequence


__all__ = ["load_user_target", "load_object", "resolve", "parse_spec"]

"""A nano-vllm package's own ``Scheduler`` driving its own ``BlockManager`` (engine level).

Targets: ``nanovllm[:PKG]`` (an installed derivative: ``PKG/engine/scheduler.py``) and a
user's fork given by a file of its package (``REPO/nanovllm/engine/block_manager.py`` or
``scheduler.py``): the ``scheduler.py`` beside it is imported under its real name.

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
kvspec sets it (``KVSPEC_FIELDS``: the pool, the block size, an ``eos`` the sampler never
produces, a token budget and model length of the whole pool, which is what nano-vllm's
own ``Config`` asks: ``max_num_batched_tokens >= max_model_len``), else the default of that
field in the package's ``config.py`` (read with ``ast``), else the load fails in one line.

Driving. ``arrive`` builds the package's own Sequence (``NanoDriver.new_seq``: its
constructor by signature, default SamplingParams, the run's block size) with
``max_tokens`` set, and calls ``add``. ``step`` calls ``schedule()``, reads what it decided
(the batch, each sequence's scheduled tokens: ``num_scheduled_tokens`` where the package
sets it (chunked prefill), else the uncached prompt on a prefill step and one token on a
decode step; preemptions, from the queues), then plays the model: every scheduled
sequence samples ``sample(req, len(seq))``, and the package's ``postprocess(seqs,
token_ids[, is_prefill])`` appends and finishes. A package without ``postprocess``
(nano-vllm-voxcpm: its model engine appends) gets what its ``LLMEngineBase.step`` does:
append, mark ``seq.stoped`` at ``max_tokens``, then ``scheduler.finish(seq)``. Draft tokens:
nano-vllm has no speculative decoding; ``drafts`` and ``accepted`` are ignored
(``spec_decode`` is False). ``abort`` calls the scheduler's ``cancel``/``abort`` where it has
one; nano-vllm and its forks have none (their engines cannot abort), so kvspec removes a
waiting request from the queue and finishes a running one as the package's own finish
does (``deallocate``, off ``running``): ``native_abort`` says which.

Observation. ``kvspec.targets.nano_driver.NanoDriver``'s, the cache level's, reading the
scheduler's ``block_manager``; a request's ``computed`` is the engine's (the tokens whose KV
the steps so far computed, the prefix hit included), not ``len(seq)``.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import textwrap
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from kvspec.engine.protocol import Sampler, StepFacts
from kvspec.errors import TargetError
from kvspec.spec.config import Config
from kvspec.spec.observation import Observation, RequestState

NEVER_EOS = -1  # nano-vllm's own "no eos" value; the machines sample tokens >= 0
# The config fields kvspec sets; the rest take the package's Config defaults.
KVSPEC_FIELDS = ("num_kvcache_blocks", "kvcache_block_size", "eos", "max_num_batched_tokens", "max_model_len")


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


def stand_in_config(parts: EngineParts, values: dict[str, Any]) -> types.SimpleNamespace:
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
    return types.SimpleNamespace(**cfg)


# -- the driver --------------------------------------------------------------------------------
class NanoEngineDriver:
    """An EngineDriver (``kvspec.engine.protocol``) over a nano-vllm package's Scheduler."""

    spec_decode = False

    def __init__(self, parts: EngineParts, num_blocks: int, block_size: int, max_num_seqs: Optional[int] = None,
                 max_num_batched_tokens: Optional[int] = None) -> None:
        from kvspec.targets.nano_api import detect_nano_api
        from kvspec.targets.nano_driver import NanoDriver
        from kvspec.targets.nanovllm_target import caching_support

        self.parts, self.block_size, self.num_blocks = parts, block_size, num_blocks
        self.max_model_len = num_blocks * block_size
        values = {"num_kvcache_blocks": num_blocks, "kvcache_block_size": block_size, "eos": NEVER_EOS,
                  "max_model_len": self.max_model_len,
                  "max_num_batched_tokens": max(max_num_batched_tokens or 0, self.max_model_len)}
        if max_num_seqs is not None:
            values["max_num_seqs"] = max_num_seqs
        self.config = stand_in_config(parts, values)
        try:
            self.sched = parts.scheduler_cls(self.config)
        except TargetError:
            raise
        except Exception as e:
            raise TargetError(f"target {parts.name}: cannot build its Scheduler: {type(e).__name__}: {e}") from None
        mgr = getattr(self.sched, "block_manager", None)
        if mgr is None:
            raise TargetError(f"target {parts.name}: its Scheduler keeps no block_manager")
        support = caching_support(parts.manager_cls, parts.seq_cls)
        # The cache level's driver, as the observer of the scheduler's own manager.
        self.view = NanoDriver(parts.manager_cls, parts.seq_cls, detect_nano_api(parts.manager_cls),
                               Config(level="cache", num_blocks=num_blocks, block_size=block_size,
                                      caching=support != "off"), caching_support=support)
        self.view.mgr = mgr
        if self.view.bs != block_size or getattr(mgr, "block_size", block_size) != block_size:
            raise TargetError(f"target {parts.name}: its BlockManager keeps block size "
                              f"{getattr(mgr, 'block_size', '?')}, not the run's {block_size}")
        self.seqs: dict[str, Any] = {}      # live requests (waiting or running)
        self.req_of: dict[int, str] = {}    # id(seq) -> req
        self.max_tokens: dict[str, int] = {}
        self.done: dict[str, int] = {}      # req -> tokens whose KV the engine computed
        post = getattr(self.sched, "postprocess", None)
        self.post_args = _positional(post) if callable(post) else 0
        self.native_abort = next((m for m in ("abort", "cancel", "abort_request") if callable(getattr(self.sched, m,
                                                                                                      None))), None)

    # -- protocol ----------------------------------------------------------------------------
    def arrive(self, req: str, prompt: tuple[int, ...], max_tokens: int, extra: Optional[str] = None) -> None:
        if req in self.seqs:
            raise ValueError(f"request {req} already exists")
        if max_tokens < 1 or len(prompt) + max_tokens > self.max_model_len:
            raise ValueError(f"request {req}: prompt {len(prompt)} + max_tokens {max_tokens} tokens do not fit "
                             f"max_model_len {self.max_model_len}")
        seq = self.view.new_seq(list(prompt))
        _set_max_tokens(seq, max_tokens)
        self.seqs[req], self.req_of[id(seq)], self.max_tokens[req], self.done[req] = seq, req, max_tokens, 0
        self.sched.add(seq)

    def step(self, sample: Sampler, drafts: int = 0, accepted: int = 0) -> StepFacts:
        sch = self.sched
        if sch.is_finished():
            return StepFacts(scheduled={})
        was_running = {r for r in self._reqs(sch.running)}
        result = sch.schedule()
        seqs, is_prefill = (list(result[0]), result[1]) if isinstance(result, tuple) else (list(result), None)
        running, waiting = set(self._reqs(sch.running)), set(self._reqs(sch.waiting))
        preempted = tuple(sorted(r for r in was_running if r in waiting))
        for r in preempted:
            self.done[r] = 0
        for r in running - was_running:  # admitted this step: the prefix hit is computed
            self.done[r] = _int(self.seqs[r], "num_cached_tokens")
        scheduled, slots, start = {}, {}, {}
        for seq in seqs:
            r = self.req_of[id(seq)]
            s, n = self._extent(seq, is_prefill)
            table = list(seq.block_table)
            scheduled[r], start[r] = n, s
            slots[r] = tuple(table[p // self.block_size] * self.block_size + p % self.block_size
                             for p in range(s, s + n) if p // self.block_size < len(table))
            self.done[r] = s + n
        tokens = [sample(self.req_of[id(seq)], len(seq)) for seq in seqs]
        self._postprocess(seqs, tokens, is_prefill)
        live = set(self._reqs(sch.running)) | set(self._reqs(sch.waiting))
        finished = tuple(sorted(r for r in self.seqs if r not in live))
        for r in finished:
            self._forget(r)
        return StepFacts(scheduled=scheduled, preempted=preempted, finished=finished, slots=slots, start=start)

    def abort(self, req: str) -> None:
        seq = self.seqs.get(req)
        if seq is None:
            return
        sch = self.sched
        if self.native_abort is not None:
            fn = getattr(sch, self.native_abort)
            fn(getattr(seq, "seq_id", seq) if _positional(fn) and not _takes_seq(fn) else seq)
        elif any(s is seq for s in sch.waiting):
            sch.waiting.remove(seq)
        elif any(s is seq for s in sch.running):
            _mark(seq, "FINISHED")
            sch.block_manager.deallocate(seq)
            sch.running.remove(seq)
        self._forget(req)

    def observe(self) -> Observation:
        self.view.seqs = dict(self.seqs)
        self.view.running = {r for r, s in self.seqs.items() if list(s.block_table)}
        obs = self.view.observe()
        return dataclasses.replace(obs, requests={r: RequestState(rs.table, self.done[r])
                                                  for r, rs in obs.requests.items()})

    def tables(self) -> dict[str, tuple[int, ...]]:
        return {r: tuple(s.block_table) for r, s in self.seqs.items()}

    def computed(self) -> dict[str, int]:
        return dict(self.done)

    def tokens(self) -> dict[str, tuple[int, ...]]:
        return {r: tuple(s.token_ids) for r, s in self.seqs.items()}

    # -- helpers -----------------------------------------------------------------------------
    def _reqs(self, queue: Any) -> list[str]:
        return [self.req_of[id(s)] for s in queue if id(s) in self.req_of]

    def _extent(self, seq: Any, is_prefill: Optional[bool]) -> tuple[int, int]:
        """(first position, tokens) the step computes for ``seq``, as its scheduler decided."""
        cached = _int(seq, "num_cached_tokens")
        n = getattr(seq, "num_scheduled_tokens", None)
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:  # a chunked-prefill generation says
            return (cached, n) if is_prefill is not False else (len(seq) - n, n)
        if is_prefill is False:
            return len(seq) - 1, 1
        return cached, len(seq) - cached

    def _postprocess(self, seqs: list, tokens: list[int], is_prefill: Optional[bool]) -> None:
        sch = self.sched
        if self.post_args:
            args = (seqs, tokens, is_prefill)[:max(2, min(self.post_args, 3))]
            sch.postprocess(*args)
            return
        for seq, t in zip(seqs, tokens):  # the model engine's postprocess (nano-vllm-voxcpm's LLMEngineBase)
            seq.append_token(t)
            if len(seq) - _int(seq, "num_prompt_tokens") >= self.max_tokens[self.req_of[id(seq)]]:
                seq.stoped = True
        for seq in seqs:
            if getattr(seq, "stoped", False):
                if callable(getattr(sch, "finish", None)):
                    sch.finish(seq)
                else:
                    raise TargetError(f"target {self.parts.name}: its Scheduler has neither postprocess nor finish")

    def _forget(self, req: str) -> None:
        seq = self.seqs.pop(req)
        self.req_of.pop(id(seq), None)
        self.max_tokens.pop(req, None)
        self.done.pop(req, None)


def _set_max_tokens(seq: Any, n: int) -> None:
    """``max_tokens`` where the Sequence keeps it (its copy of SamplingParams.max_tokens, or
    the SamplingParams object itself)."""
    if hasattr(seq, "max_tokens"):
        seq.max_tokens = n
    sp = getattr(seq, "sampling_params", None)
    if sp is not None and hasattr(sp, "max_tokens"):
        try:
            seq.sampling_params = dataclasses.replace(sp, max_tokens=n)
        except TypeError:
            sp.max_tokens = n


def _mark(seq: Any, status: str) -> None:
    st = getattr(seq, "status", None)
    member = getattr(type(st), status, None) if st is not None else None
    if member is not None:
        seq.status = member


def _int(obj: Any, name: str) -> int:
    v = getattr(obj, name, 0)
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def _positional(fn: Callable) -> int:
    try:
        return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return 2


def _takes_seq(fn: Callable) -> bool:
    try:
        first = next(iter(inspect.signature(fn).parameters.values()))
    except (TypeError, ValueError, StopIteration):
        return False
    return first.name in ("seq", "sequence") or "Sequence" in str(first.annotation)


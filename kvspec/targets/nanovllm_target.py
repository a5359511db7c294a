"""Adapter for nano-vllm-style block managers (``nanovllm[:PACKAGE]``, and user classes
with that API): a ``BlockManager`` driven through ``Sequence`` objects.

Loading. ``PACKAGE.engine.block_manager`` and ``PACKAGE.engine.sequence`` are imported
by their real names without running ``PACKAGE/__init__.py`` (which pulls in torch and
transformers): for the import, lightweight stub modules stand in for ``PACKAGE`` and
``PACKAGE.engine``, with ``__path__`` set to the real directories; they are removed
again afterwards, so a later ``import PACKAGE`` runs the real ``__init__``. A patch is
applied to temporary copies and served under the real names for one import window by
a meta-path finder (``import_overlay``); the installed files are never written.

Driving (cache level only: nano-vllm has no pool-level API). The driver plays
nano-vllm's own scheduler (``engine/scheduler.py``): prefill = ``can_allocate`` then
``allocate`` (the hit is ``seq.num_cached_tokens``); decode = ``append_token`` then
``can_append`` / ``may_append``; preemption and finish = ``deallocate`` (also of a
waiting request, which holds nothing: a no-op); re-admission allocates again with
every token. The manager is built as ``BlockManager(num_blocks, block_size)`` (plus
``enable_prefix_caching=`` where the constructor has that switch), or by a user's factory
with that convention (``user_target``). For the model checker the driver forks itself
(``snapshot``/``restore``, deep copies), never by pickling. Four API generations are
detected from the signatures, counting only parameters without a default (``NANO_CALLS``
is the exact call table, per generation, that the load-time contract check reads):

- boolean (nano-vllm 2025, nano-vllm-fork): ``can_allocate(seq) -> bool``, ``allocate(seq)``
  hashes full blocks itself, ``may_append`` hashes a block when it fills;
- counted (later nano-vllm): ``can_allocate(seq)`` returns the number of cached blocks
  or -1, ``allocate(seq, n)``, and the scheduler calls ``hash_blocks(seq)`` (or
  ``hash_block``) after each step with ``seq.num_scheduled_tokens`` set;
- chunked (chunked-prefill forks): ``can_allocate(seq, num_tokens)`` (a bool, or the number
  of cached blocks, -1 or False when refused) and ``allocate(seq, num_tokens)`` (or
  ``allocate(seq, num_cached_blocks, num_tokens)``) grow the block table to hold
  ``seq.num_cached_tokens + num_tokens`` tokens. An admission first asks
  ``can_allocate(seq, <the whole uncomputed prompt>)`` (kvspec's admission is all or
  nothing), then prefills chunk by chunk, one block of tokens per chunk: ``allocate``,
  the forward (``hash_blocks`` where the manager has it, then ``num_cached_tokens +=
  chunk``), as the fork's scheduler does; each later chunk asks ``can_allocate(seq, chunk)``
  first, and a chunk refused after the whole prompt was admitted is preempted
  (``deallocate``) and the admission reported refused. The hit is ``num_cached_tokens``
  after the first ``allocate``. Decode uses ``can_append``/``may_append`` where the
  manager has them, else ``can_allocate(seq, 1)``/``allocate(seq, 1)``;
- layout (v1-style nano-vllm, whose scheduler counts the tokens): ``get_token_layout(seq)``
  gives (hit in held blocks, hit in free blocks, new tokens), then ``can_allocate(hit in
  free + new)``, ``seq.num_new_tokens = new``, ``allocate(seq)``; decode is
  ``can_append(seq, n)`` then ``may_append(seq)`` with ``seq.num_new_tokens = n``; after
  each forward ``num_cached_tokens += num_new_tokens`` (the whole prompt at once: its
  Config's chunked_prefill is off by default).

Names, hooks, protocol. kvspec's names resolve through ``kvspec.targets.names`` (a
declared name map, else conservative aliases); ``kvspec_observe`` replaces reading the
internals; declared extra protocol calls (``after_allocate``, ``after_prefill_chunk``,
``after_append``, ``before_deallocate``) are made at those points.

Block size. The manager is built with the run's block size. A manager that insists on its
own (its constructor raises AssertionError or ValueError, or it keeps another
``block_size``) is built with the class's own: the constructor's default, else the
package Sequence's class attribute ``block_size``, else a ``Config`` default in the
manager's module (``kvcache_block_size``). The machines' requests are then scaled to it:
each token of the run's block of B tokens stands for a run of about R/B copies of itself
in the manager's block of R tokens (block boundaries, partial blocks and refusals map
one to one), and the observation maps lengths back. Repros keep the run's block size.

Prefix caching. A manager without an index (no ``hash_to_block_id``, no block hash) is
checked with prefix caching off; one whose constructor has an ``enable_prefix_caching``
(or ``enable_caching``) switch, with both; any other with it on.

Observation. nano-vllm's state is a ``free_block_ids`` deque, a ``used_block_ids`` set
and a ``hash_to_block_id`` dict that may keep entries for blocks since reused (lookups
check the block's ``token_ids``). It is normalized so the generic invariants mean the
same as for vLLM: ``queue`` is ``free_block_ids`` in order (also a list, an OrderedDict of
ids, or a lazily cleaned deque with a companion set: ``names.read_free_list``); a block's
hash is reported while it is held, or while it is free and the dict can still hit it
(otherwise nothing can ever hit it: it is not cached); the index holds the dict entries
the manager's own lookup would accept, and nothing of the adapter's own (a held block
whose entry a later duplicate replaced is absent, as in the dict:
``Traits.index_latest_wins`` allows that). ``used_block_ids`` is optional.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable, Optional

from kvspec.errors import UsageError
from kvspec.spec.config import Config
from kvspec.targets.base import Driver, Target, TargetError, Traits
from kvspec.targets.names import OBSERVE_HOOK, Names, load_names, read_protocol
from kvspec.targets.nano_loader import load_nano

BOOLEAN, COUNTED, CHUNKED = "boolean", "counted", "chunked"  # the can_allocate/allocate generations
from kvspec.targets.nano_api import *  # noqa: F401,F403  (re-exported: contract.py, tests, user_target)
from kvspec.targets.nano_api import _method, _params, _positional, _required  # noqa: F401
from kvspec.targets.nano_driver import *  # noqa: F401,F403
from kvspec.targets.nano_driver import _clone_state, _has_hash  # noqa: F401

# -- target ----------------------------------------------------------------------------
# nano-vllm's policies where a package declares nothing (kvspec.targets.policies has the
# declarations of released derivatives): vLLM's, except that the manager has no null block
# and always caches, and that the boolean can_allocate generation counts every block.
def nano_defaults(api: str, caching: str = "on") -> dict[str, Any]:
    from kvspec.targets.policies import VLLM_DEFAULTS
    return {**VLLM_DEFAULTS, "null_block": None, "prefix_caching": caching, "admit_all_blocks": api == BOOLEAN}


def caching_support(manager_cls: type, seq_cls: Optional[type] = None, make: Optional[Callable[..., Any]] = None,
                    names: Optional[Names] = None) -> str:
    """"off" (no prefix index), "both" (an index and a constructor switch), "on", or
    ``DECLARED`` (an observation hook and no index kvspec can see: caching as declared,
    off by default: a hook does not imply a cache)."""
    switch = caching_switch(make if make is not None else manager_cls)
    try:
        probe = build_manager(manager_cls, make, 4, 2, True, seq_cls)
    except Exception:
        return "both" if switch else "on"  # the load's own checks say what is wrong
    if not has_index(probe, names):
        # an observation hook reports what the manager has: it caches only where declared
        return DECLARED if callable(getattr(probe, OBSERVE_HOOK, None)) else "off"
    return "both" if switch else "on"


DECLARED = "declared"  # caching_support of a manager with a hook and no index: as declared, else off


def default_caching(supported: str) -> str:
    """The prefix-caching mode where nothing is declared, from ``caching_support``."""
    return "off" if supported == DECLARED else supported


def nano_traits(manager_cls: type, seq_cls: type, api: str, make: Optional[Callable[..., Any]] = None,
                **policies: Any) -> Traits:
    """What the nano-vllm API itself fixes, with ``policies`` (declared) on top:

    - no null block; prefix caching as the manager supports it (``caching_support``);
    - misuse is met with ``assert`` at best: no documented defence (robustness findings);
    - deallocating a Sequence that holds nothing is a no-op (``free_unknown_request``);
    - one block per hash in ``hash_to_block_id``, the latest cached wins;
    - block size at least 2: block boundaries are found with ``len(seq) % block_size == 1``,
      which never holds for block size 1 (nano-vllm's Config asks multiples of 256).

    Freed blocks go to the tail of ``free_block_ids`` (``append``), a request's tail first
    (``reversed(seq.block_table)``): "lru_tail_first", the order kvspec's shipped declarations
    keep; a fork that declares no order is checked under "any" (``policies.declared_traits``). Admission
    counting and eviction on free are policies a package declares; they are never probed."""
    fixed: dict[str, Any] = dict(null_block=False, unhashed_free_first=False, misuse_errors=(), levels=("cache",),
                                 documented_noops=frozenset({"free_unknown_request"}), index_latest_wins=True,
                                 min_block_size=2, prefix_caching=default_caching(caching_support(
                                     manager_cls, seq_cls, make, load_names(manager_cls, _source_file(manager_cls)))))
    return Traits(**{**fixed, **policies})


def check_nano_policies(traits: Traits, where: str, supported: str = "on") -> Traits:
    """The declared policies the nano-vllm API can be checked under, else UsageError."""
    if traits.null_block:
        raise UsageError(f"{where}: a nano-vllm BlockManager has no null block: declare null_block = \"none\"")
    ok = {"on": ("on",), "off": ("off",), "both": ("on", "off", "both"), DECLARED: ("on", "off", "both")}[supported]
    if traits.prefix_caching not in ok:
        what = {"on": "always caches prefixes", "off": "has no prefix index (hash_to_block_id, Block.hash)",
                "both": ""}[supported]
        raise UsageError(f"{where}: this nano-vllm BlockManager {what}: declare prefix_caching = \"{supported}\"")
    return traits


def declared_nano_traits(manager_cls: type, seq_cls: type, api: str, name: str, source: Any = None,
                         defaults_name: str = "vLLM's", make: Optional[Callable[..., Any]] = None) -> Traits:
    """``nano_traits`` with the policies the manager's package declares (see
    ``kvspec.targets.policies.declared_traits``); nano-vllm's defaults otherwise."""
    from kvspec.targets.policies import declared_traits
    names = load_names(manager_cls, source)
    supported = caching_support(manager_cls, seq_cls, make, names)
    defaults = nano_defaults(api, default_caching(supported))
    if defaults_name == "vLLM's":
        defaults["admit_all_blocks"] = False  # a user class: vLLM's admission
    t = declared_traits(nano_traits(manager_cls, seq_cls, api, make), cls=manager_cls, source=source, name=name,
                        defaults=defaults, defaults_name=defaults_name)
    # what the package's code settles of the policies left open (kvspec.targets.nano_reading)
    from kvspec.targets.nano_reading import read_policies
    from pathlib import Path
    src = Path(source) if source is not None else _source_file(manager_cls)
    t = read_policies(t, manager_cls, names, Path(src) if src is not None else None)
    return check_nano_policies(t, name, supported)


class NanoTarget(Target):
    """Any nano-vllm-style (BlockManager, Sequence) pair; ``traits`` from the unpatched pair.

    ``make(num_blocks, block_size)`` builds a manager (default: ``manager_cls`` itself);
    ``source`` is the file whose nearest pyproject.toml may hold ``[tool.kvspec.names]``
    and ``[tool.kvspec.protocol]`` (default: the class's module file)."""

    def __init__(self, manager_cls: type, seq_cls: type, name: str, traits: Optional[Traits] = None,
                 make: Optional[Callable[..., Any]] = None, source: Any = None) -> None:
        self.manager_cls, self.seq_cls, self.name, self.make = manager_cls, seq_cls, name, make
        self.source = source if source is not None else _source_file(manager_cls)
        self.names = load_names(manager_cls, self.source)
        self.protocol, _ = read_protocol(manager_cls, self.source)
        self.api = detect_nano_api(manager_cls, self.names)
        self.caching_support = caching_support(manager_cls, seq_cls, make, self.names)
        # Declared policies only (kvspec.targets.policies); without a declaration, vLLM's.
        self.traits = traits if traits is not None else nano_traits(manager_cls, seq_cls, self.api, make)
        if self.caching_support == "off" and self.traits.prefix_caching != "off":
            # A manager without an index cannot cache, whatever defaults were applied.
            self.traits = dataclasses.replace(self.traits, prefix_caching="off")

    # Set by the loader: the state-changing calls the package's scheduler makes that kvspec's
    # cache level does not (kvspec.targets.scheduler_calls.UndrivenCall). The cache level
    # then refuses to run, in one line; the engine level, where that scheduler makes its
    # own calls, runs.
    undriven: tuple = ()

    def driver(self, config: Config) -> Driver:
        if self.undriven and config.level != "engine":
            from pathlib import Path
            from kvspec.targets.scheduler_calls import refusal
            raise TargetError(refusal(self.name, list(self.undriven), Path.cwd()))
        return self._driver(config)

    def _driver(self, config: Config) -> Driver:
        driver = NanoDriver(self.manager_cls, self.seq_cls, self.api, config, self.make, self.names, self.protocol,
                            self.caching_support)
        driver.free_order = self.traits.free_order  # how its free list is read (names.free_next_end)
        return driver

    def check_internals(self) -> None:
        """Raise TargetError (one line) unless a manager shows what the observation reads."""
        caching = self.traits.caching_modes[0]
        try:
            d = self._driver(Config(level="cache", num_blocks=4, block_size=2, caching=caching))
        except (TargetError, UsageError):
            raise
        except Exception as e:
            raise TargetError(f"cannot build {self.manager_cls.__name__}(num_blocks, block_size): "
                              f"{type(e).__name__}: {e or '(no message)'}") from None
        missing = missing_internals(d.mgr, self.names, caching)
        if missing and not getattr(self.manager_cls, "kvspec_pool_field", None):
            from kvspec.targets.nano_pool_observe import observe_through_pool
            sub = observe_through_pool(self.manager_cls, d.mgr)
            if sub is not None:  # its state lives in a free-list pool it owns: read there
                self.manager_cls = sub
                self.caching_support = "off"
                self.traits = dataclasses.replace(self.traits, prefix_caching="off")
                return self.check_internals()
        if missing:
            raise TargetError(f"{self.manager_cls.__name__} has the nano-vllm BlockManager methods but not the "
                              f"internals kvspec observes: {', '.join(missing)} (declare other names in "
                              f"[tool.kvspec.names], or define kvspec_observe: kvspec.targets.names)")
        try:
            d._free_list() if not d.hook else None
        except TypeError as e:
            raise TargetError(f"{self.manager_cls.__name__}: {e}") from None
        seq = d.new_seq(d.scale.expand([1, 2, 3]))  # TargetError naming what kvspec could not build
        if not d.names.has(seq, "append_token"):
            raise TargetError(f"{self.seq_cls.__name__} has no append_token (nor append): declare its name in "
                              f"[tool.kvspec.names]")

    def describe(self) -> str:
        t = self.traits
        return (f"{self.name} ({self.api} can_allocate; admission counts "
                f"{'every block' if t.admit_all_blocks else 'new blocks only'}; freed blocks "
                f"{'leave the cache' if t.free_evicts else 'stay cached until reused'})")


class NanoVllmTarget(NanoTarget):
    def __init__(self, package: str = "nanovllm", patch_text: Optional[str] = None,
                 patch_name: Optional[str] = None) -> None:
        base_bm, base_seq = load_nano(package)
        try:
            api = detect_nano_api(base_bm)
        except TargetError as e:
            raise TargetError(f"target nanovllm:{package}: {e}") from None
        name = "nanovllm" if package == "nanovllm" else f"nanovllm:{package}"
        # The release's declared policies (kvspec's table of released derivatives, a class
        # attribute or [tool.kvspec]), never a probe of its code; a patch keeps them.
        traits = declared_nano_traits(base_bm, base_seq, api, name, source=_source_file(base_bm),
                                      defaults_name="nano-vllm's")
        bm, seq = (base_bm, base_seq) if patch_text is None else load_nano(package, patch_text)
        try:
            super().__init__(bm, seq, f"{name}+{patch_name}" if patch_name else name, traits,
                             source=_source_file(base_bm))
            self.check_internals()
        except TargetError as e:
            raise TargetError(f"target {name}" + (f" with patch {patch_name}" if patch_name else "") + f": {e}") from None
        self.package = package


def _source_file(cls: type) -> Any:
    from pathlib import Path
    f = getattr(sys.modules.get(cls.__module__), "__file__", None)
    return Path(f) if f else None

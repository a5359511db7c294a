"""What differs between vLLM releases (0.8.0, the first with ``vllm/v1/core/block_pool.py``,
to 0.33.0), found by feature, never by version number: constructor and method
signatures read with ``inspect``, helpers looked up by name, optional modules
imported only when the release ships them. The adapter builds every call through
this one place, so a release it cannot drive fails here with one line naming the
missing piece (a TargetError), never as a finding against the target.

Differences it covers (first release that has the newer shape in brackets):
- hashing: builtin ``hash`` (0.8.0), a ``hash_fn`` argument (0.8.3), ``init_none_hash``
  (0.10.0), ``vllm.utils.get_hash_fn_by_name`` (0.11.0), ``vllm.utils.hashing`` (0.13.0);
- ``BlockPool(num_gpu_blocks, enable_caching[, hash_block_size])``; a null block (0.8.5);
- ``cache_full_blocks`` taking the hashes as an argument (to 0.10.x) or reading them
  off ``request.block_hashes`` (0.11.0), with or without ``kv_cache_group_id``/``hash_fn``;
- ``get_cached_block(hash)`` -> block, or ``(hash, group_ids)`` -> list of blocks (0.9.2);
- ``touch(blocks)`` or ``touch((blocks,))``, one list per KV-cache group;
- ``Request``'s constructor (prompt, multi-modal, pooling and hasher arguments);
- ``KVCacheManager(block_size, num_gpu_blocks, ...)`` (to 0.8.2) or ``(kv_cache_config, ...)``,
  ``allocate_slots`` with or without ``num_new_computed_tokens`` (0.9.0), and
  ``KVCacheConfig``'s field names;
- what the groups driver may draw on a release (``cache_api``): several groups (a
  coordinator, 0.9.1; all three kinds at once, later than 0.11.0), each group kind,
  connector tokens as their own argument (by 0.14.0), drafts, extra keys in the Request's
  layout (``multi_modal_hashes`` to 0.10.x, ``mm_features`` from 0.11.0).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import inspect
import weakref
from types import ModuleType
from typing import Any, Callable, Optional

from kvspec.errors import TargetError

MAX_MODEL_LEN = 1 << 20  # no kvspec sequence comes near it: the cap never bites
GROUP = 0                # the one KV-cache group


def params(fn: Callable) -> dict[str, inspect.Parameter]:
    """The parameters of ``fn`` by name, ``self`` left out."""
    ps = dict(inspect.signature(fn).parameters)
    ps.pop("self", None)
    return ps


class _Form:
    """One callable's call form, read once: the names it takes and the ones it requires
    (a ``**kwargs`` catch-all takes nothing kvspec names: only declared names are passed)."""

    __slots__ = ("takes", "required")

    def __init__(self, fn: Callable) -> None:
        ps = params(fn)
        self.takes = frozenset(ps)
        self.required = tuple(n for n, p in ps.items() if p.default is p.empty
                              and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))


# Keyed by the function (a bound method's __func__) or class, weakly: a patched run's
# modules are dropped with their forms. Reading a signature costs ~80 us; the adapter
# calls these on every operation, so the form is read once per callable and reused.
_FORMS: "weakref.WeakKeyDictionary[Any, _Form]" = weakref.WeakKeyDictionary()


def form(fn: Callable) -> _Form:
    """``fn``'s call form, read on the first call and bound for every later one."""
    key = getattr(fn, "__func__", fn)
    try:
        return _FORMS[key]
    except KeyError:
        f = _FORMS[key] = _Form(fn)
        return f
    except TypeError:  # not weak-referenceable (a builtin): read it each time
        return _Form(fn)


def call(fn: Callable, what: str, values: dict[str, Any]) -> Any:
    """``fn(**values)``, passing only the names ``fn`` takes; a required parameter
    kvspec has no value for is a TargetError naming it."""
    f = form(fn)
    missing = [n for n in f.required if n not in values]
    if missing:
        raise TargetError(f"vllm: {what} takes {', '.join(missing)}, which the vllm adapter cannot supply")
    takes = f.takes
    return fn(**{n: v for n, v in values.items() if n in takes})


def bind(fn: Callable, what: str, fixed: dict[str, Any], varying: tuple[str, ...] = ()) -> Callable[..., Any]:
    """``fn`` with its call form resolved now, once: ``fixed`` filtered to the names it
    takes, and a required parameter that neither ``fixed`` nor ``varying`` supplies is a
    TargetError here, at load, not on the first call. The result takes the ``varying``
    names as keywords (those ``fn`` does not take are dropped) and nothing else."""
    f = form(fn)
    missing = [n for n in f.required if n not in fixed and n not in varying]
    if missing:
        raise TargetError(f"vllm: {what} takes {', '.join(missing)}, which the vllm adapter cannot supply")
    keep = {n: v for n, v in fixed.items() if n in f.takes}
    drop = frozenset(n for n in varying if n not in f.takes)
    if not drop:
        return lambda **kw: fn(**keep, **kw)
    return lambda **kw: fn(**keep, **{n: v for n, v in kw.items() if n not in drop})


def optional_module(name: str) -> Optional[ModuleType]:
    """The module if this vLLM ships it (``vllm.utils.hashing`` exists from 0.13.0 only)."""
    try:
        if importlib.util.find_spec(name) is None:
            return None
    except ImportError:
        return None
    return importlib.import_module(name)


def hash_fn(utils_pkg: ModuleType, hashing: Optional[ModuleType]) -> Optional[Callable]:
    """vLLM's sha256 block hash function, wherever this release keeps it; None for the
    releases that hash with builtin ``hash`` and take no hash function."""
    for mod in (hashing, utils_pkg):
        if mod is not None and hasattr(mod, "get_hash_fn_by_name"):
            return mod.get_hash_fn_by_name("sha256")
    return getattr(utils_pkg, "sha256", None)


# The Request arguments that carry extra keys, in one release's layout or another's.
EXTRA_ARGS = ("lora_request", "cache_salt", "mm_features", "multi_modal_inputs", "multi_modal_hashes",
              "multi_modal_placeholders")


class Api:
    """One vLLM family's hashing, Request and KV-cache-config API, as detected. What a
    pool or manager takes is read off its own class (``pool_api``/``manager_api``), so
    the same calls drive a user's vLLM-style class."""

    def __init__(self, mods: dict[str, ModuleType]) -> None:
        self.utils = mods["vllm.v1.core.kv_cache_utils"]
        self.block_pool = mods["vllm.v1.core.block_pool"]
        self.manager = mods["vllm.v1.core.kv_cache_manager"]
        self.request = mods["vllm.v1.request"]
        self.interface = mods["vllm.v1.kv_cache_interface"]
        self.sampling = mods["vllm.sampling_params"].SamplingParams(max_tokens=MAX_MODEL_LEN)
        self.hash_fn = hash_fn(importlib.import_module("vllm.utils"), mods.get("vllm.utils.hashing"))
        if hasattr(self.utils, "init_none_hash"):
            # NONE_HASH is a module global of this family's kv_cache_utils; with sha256 it
            # is a fixed seed, so hashes (and pool-level labels) are stable across processes.
            self.utils.init_none_hash(self.hash_fn)
        self._hash_takes_fn = next(iter(params(self.utils.hash_block_tokens))) in ("hash_function", "hash_fn")
        self._make_request: Optional[Callable[..., Any]] = None

    def hash_block_tokens(self, parent: Any, tokens: list[int], extra: tuple) -> Any:
        args = ([self.hash_fn] if self._hash_takes_fn else []) + [parent, tokens, extra]
        return self.utils.hash_block_tokens(*args)

    def request_hasher(self, block_size: int) -> Optional[Callable]:
        """The per-request block hasher for releases whose Request hashes itself (0.11.0+);
        None where the manager hashes requests (its ``req_to_block_hashes``)."""
        make = getattr(self.utils, "get_request_block_hasher", None)
        return None if make is None else make(block_size, self.hash_fn)

    def new_request(self, rid: str, tokens, block_hasher: Optional[Callable] = None,
                    extra: Optional[dict[str, Any]] = None) -> Any:
        """A Request through this release's constructor; ``extra``: keyword arguments it
        takes for extra keys (``request_extras``), the others left at None."""
        make = self._make_request
        if make is None:  # the Request's call form, resolved on first use and kept
            make = self._make_request = bind(self.request.Request, "Request()", {
                "sampling_params": self.sampling, "prompt": None, "multi_modal_kwargs": None,
                "pooling_params": None, "eos_token_id": None, "arrival_time": 0.0},
                ("request_id", "prompt_token_ids", "block_hasher", *EXTRA_ARGS))
        kw = dict.fromkeys(EXTRA_ARGS)
        if extra:
            kw.update(extra)
        return make(request_id=rid, prompt_token_ids=list(tokens), block_hasher=block_hasher, **kw)

    def kv_cache_config(self, num_blocks: int, block_size: int) -> Any:
        import torch  # already imported by vLLM; only the spec's dtype needs it

        iface = self.interface
        spec = call(iface.FullAttentionSpec, "FullAttentionSpec()", {
            "block_size": block_size, "num_kv_heads": 1, "head_size": 1, "dtype": torch.float32,
            "use_mla": False, "sliding_window": None})
        group = iface.KVCacheGroupSpec(["layers.0.attn"], spec)
        names = {f.name for f in dataclasses.fields(iface.KVCacheConfig)}
        values: dict[str, Any] = {"num_blocks": num_blocks, "kv_cache_tensors": [], "tensors": {},
                                  "kv_cache_groups": [group], "groups": [["layers.0.attn"]],
                                  "kv_cache_spec": {"layers.0.attn": spec}}
        return iface.KVCacheConfig(**{n: v for n, v in values.items() if n in names})


# The cache-level features a release may lack (the groups driver's vocabulary; the cache
# machine draws none of those a target declares missing: Traits.cache_missing).
FEATURES = ("groups", "swa", "chunked", "external", "drafts", "lora", "salt", "mm", "three_kinds", "compressed",
            "eagle")
# --kv-groups kind -> the release's spec class for it
SPEC_CLASSES = {"full": "FullAttentionSpec", "swa": "SlidingWindowSpec", "chunked": "ChunkedLocalAttentionSpec",
                "compressed": "MLAAttentionSpec"}
# a kind's spec class must also have one of these fields: DeepSeek-V4's tokens per stored
# entry, ``compress_ratio`` on MLAAttentionSpec (0.20.0 to 0.28.x), ``tokens_per_state`` on
# every attention spec (0.29.0 on)
SPEC_FIELDS = {"compressed": ("compress_ratio", "tokens_per_state")}


@dataclasses.dataclass(frozen=True)
class CacheApi:
    """What the groups driver (``kvspec.vllm.groups``) can draw on one release,
    read off its code: which group kinds it has a spec and a manager for, whether one
    manager takes several groups, and which allocate_slots/Request arguments exist."""
    kinds: frozenset            # "full", "swa", "chunked", "compressed"
    several_groups: bool        # a KV-cache coordinator (one pool, several groups)
    external: bool              # allocate_slots(num_external_computed_tokens=...)
    draft_arg: bool             # allocate_slots(num_draft_tokens=...): drafts excluded from caching by count
    extra: frozenset            # "lora", "salt", "mm": the extra keys its Request takes
    mm_layout: str              # "features" (mm_features) / "hashes" (multi_modal_hashes+placeholders) / ""
    hit_values: int             # what get_computed_blocks returns: 2 or 3 values
    three_kinds: bool = True    # the coordinator takes groups of three kinds (full, swa, chunked) at once
    eagle: bool = False         # KVCacheManager(use_eagle=...): prefix hits drop EAGLE's last matched block

    @property
    def missing(self) -> frozenset:
        # Connector tokens only where allocate_slots takes them as such: before, the scheduler
        # allocated them as new tokens, which the manager cannot tell from a prefill (so a
        # sliding window keeps their blocks: reference-model semantics it does not have).
        have = set(self.kinds - {"full"}) | set(self.extra) | {"drafts"}
        if self.several_groups:
            have.add("groups")
        if self.external:
            have.add("external")
        if self.several_groups and self.three_kinds:
            have.add("three_kinds")
        if self.eagle:
            have.add("eagle")
        return frozenset(f for f in FEATURES if f not in have)


def cache_api(up: Api) -> Optional[CacheApi]:
    """The groups driver's view of this release, or None where it cannot drive it: a
    manager built from a ``KVCacheConfig`` whose ``allocate_slots`` takes the hit as
    ``num_new_computed_tokens`` (0.9.0 on; 0.8.x keeps the one-group driver)."""
    cls = up.manager.KVCacheManager
    if "kv_cache_config" not in params(cls) or not _takes(cls, "allocate_slots", "num_new_computed_tokens"):
        return None
    kinds = frozenset(k for k, name in SPEC_CLASSES.items() if hasattr(up.interface, name)
                      and (k not in SPEC_FIELDS or set(SPEC_FIELDS[k]) & _fields(getattr(up.interface, name))))
    stm = optional_module("vllm.v1.core.single_type_kv_cache_manager")
    managed = getattr(stm, "spec_manager_map", None)
    if managed is not None:  # a kind whose spec has no manager cannot be driven
        kinds = frozenset(k for k in kinds if getattr(up.interface, SPEC_CLASSES[k]) in managed)
    req = params(up.request.Request)
    extra = {"lora"} if "lora_request" in req else set()
    if "cache_salt" in req:
        extra.add("salt")
    layout = ""
    if "mm_features" in req and optional_module("vllm.multimodal.inputs") is not None and \
            hasattr(importlib.import_module("vllm.multimodal.inputs"), "MultiModalFeatureSpec"):
        layout = "features"
    elif "multi_modal_hashes" in req and "multi_modal_placeholders" in req:
        layout = "hashes"
    if layout:
        extra.add("mm")
    three = str(inspect.signature(cls.get_computed_blocks).return_annotation).count("int") >= 2
    several = optional_module("vllm.v1.core.kv_cache_coordinator") is not None
    return CacheApi(kinds=kinds, several_groups=several,
                    external=_takes(cls, "allocate_slots", "num_external_computed_tokens"),
                    draft_arg=_takes(cls, "allocate_slots", "num_draft_tokens"),
                    extra=frozenset(extra), mm_layout=layout, hit_values=3 if three else 2,
                    three_kinds=several and {"swa", "chunked"} <= kinds and _takes_three_kinds(up),
                    eagle="use_eagle" in params(cls))


def _fields(cls: type) -> frozenset:
    return frozenset(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else frozenset()


# -- a KVCacheConfig and a KVCacheManager built through the release's own constructors --


def parse_spec(spec: str) -> list[tuple[str, int]]:
    """``"full,swa:4"`` -> ``[("full", 0), ("swa", 4)]``; TargetError on anything else."""
    out = []
    for part in (spec or "").split(","):
        kind, _, arg = part.strip().partition(":")
        if kind in ("full", "mamba") and not arg:
            out.append((kind, 0))
        elif kind in ("swa", "chunked", "compressed") and arg.isdigit() and int(arg) >= 1:
            out.append((kind, int(arg)))
        else:
            raise TargetError(f"vllm: bad kv group {part.strip()!r} in {spec!r}: "
                              "expected full, swa:W, chunked:C, compressed:R")
    return out


def _group_spec(iface: Any, kind: str, size: int, block_size: int) -> Any:
    import torch  # already imported by vLLM; the specs' dtype needs it

    if kind == "mamba":
        # MambaSpec constructs on the CPU, but kvspec's reference model describes no state
        # overwritten in place, so there is nothing to compare a Mamba group with.
        raise TargetError("vllm: kv group 'mamba' is not supported (the reference model has no Mamba state)")
    cls = getattr(iface, SPEC_CLASSES[kind], None)
    if cls is None:
        raise TargetError(f"vllm: kv group {kind!r}: this vLLM has no {SPEC_CLASSES[kind]}")
    # use_mla: required by the releases before MLA had its own spec (0.9.x); dropped where not taken.
    # compressed:R is DeepSeek-V4's compressed MLA spec (MLAAttentionSpec with R tokens per
    # stored entry: compress_ratio, later tokens_per_state),
    # which vLLM manages as full attention, in a group of its own (cache_api).
    return call(cls, f"{cls.__name__}()", dict(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32, use_mla=False,
        sliding_window=size if kind == "swa" else None, attention_chunk_size=size if kind == "chunked" else None,
        compress_ratio=size if kind == "compressed" else 1, tokens_per_state=size if kind == "compressed" else 1))


def build_kv_cache_config(spec: str, num_blocks: int, block_size: int, iface: Optional[Any] = None) -> Any:
    """A real ``KVCacheConfig``: one ``KVCacheGroupSpec`` (one layer each) per group of
    ``spec``, all sharing one pool of ``num_blocks`` blocks of ``block_size`` tokens
    (the tensor field is ``kv_cache_tensors`` or, in 0.9.x, ``tensors``)."""
    if iface is None:
        from vllm.v1 import kv_cache_interface as iface  # type: ignore[no-redef]
    groups = [iface.KVCacheGroupSpec([f"model.layers.{i}.attn"], _group_spec(iface, kind, size, block_size))
              for i, (kind, size) in enumerate(parse_spec(spec))]
    return call(iface.KVCacheConfig, "KVCacheConfig()", dict(
        num_blocks=num_blocks, kv_cache_tensors=[], tensors={}, kv_cache_groups=groups))


def build_manager(manager_mod: Any, kv_config: Any, block_size: int, caching: bool,
                  max_model_len: Optional[int] = None, use_eagle: bool = False) -> Any:
    """``KVCacheManager`` over ``kv_config``, hashing at the one block size all groups share
    (the block-size arguments are passed where the release takes them); ``use_eagle``: an
    EAGLE/MTP drafter, every group flagged (no group is marked ``is_eagle_group``)."""
    groups = len(kv_config.kv_cache_groups)
    try:
        return call(manager_mod.KVCacheManager, "KVCacheManager()", dict(
            kv_cache_config=kv_config, max_model_len=max_model_len or MAX_MODEL_LEN, scheduler_block_size=block_size,
            hash_block_size=block_size, enable_caching=caching, caching_hash_algo="sha256", use_eagle=use_eagle))
    except (AssertionError, ValueError, NotImplementedError) as e:  # its own refusal of the group set
        raise TargetError(f"vllm: this KVCacheManager refuses {groups} KV-cache group(s): {e}") from None



def _takes_three_kinds(up: Api) -> bool:
    """Whether this release's coordinator builds over full, sliding-window and chunked groups
    at once (0.11.0's "assumes exactly one other type of groups"): asked of the release itself,
    by building one small manager."""
    try:
        build_manager(up.manager, build_kv_cache_config("full,swa:2,chunked:4", 6, 2, up.interface), 2, True)
    except TargetError:
        return False
    return True


def new_pool(cls: type, num_blocks: int, caching: bool, block_size: int) -> Any:
    return call(cls, "BlockPool()", {"num_gpu_blocks": num_blocks, "enable_caching": caching,
                                     "hash_block_size": block_size})


def new_manager(up: Any, cls: type, num_blocks: int, block_size: int, caching: bool) -> Any:
    values: dict[str, Any] = {
        "max_model_len": MAX_MODEL_LEN, "enable_caching": caching, "hash_block_size": block_size,
        "scheduler_block_size": block_size, "block_size": block_size, "num_gpu_blocks": num_blocks,
        # 0.8's default preallocates 64 tokens of blocks ahead: a tuning knob kvspec's
        # model does not have, so it is turned off.
        "num_preallocate_tokens": 0, "caching_hash_algo": "sha256"}
    if "kv_cache_config" in params(cls):
        values["kv_cache_config"] = up.kv_cache_config(num_blocks, block_size)
    return call(cls, "KVCacheManager()", values)


@functools.lru_cache(maxsize=None)
def pool_api(cls: type) -> tuple[bool, bool, bool]:
    """(hashes passed to cache_full_blocks, lookup by group ids, touch takes one list per group)."""
    cache = params(cls.cache_full_blocks)
    lookup = params(cls.get_cached_block)
    ann = str(next(iter(params(cls.touch).values())).annotation)
    return ("block_hashes" in cache, "kv_cache_group_ids" in lookup,
            ann.startswith("tuple") or ann.startswith("typing.Tuple"))


def cache_full_blocks_call(up: Api, pool: Any, block_size: int) -> Callable[[Any, list, list], None]:
    """``pool.cache_full_blocks`` for the first ``len(blocks)`` blocks of a request under
    ``hashes``, its call form resolved once (the releases differ in what they take)."""
    hashes_as_argument = pool_api(type(pool))[0]
    fn = bind(pool.cache_full_blocks, "BlockPool.cache_full_blocks()", {
        "num_cached_blocks": 0, "block_size": block_size, "kv_cache_group_id": GROUP, "hash_fn": up.hash_fn},
        ("request", "blocks", "block_hashes", "num_full_blocks"))

    def cache(req: Any, blocks: list, hashes: list) -> None:
        if not hashes_as_argument:
            req.block_hashes = hashes  # the releases whose Request carries its own hashes
        fn(request=req, blocks=blocks, block_hashes=list(hashes), num_full_blocks=len(blocks))
    return cache


def lookup(pool: Any, block_hash: Any) -> Optional[int]:
    if pool_api(type(pool))[1]:
        hit = pool.get_cached_block(block_hash, [GROUP])
        return None if hit is None else hit[0].block_id
    hit = pool.get_cached_block(block_hash)
    return None if hit is None else hit.block_id


def touch(pool: Any, blocks: list) -> Any:
    return pool.touch((blocks,) if pool_api(type(pool))[2] else blocks)


@functools.lru_cache(maxsize=None)
def _takes(cls: type, method: str, name: str) -> bool:
    return name in params(getattr(cls, method))


def computed_blocks(mgr: Any, req: Any, block_size: int) -> tuple[Any, int]:
    blocks, num = mgr.get_computed_blocks(req)[:2]
    if isinstance(blocks, list) and blocks and num >= req.num_tokens:
        # 0.8's manager returns a whole-prompt hit and its scheduler recomputes the last
        # block itself (later managers cap the hit): do what that scheduler did.
        return blocks[:-1], num - block_size
    return blocks, num


def allocate(mgr: Any, req: Any, num_new: int, num_hit: int = 0, hits: Any = None) -> Any:
    if _takes(type(mgr), "allocate_slots", "num_new_computed_tokens"):
        return mgr.allocate_slots(req, num_new, num_hit, hits)
    return mgr.allocate_slots(req, num_new, hits)


def release(mgr: Any, req: Any, finished: bool) -> None:
    mgr.free(req)
    if finished and hasattr(mgr, "free_block_hashes"):
        # Releases whose manager keeps each request's hashes drop them when it finishes
        # (the scheduler's call): a later request reusing the id must not inherit them.
        mgr.free_block_hashes(req)


def req_to_blocks(mgr: Any) -> Any:
    coord = getattr(mgr, "coordinator", None)
    if coord is not None:
        return coord.single_type_managers[GROUP].req_to_blocks
    single = getattr(mgr, "single_type_manager", None)
    return (single if single is not None else mgr).req_to_blocks

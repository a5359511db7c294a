"""Adapter for LMCache's paged memory allocator (``--target lmcache``):
``lmcache.v1.memory_allocators.paged_tensor_memory_allocator.PagedTensorMemoryAllocator``
at pool level.

Loading. ``lmcache/__init__.py`` resolves the device ops backend (numba on the CPU)
when imported; the allocator needs none of it. So the allocator's module is imported
by its real name under a stand-in ``lmcache`` package (``kvspec.targets.stub_import``)
that carries the three names ``lmcache.v1.memory_management`` imports from it: the
platform's ``torch_dev`` and ``torch_device_type`` (imported for real from
``lmcache.v1.platform``) and ``device_ops``, whose functions (pinned and NUMA host
memory) raise if called: a paged allocator over a plain CPU tensor never calls them.

Concepts. The allocator splits one buffer into equal pages and keeps one
``TensorMemoryObj`` per page forever (``meta.address`` is the page index): ``allocate``
/ ``batched_allocate`` pop objects from the left of the ``free_blocks`` deque and set
``ref_count = 1``; ``ref_count_up`` adds a holder; ``ref_count_down`` removes one and,
at 0, calls ``free``, which appends the object to the right of the deque. There is no
prefix cache and no reserved page. So:

- block id = page index; ``Alloc(n)`` = ``batched_allocate(n)`` (``None`` when too few
  pages are free is LMCache's documented refusal: the driver raises ``AllocRefused``);
  ``Free`` = ``ref_count_down`` on each page's object, in order; ``Touch`` =
  ``ref_count_up``; a caller has a page's object only once it was handed out, so these
  refuse (``LookupError``, before calling LMCache) a page never allocated; ``FreeForeign`` = ``ref_count_down`` on a page of another
  allocator, which frees it into that allocator (a documented no-op for this pool:
  every object carries its ``parent_allocator``);
- observation: ``queue`` = the deque's page indices, left (allocated first) first;
  a page's ref = ``meta.ref_count``, except that LMCache builds every page with
  ``ref_count = 1`` although it is free, and ``allocate`` overwrites it with 1, so until
  a page is first handed out its holders are ``ref_count - 1``; ``free_count`` =
  the address manager's free bytes / page bytes; no index, no null block.

Policies (declared, see ``Traits``): freed pages go to the back and allocation takes
the front (FIFO), prefix caching off, no null block, and no documented misuse error:
``ref_count_down`` below zero logs a warning, resets the count to 0 "as a hack" and
frees the page again, so misuse findings are robustness findings.

Forking. Every page object holds a ``threading.Lock``, so the driver neither pickles
nor deep-copies: the model checker and the minimizer replay op prefixes instead
(``kvspec.mc.fork.ReplayFork``, chosen by ``choose_fork`` when the others fail).
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Iterator, Optional

from kvspec.errors import TargetError
from kvspec.spec.config import Config
from kvspec.spec.observation import BlockState, Observation
from kvspec.spec.ops import Alloc, Free, FreeForeign, Op, Touch
from kvspec.targets.base import Driver, Target, Traits
from kvspec.targets.stub_import import package_dir, stand_ins

INSTALL = "pip install --no-deps lmcache==0.5.6"
MODULE = "lmcache.v1.memory_allocators.paged_tensor_memory_allocator"


class AllocRefused(Exception):
    """``batched_allocate`` returned None: too few free pages (LMCache's refusal)."""


class _NoDeviceOps:
    """Stands in for ``lmcache.device_ops``: pinned/NUMA host memory, never used here."""

    def __getattr__(self, name: str) -> Any:
        def unavailable(*_a: Any, **_k: Any) -> Any:
            raise RuntimeError(f"lmcache.device_ops.{name} is not available under kvspec")
        return unavailable


@contextlib.contextmanager
def _quiet_import() -> Iterator[None]:
    # LMCache logs at INFO on import and on every allocator built (to stderr); its
    # double-release warning is also a log line. kvspec reports findings itself.
    old = os.environ.get("LMCACHE_LOG_LEVEL")
    os.environ["LMCACHE_LOG_LEVEL"] = "ERROR"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("LMCACHE_LOG_LEVEL", None)
        else:
            os.environ["LMCACHE_LOG_LEVEL"] = old


def _quiet_loggers() -> None:
    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith("lmcache"):
            logging.getLogger(name).setLevel(logging.ERROR)


def load_allocator() -> type:
    """PagedTensorMemoryAllocator, imported without running ``lmcache/__init__.py``."""
    import importlib
    import sys

    cached = sys.modules.get(MODULE)
    if cached is not None and isinstance(getattr(cached, "PagedTensorMemoryAllocator", None), type):
        return cached.PagedTensorMemoryAllocator
    root = package_dir("lmcache", "lmcache", INSTALL)
    try:
        with _quiet_import(), stand_ins(root, ("lmcache",)):
            stub = sys.modules["lmcache"]
            platform = importlib.import_module("lmcache.v1.platform")
            stub.torch_dev = platform.torch_dev
            stub.torch_device_type = platform.torch_device_type
            stub.device_ops = _NoDeviceOps()
            mod = importlib.import_module(MODULE)
    except TargetError:
        raise
    except Exception as e:  # a missing dependency (prometheus_client, sortedcontainers, ...)
        raise TargetError(f"target lmcache: cannot import {MODULE}: {type(e).__name__}: {e} ({INSTALL})") from None
    finally:
        _quiet_loggers()
    cls = getattr(mod, "PagedTensorMemoryAllocator", None)
    if not isinstance(cls, type):
        raise TargetError(f"target lmcache: {MODULE} defines no class PagedTensorMemoryAllocator")
    return cls


class LMCachePoolDriver(Driver):
    def __init__(self, cls: type, config: Config) -> None:
        import torch

        if config.level != "pool":
            raise TargetError("target lmcache: the paged memory allocator has only a pool-level API (--level pool)")
        if getattr(config, "kv_groups", "full") not in ("full", None):
            raise TargetError("target lmcache: one pool of pages; KV-cache groups (--kv-groups) do not apply")
        # A page of block_size one-byte slots: only the page count matters to the allocator.
        self.shapes = [torch.Size([config.block_size])]
        self.dtypes = [torch.uint8]
        self.cls = cls
        try:
            self.alloc = cls(torch.zeros(config.num_blocks * config.block_size, dtype=torch.uint8),
                             self.shapes, self.dtypes)
        except Exception as e:
            raise TargetError(f"target lmcache: cannot build PagedTensorMemoryAllocator: {type(e).__name__}: {e}") from None
        _quiet_loggers()
        self.pages = sorted(self.alloc.free_blocks, key=lambda o: o.meta.address)  # one object per page, for good
        if [o.meta.address for o in self.pages] != list(range(config.num_blocks)):
            raise TargetError("target lmcache: the allocator's pages are not numbered 0..num_blocks-1")
        self.handed_out: set[int] = set()
        self._other: Optional[Any] = None

    # Refuse copies up front: a copy of LMCache's objects fails only half-way (on a page's
    # lock), and the half-built copies then fail again in their ``__del__``.
    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError("an LMCache allocator holds a threading.Lock per page and cannot be copied")

    def __deepcopy__(self, memo: Any) -> Any:
        raise TypeError("an LMCache allocator holds a threading.Lock per page and cannot be copied")

    def _page(self, b: int) -> Any:
        # A caller holds a page's MemoryObj only once allocate handed it out; a page
        # never handed out has no object to release or share (the op is refused here).
        if not 0 <= b < len(self.pages):
            raise IndexError(f"page {b} does not exist")
        if b not in self.handed_out:
            raise LookupError(f"page {b} was never handed out: no caller holds its MemoryObj")
        return self.pages[b]

    def _foreign(self) -> Any:
        import torch

        if self._other is None:
            self._other = self.cls(torch.zeros(2 * self.shapes[0].numel(), dtype=torch.uint8), self.shapes, self.dtypes)
            _quiet_loggers()
        obj = self._other.allocate(self.shapes, self.dtypes)
        if obj is None:  # its two pages are out: free one of them again
            obj = self._other.free_blocks[0] if self._other.free_blocks else None
        return obj

    def apply(self, op: Op) -> Any:
        if isinstance(op, Alloc):
            objs = self.alloc.batched_allocate(self.shapes, self.dtypes, op.n)
            if objs is None:
                raise AllocRefused(f"batched_allocate({op.n}) returned None")
            ids = tuple(o.meta.address for o in objs)
            self.handed_out.update(ids)
            return ids
        if isinstance(op, Free):
            for b in op.blocks:
                self._page(b).ref_count_down()
            return None
        if isinstance(op, Touch):
            for b in op.blocks:
                self._page(b).ref_count_up()
            return None
        if isinstance(op, FreeForeign):
            obj = self._foreign()
            if obj is not None:
                obj.ref_count_down()
            return None
        raise TargetError(f"target lmcache has no prefix cache: {type(op).__name__} is not supported")

    def observe(self) -> Observation:
        a = self.alloc
        queue = tuple(o.meta.address for o in a.free_blocks)
        queued = set(queue)
        blocks = tuple(BlockState(o.meta.ref_count - (0 if b in self.handed_out else 1), None, b in queued)
                       for b, o in enumerate(self.pages))
        free = a.address_manager.get_free_size() // a.align_bytes
        return Observation(blocks=blocks, queue=queue, index={}, free_count=free, null_block=None)


class LMCacheTarget(Target):
    name = "lmcache"
    traits = Traits(null_block=False, levels=("pool",), documented_noops=frozenset({"foreign_free"}),
                    free_order="fifo", prefix_caching="off",
                    unsupported_ops=frozenset({"Cache", "CachePartial", "Lookup", "Reset"}))

    def __init__(self) -> None:
        self.cls = load_allocator()

    def driver(self, config: Config) -> Driver:
        return LMCachePoolDriver(self.cls, config)

    def describe(self) -> str:
        try:
            from importlib.metadata import version
            return f"lmcache {version('lmcache')} (PagedTensorMemoryAllocator)"
        except Exception:
            return "lmcache (PagedTensorMemoryAllocator)"

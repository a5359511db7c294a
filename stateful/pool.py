"""Pool-level machine: allocate, free (order = eviction priority), touch, cache,
look up and reset, on small pools, against any target."""
from __future__ import annotations

from functools import lru_cache
from typing import Optional

from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from kvspec.spec.config import Config
from kvspec.spec.ops import Alloc, Cache, CachePartial, Free, FreeForeign, Lookup, Reset, Touch
from kvspec.targets.base import Target

from kvspec.stateful.base import KVMachine, RobustnessSink, ints, machine_class_name, sampled

LABELS = ("a", "b", "c", "d", "e")  # few labels, so equal hashes on different blocks happen


def _ordered_subset(items: list[int]):
    return _subset_of(tuple(items))


@lru_cache(maxsize=4096)  # built once per tuple of items (stateful.base.sampled)
def _subset_of(items: tuple) -> st.SearchStrategy:
    return st.lists(st.sampled_from(items), min_size=1, max_size=len(items), unique=True)


@lru_cache(maxsize=64)
def _labels(n: int) -> st.SearchStrategy:
    return st.lists(st.sampled_from(LABELS), min_size=n, max_size=n)


class PoolMachine(KVMachine):
    sizes = st.integers(4, 12)

    @initialize(data=st.data())
    def setup(self, data):
        n = data.draw(self.sizes, label="num_blocks")
        self.start(Config(level="pool", num_blocks=n, caching=self.draw_caching(data)))

    @property
    def m(self):
        return self.session.model

    @precondition(lambda self: self.session and self.m.free_count() > 0)
    @rule(data=st.data())
    def alloc(self, data):
        self.run(Alloc(data.draw(ints(1, self.m.free_count()), label="n")))

    @precondition(lambda self: self.session and self.m.held())
    @rule(data=st.data())
    def free(self, data):
        blocks = data.draw(_ordered_subset(self.m.held()), label="blocks")
        # A block held twice (touched) may be released twice in one call, as an engine
        # freeing two requests' shared block at once does: one free_blocks([b, b]) that
        # must queue it once (vLLM #42571). Drawn only where such a block is freed.
        shared = [b for b in blocks if self.m.ref[b] > 1]
        if shared and data.draw(ints(0, 3), label="release twice") == 0:   # one in four: the rest of the search keeps its pace
            b = data.draw(sampled(tuple(shared)), label="twice")
            blocks.insert(blocks.index(b) + 1, b)
        self.run(Free(tuple(blocks)))

    @precondition(lambda self: self.session and self.supports("Touch") and (self.m.cached() or self.m.held()))
    @rule(data=st.data())
    def touch(self, data):
        pool = sorted(set(self.m.cached()) | set(self.m.held()))
        self.run(Touch(tuple(data.draw(_ordered_subset(pool), label="blocks"))))

    @precondition(lambda self: self.session and self.m.caching and self.supports("Cache")
                  and any(self.m.hash[b] is None for b in self.m.held()))
    @rule(data=st.data())
    def cache(self, data):
        fresh = [b for b in self.m.held() if self.m.hash[b] is None]
        blocks = data.draw(_ordered_subset(fresh), label="blocks")
        labels = data.draw(_labels(len(blocks)), label="hashes")
        self.run(Cache(tuple(blocks), tuple(labels)))

    @precondition(lambda self: self.session is not None and self.supports("Lookup"))
    @rule(label=st.sampled_from(LABELS))
    def lookup(self, label):
        self.run(Lookup(label))

    @precondition(lambda self: self.session is not None and self.supports("Reset"))
    @rule()
    def reset(self):
        self.run(Reset())

    # -- misuse (only with misuse=True) -------------------------------------------
    @precondition(lambda self: self.misuse and self.session is not None)
    @rule(data=st.data())
    def misuse_free(self, data):
        # Any block, possibly repeated: double free, unheld block, the null block.
        b = data.draw(st.integers(0, self.m.n - 1), label="block")
        k = data.draw(st.integers(1, 2), label="times")
        self.run(Free((b,) * (self.m.ref[b] + k if data.draw(st.booleans(), label="excess") else k)))

    @precondition(lambda self: self.misuse and self.session is not None)
    @rule(data=st.data())
    def misuse_alloc(self, data):
        free = self.m.free_count()
        self.run(Alloc(data.draw(st.sampled_from([-1, -2, free + 1, free + 3]), label="n")))

    @precondition(lambda self: self.misuse and self.session and self.m.caching and self.m.held()
                  and self.supports("Cache"))
    @rule(data=st.data())
    def misuse_cache(self, data):  # with caching off, caching is a no-op, as in vLLM
        blocks = tuple(data.draw(_ordered_subset(self.m.held()), label="blocks"))
        if data.draw(st.booleans(), label="partial"):
            self.run(CachePartial(blocks, tuple(LABELS[: len(blocks) - 1])))
        else:
            self.run(Cache(blocks + blocks[:1], tuple(LABELS[: len(blocks) + 1])))

    @precondition(lambda self: self.misuse and self.session is not None)
    @rule()
    def misuse_foreign(self):
        self.run(FreeForeign(1))

    @precondition(lambda self: self.misuse and self.session is not None and self.m.null is not None
                  and self.supports("Touch"))
    @rule()
    def misuse_touch_null(self):
        self.run(Touch((self.m.null,)))


def pool_machine(target: Target, misuse: bool = False, on_robustness: Optional[RobustnessSink] = None,
                 sizes: Optional[st.SearchStrategy] = None) -> type[PoolMachine]:
    """A PoolMachine subclass bound to ``target``."""
    attrs = dict(target=target, misuse=misuse, on_robustness=staticmethod(on_robustness) if on_robustness else None,
                 counters={"examples": 0, "steps": 0})
    if sizes is not None:
        attrs["sizes"] = sizes
    return type(machine_class_name("PoolMachine", target), (PoolMachine,), attrs)

"""Cache-level machine: requests are admitted (prefix lookup + allocation, or
refusal), decoded, preempted and finished, against any target.

Prompts are built from a few block-sized chunks plus occasional partial tails, so
shared prefixes, equal blocks behind different prefixes, full-prompt hits and
evictions all happen within a short run.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Optional

from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from kvspec.spec.config import Config
from kvspec.spec.ops import Admit, Finish, Prefill, Preempt, Step, Verify
from kvspec.targets.base import Target

from kvspec.stateful.base import KVMachine, RobustnessSink, ints, machine_class_name, sampled

MAX_LIVE = 4   # requests alive at once
NUM_CHUNKS = 3
# Drawn per example for targets with ``cache_features`` unless --kv-groups pins one.
# The compressed layouts (DeepSeek-V4's compressed MLA groups beside a sliding window, as
# ``compressed:R``) are drawn only on releases that have the spec (``drawable``), so the
# older releases draw exactly what they did; two of them, so that a layout of full-like
# groups of two specs and a window comes up often enough to find a hybrid coordinator that
# trims only one of them (H9 of reports/vllm-history.md) at the sweep's 200 examples.
GROUP_SPECS = ("full", "full", "full,swa:2", "full,swa:3", "full,swa:4", "full,chunked:4", "swa:3",
               "full,swa:2,chunked:4", "full,compressed:4,swa:2", "compressed:2,compressed:4,swa:3")
HYBRID_SPECS = tuple(s for s in GROUP_SPECS if s != "full")
# Group kinds a target builds only where it says so (Traits.cache_kinds): vLLM's spec classes
# have them, kvspec's own allocator and the other targets do not.
# "eagle" (KVCacheManager's use_eagle) is opt-in the same way: a target that does not
# declare it never sees Config.use_eagle.
OPT_IN_KINDS = frozenset({"compressed", "eagle"})


# ``--kv-groups with:KIND``: every example draws its layout among the machine's own
# layouts that have a group of that kind (plain examples included), where a pinned spec
# would test one layout and the drawn ones test it in a few examples of a hundred. The
# release sweep gives each opt-in kind a release has such a pass (tools/vllm_releases.py).
FAMILY = "with:"


def layout_family(kv_groups: Optional[str]) -> Optional[str]:
    """The group kind of a ``with:KIND`` option, or None for a pinned or drawn layout."""
    return kv_groups[len(FAMILY):] if kv_groups and kv_groups.startswith(FAMILY) else None


def family_layouts(kind: str, missing: frozenset) -> tuple[str, ...]:
    """The layouts a target lacking ``missing`` can take that have a ``kind`` group, each once."""
    specs = dict.fromkeys(s for s in drawable(missing)[0] if kind in _kinds_of(s))
    return tuple(specs)


def _kinds_of(spec: str) -> set:
    return {p.partition(":")[0] for p in spec.split(",")}


def new_group_kinds(traits) -> frozenset:
    """The opt-in KV-cache group kinds (``OPT_IN_KINDS`` that are layout kinds) a target
    declares it builds: each gets a ``with:KIND`` pass in the release sweep."""
    layout_kinds = {k for s in GROUP_SPECS for k in _kinds_of(s)}
    return frozenset(getattr(traits, "cache_kinds", frozenset())) & OPT_IN_KINDS & layout_kinds


def missing_kinds(traits) -> frozenset:
    """The features a target lacks, as the machine reads them: its declared
    ``cache_missing`` and every opt-in group kind it does not declare in ``cache_kinds``."""
    return frozenset(getattr(traits, "cache_missing", frozenset())) | \
        (OPT_IN_KINDS - frozenset(getattr(traits, "cache_kinds", frozenset())))
# Extra keys, drawn as colliding identities (issue 37): an example with extra keys draws
# one PAIR of labels from a shared alphabet (A, B) and each admission then draws one of
# the two, or none. Each pair is two identities that must not share KV but that a key
# layout can confuse: a salt equal to an adapter's name (vLLM #44701), one name for two
# adapters (lora:A is adapter A at path A, lora:A@B the one at path B: #30931), the same
# multimodal item at another offset (#36708) or twice in one prompt. Drawing from a pair,
# not from every label, is what makes two admissions of one example collide: drawn from
# all 12 labels (or none), two admissions formed a given pair about once in 300. A
# multimodal hash always names the same one-token input. The reference model says what
# is the same KV (spec.model.groups).
IDENTITY_PAIRS = (
    ("lora:A", "salt:A"),
    ("lora:A", "lora:A@B"),
    ("lora:B@A;salt:B", "lora:B;salt:B"),
    ("mm:A@1", "mm:A@2"),
    ("mm:A@0;mm:A@2", "mm:A@1"),
    ("lora:A;salt:A", "lora:B;mm:B@1"),   # nothing alike: every part differs
)
EXTRAS = tuple(dict.fromkeys(label for pair in IDENTITY_PAIRS for label in pair))   # every label drawn


def _kinds(label: str) -> set:
    return {item.partition(":")[0] for item in label.split(";")}

# Swarm testing (Groce et al., ISSTA 2012): an example first draws which features it
# exercises, then draws only those. A plain example is the single-group ``full`` layout
# with no feature at all (the older single-group bugs live there, and a feature drawn into
# every example dilutes them: reports/patches.md, 393c1f7); a swarm example turns each
# feature on or off (``FEATURE_ON``), and an enabled feature is drawn on every
# admission or step (where mixing all features into every example had it on about half
# of the time). ``EXAMPLE_KINDS`` weights plain against swarm.
PLAIN_WEIGHT, SWARM_WEIGHT = 1, 2
EXAMPLE_KINDS = ("plain",) * PLAIN_WEIGHT + ("swarm",) * SWARM_WEIGHT
FEATURE_ON = (True, False)   # a feature's chance to be on in a swarm example: its share of True
FEATURES = ("groups", "max_model_len", "chunk", "external", "extra", "drafts")

# Built once: building strategies per draw costs more than running the step. Counts are
# drawn from a fixed range and cut to the prompt.
_CHUNK = st.integers(1, 16)
_EXTERNAL = st.integers(0, 16)
_DRAFT_COUNT = st.integers(0, 3)
_MAX_MODEL_LEN = st.integers(3, 16)
_SMALL = st.integers(1, 4)


_EXAMPLE_KIND = st.sampled_from(EXAMPLE_KINDS)
_FEATURE_ON = st.sampled_from(FEATURE_ON)


@lru_cache(maxsize=None)  # one strategy per block size: building it per draw is slow
def _tokens(block_size: int) -> st.SearchStrategy:
    """Every token of the chunks (a step's token, a draft)."""
    return st.sampled_from([t for c in chunk_tokens(block_size) for t in c])


@lru_cache(maxsize=None)
def _at_least(strategy: st.SearchStrategy, lo: int) -> st.SearchStrategy:
    return strategy.filter(lambda b: b >= lo)


@lru_cache(maxsize=None)
def drawable(missing: frozenset) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """The hybrid group specs and identity pairs (extra-key labels) a target lacking
    ``missing`` (features, as in ``Traits.cache_missing``: an older vLLM release) can take;
    with nothing missing, HYBRID_SPECS and IDENTITY_PAIRS. A pair is kept only whole."""
    def spec_ok(spec: str) -> bool:
        kinds = _kinds_of(spec)
        return (spec.count(",") == 0 or "groups" not in missing) and not kinds & missing \
            and (len(kinds) < 3 or "three_kinds" not in missing)
    specs = tuple(s for s in HYBRID_SPECS if spec_ok(s))
    # Swarm weighting by what is new: the layouts with an opt-in group kind this target has
    # (one older releases lack: compressed, from vLLM 0.20.0) are drawn as often as all the
    # others together, since a release's newest code is where its new bugs live; a target
    # without such a kind draws exactly what it did.
    new = tuple(s for s in specs if _kinds_of(s) & OPT_IN_KINDS)
    old = len(specs) - len(new)
    if new and old:
        specs = tuple(s for s in specs if s not in new) + new * max(1, old // len(new))
    pairs = tuple(p for p in IDENTITY_PAIRS if not (_kinds(p[0]) | _kinds(p[1])) & missing)
    return specs, pairs


@lru_cache(maxsize=None)  # one strategy per pair: building it per draw is slow
def _extra_of(pair: tuple[str, str]) -> st.SearchStrategy:
    return st.sampled_from((None,) + pair)


def plain_layout_probability() -> float:
    """The chance that an example (of a target with features, groups not pinned) draws
    the single-group ``full`` layout: every plain example, and swarm examples with the
    groups feature off."""
    plain = EXAMPLE_KINDS.count("plain") / len(EXAMPLE_KINDS)
    return plain + (1 - plain) * FEATURE_ON.count(False) / len(FEATURE_ON)


def chunk_tokens(block_size: int) -> list[list[int]]:
    """Chunk c is the block ``[10c+1, ..., 10c+block_size]``."""
    return [[10 * c + i + 1 for i in range(block_size)] for c in range(NUM_CHUNKS)]


@lru_cache(maxsize=None)  # one strategy per block size: building it per draw is slow
def prompts(block_size: int) -> st.SearchStrategy:
    chunks = chunk_tokens(block_size)
    body = st.lists(st.sampled_from(chunks), min_size=0, max_size=3).map(lambda cs: [t for c in cs for t in c])
    tail = st.lists(st.sampled_from([t for c in chunks for t in c]), min_size=0, max_size=max(block_size - 1, 0))
    return st.tuples(body, tail).map(lambda bt: tuple(bt[0] + bt[1])).filter(bool)


def whole_block_chunks(spec: str, block_size: int) -> str:
    """``spec`` with every drawn chunk size rounded up to whole blocks. vLLM's chunked local
    attention assumes it (unchecked: reports/vllm.md, upstream findings) and real chunk
    sizes (8192) always are; a chunk pinned with --kv-groups is left as given."""
    out = []
    for part in spec.split(","):
        kind, _, size = part.partition(":")
        if kind == "chunked" and int(size) % block_size:
            part = f"chunked:{-(-int(size) // block_size) * block_size}"
        out.append(part)
    return ",".join(out)


class CacheMachine(KVMachine):
    sizes = st.integers(4, 12)
    block_sizes = st.integers(1, 4)

    @initialize(data=st.data())
    def setup(self, data):
        n = data.draw(self.sizes, label="num_blocks")
        lo = getattr(self.target.traits, "min_block_size", 1)  # below it: outside the target's contract
        bs = data.draw(_at_least(self.block_sizes, lo), label="block_size")
        self.next_id = 1
        extra = {}
        self.enabled: frozenset = frozenset()
        if self.features:
            self.enabled = self.draw_enabled(data)
            spec = "full"
            family = layout_family(self.kv_groups)
            if family:
                spec = whole_block_chunks(data.draw(sampled(family_layouts(family, self._missing)),
                                                    label="kv_groups"), bs)
            elif "groups" in self.enabled:
                spec = whole_block_chunks(data.draw(sampled(self._drawable[0]), label="kv_groups"), bs)
            extra["kv_groups"] = spec if family else self.kv_groups or spec
            extra["max_model_len"] = (data.draw(_MAX_MODEL_LEN, label="max_model_len")
                                      if "max_model_len" in self.enabled else None)
            self.identities = (data.draw(sampled(self._drawable[1]), label="identity pair")
                               if "extra" in self.enabled else None)
        elif self.kv_groups is not None:
            extra["kv_groups"] = self.kv_groups
        caching = self.draw_caching(data)
        if caching and self._eagle_layout(extra.get("kv_groups")):
            # drawn last, so that every example that cannot take it draws what it did before
            extra["use_eagle"] = data.draw(st.booleans(), label="use_eagle")
        self.start(Config(level="cache", num_blocks=n, block_size=bs, caching=caching, **extra))

    def _eagle_layout(self, spec: Optional[str]) -> bool:
        """Whether this example may draw ``use_eagle`` (an EAGLE/MTP drafter: hits drop the
        block they matched last): a swarm example of a target that opts in (``eagle``),
        over a layout of several groups (where the coordinator's fixed-point loop applies
        the drop: H10 of reports/vllm-history.md) with no chunked local group (vLLM's
        chunked manager asserts that it takes no EAGLE drop)."""
        if not self.enabled or "eagle" in self._missing or not spec:
            return False
        kinds = [p.partition(":")[0] for p in spec.split(",")]
        return len(kinds) > 1 and "chunked" not in kinds

    # -- KV-cache groups, chunked prefill, drafts, extra keys, connector tokens ----------
    kv_groups: Optional[str] = None   # pinned by --kv-groups (or a with:KIND family); None: drawn where supported
    identities: Optional[tuple[str, str]] = None   # this example's identity pair (feature "extra")

    @property
    def features(self) -> bool:
        return bool(getattr(self.target.traits, "cache_features", False))

    @property
    def _missing(self) -> frozenset:
        return missing_kinds(self.target.traits)

    @property
    def _drawable(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return drawable(self._missing)

    def _can(self, feature: str) -> bool:
        """Whether this target (release) has ``feature`` at all: a missing one is never drawn."""
        if feature == "groups":
            return self.kv_groups is None and bool(self._drawable[0])  # pinned by --kv-groups, or none drivable
        if feature == "extra":
            return bool(self._drawable[1])
        return feature not in self._missing

    def draw_enabled(self, data) -> frozenset:
        """The features this example exercises (swarm testing: see ``EXAMPLE_KINDS``)."""
        if data.draw(_EXAMPLE_KIND, label="example kind") == "plain":
            return frozenset()
        wanted = [f for f in FEATURES if self._can(f)]
        on = _FEATURE_ON
        return frozenset(f for f in wanted if data.draw(on, label=f"feature {f}"))

    def _admit_options(self, data, n: int, new: bool) -> dict:
        """Chunk, extra keys and connector tokens of an admission (targets with features),
        each drawn only where this example enables it."""
        on = self.enabled
        out: dict = {}
        if "chunk" in on:
            out["chunk"] = min(data.draw(_CHUNK, label="chunk"), max(n, 1))
        if "external" in on:
            out["external"] = min(data.draw(_EXTERNAL, label="external"), n)
        if new and "extra" in on:
            out["extra"] = data.draw(_extra_of(self.identities), label="extra")
        return out

    def _steppable(self) -> list[str]:
        # The engine's protocol: no Step for a request whose last allocation was refused
        # (the model's ``steppable``); the machine draws Preempt, Finish or another
        # request's op instead, as vLLM's scheduler (preempt) and nano-vllm's (wait) do.
        return self.m.steppable()

    @property
    def m(self):
        return self.session.model

    @precondition(lambda self: self.session and len(self.m.reqs) < MAX_LIVE)
    @rule(data=st.data())
    def admit_new(self, data):
        rid = f"r{self.next_id}"
        self.next_id += 1
        prompt = data.draw(prompts(self.session.config.block_size), label="prompt")
        self.run(Admit(rid, prompt, **self._admit_options(data, len(prompt), True)))

    @precondition(lambda self: self.session and self.m.waiting())
    @rule(data=st.data())
    def admit_waiting(self, data):
        rid = data.draw(sampled(tuple(self.m.waiting())), label="req")
        self.run(Admit(rid, **self._admit_options(data, len(self.m.reqs[rid].tokens), False)))

    @precondition(lambda self: self.session and self._steppable())
    @rule(data=st.data())
    def step(self, data):
        rid = data.draw(sampled(tuple(self._steppable())), label="req")
        tokens = _tokens(self.session.config.block_size)
        token = data.draw(tokens, label="token")
        drafts = ()
        if "drafts" in self.enabled:
            k = data.draw(_DRAFT_COUNT, label="drafts")
            drafts = tuple(data.draw(tokens, label="draft") for _ in range(k))
        self.run(Step(rid, token, drafts))

    @precondition(lambda self: self.session and self.m.running())
    @rule(data=st.data())
    def preempt(self, data):
        self.run(Preempt(data.draw(sampled(tuple(self.m.running())), label="req")))

    @precondition(lambda self: self.session and self.m.reqs)
    @rule(data=st.data())
    def finish(self, data):
        self.run(Finish(data.draw(sampled(tuple(sorted(self.m.reqs))), label="req")))

    # -- misuse ----------------------------------------------------------------------
    @precondition(lambda self: self.misuse and self.session is not None)
    @rule()
    def misuse_finish_unknown(self):
        self.run(Finish("ghost"))

    @precondition(lambda self: self.misuse and self.session and self.m.waiting())
    @rule(data=st.data())
    def misuse_preempt_waiting(self, data):
        self.run(Preempt(data.draw(st.sampled_from(self.m.waiting()), label="req")))


class SchedulerMisuse:
    """The misuses a scheduler can commit at the cache level: admitting a running request
    again (by id, or as a new request under its id), an empty prompt, stepping a finished
    request and finishing one twice. Mixed in only with misuse=True, so that runs without
    misuse draw exactly the sequences they always did (a rule's presence changes draws)."""

    def _finished(self) -> list[str]:
        # Ids are handed out in order and a refused or rejected admission keeps its id in
        # the model, so an id below next_id that the model no longer has was finished.
        return [rid for rid in (f"r{i}" for i in range(1, self.next_id)) if rid not in self.m.reqs]

    def run(self, op) -> None:
        # Remember requests finished while running: their computed tokens are what lets a
        # manager tell a finished request from a new one (a waiting one has none).
        ran = isinstance(op, Finish) and self.session is not None and op.req in self.m.running()
        super().run(op)
        if ran and self.session is not None and op.req not in self.m.reqs:
            self.__dict__.setdefault("finished_running", []).append(op.req)

    @precondition(lambda self: self.session and self.m.running())
    @rule(data=st.data())
    def misuse_readmit_running(self, data):
        rid = data.draw(st.sampled_from(self.m.running()), label="req")
        as_new = data.draw(st.booleans(), label="as_new")
        self.run(Admit(rid, tuple(self.m.reqs[rid].tokens) if as_new else None))

    @precondition(lambda self: self.session is not None)
    @rule()
    def misuse_empty_prompt(self):
        self.run(Admit(f"r{self.next_id}", ()))  # rejected: the id stays free for the next admission

    @precondition(lambda self: self.session and self.__dict__.get("finished_running"))
    @rule(data=st.data())
    def misuse_step_finished(self, data):
        self.run(Step(data.draw(st.sampled_from(self.finished_running), label="req"), 1))

    @precondition(lambda self: self.session and self._finished())
    @rule(data=st.data())
    def misuse_finish_twice(self, data):
        self.run(Finish(data.draw(st.sampled_from(self._finished()), label="req")))


class FeatureCacheMachine(CacheMachine):
    """The cache machine with the rules of chunked prefill and draft verification, for
    targets with ``cache_features`` (kept apart so that other targets draw exactly the
    sequences they always did)."""

    @precondition(lambda self: self.session and self.features and self.m.prefilling())
    @rule(data=st.data())
    def prefill(self, data):
        rid = data.draw(sampled(tuple(self.m.prefilling())), label="req")
        self.run(Prefill(rid, data.draw(_SMALL, label="n")))

    @precondition(lambda self: self.session and self.features and self.m.drafting())
    @rule(data=st.data())
    def verify(self, data):
        rid = data.draw(sampled(tuple(self.m.drafting())), label="req")
        self.run(Verify(rid, data.draw(ints(0, len(self.m.reqs[rid].drafts)), label="accepted")))


def cache_machine(target: Target, misuse: bool = False, on_robustness: Optional[RobustnessSink] = None,
                  sizes: Optional[st.SearchStrategy] = None, kv_groups: Optional[str] = None) -> type[CacheMachine]:
    """A CacheMachine subclass bound to ``target`` (``kv_groups`` pins its KV-cache groups)."""
    attrs = dict(target=target, misuse=misuse, on_robustness=staticmethod(on_robustness) if on_robustness else None,
                 counters={"examples": 0, "steps": 0}, kv_groups=kv_groups)
    if sizes is not None:
        attrs["sizes"] = sizes
    base = FeatureCacheMachine if getattr(target.traits, "cache_features", False) else CacheMachine
    bases = (SchedulerMisuse, base) if misuse else (base,)
    return type(machine_class_name("CacheMachine", target), bases, attrs)

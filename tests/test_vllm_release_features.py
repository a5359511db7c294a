"""Features found per vLLM release, and what the cache machine draws from them.

Without release trees: the installed vLLM (0.33.0) has every feature, so the cache
machine's draws are the full ones; a target declaring features missing gets only the
group layouts and extra keys it can take. The release sweep adds an engine pass where
the probe built the engine. Per-release detection, read off each release's own sources,
is in tests/upstream/test_vllm_releases.py."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvspec.stateful.cache import HYBRID_SPECS, IDENTITY_PAIRS, OPT_IN_KINDS, drawable
from kvspec.vllm.compat import FEATURES, CacheApi

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("vllm_releases", ROOT / "tools" / "vllm_releases.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _new_kind(spec: str) -> bool:
    return bool({p.partition(":")[0] for p in spec.split(",")} & OPT_IN_KINDS)


def test_nothing_missing_draws_every_layout_and_key():
    """Every layout and key is drawable; the layouts with a group kind older releases lack
    (``compressed``) are weighted to half of the draws (swarm weighting by what is new)."""
    specs, extras = drawable(frozenset())
    assert tuple(dict.fromkeys(specs)) == HYBRID_SPECS and extras == IDENTITY_PAIRS
    new = [s for s in specs if _new_kind(s)]
    assert new and 2 * len(new) == len(specs)


def test_a_release_without_the_new_kind_draws_as_before():
    """Weighting is gated by the kind: without it the layouts are HYBRID_SPECS' own, in order."""
    specs, _ = drawable(frozenset({"compressed"}))
    assert list(specs) == [s for s in HYBRID_SPECS if not _new_kind(s)]


@pytest.mark.parametrize("missing", [{"groups"}, {"chunked"}, {"swa", "chunked"}, {"groups", "chunked", "mm"},
                                     {"three_kinds"},
                                     {"lora", "salt"}, set(FEATURES)])
def test_a_missing_feature_is_never_drawn(missing):
    """``drawable`` gives the hybrid layouts a release can take (the single-group ``full``
    layout is the swarm's plain choice, always there) and the extra keys it can take."""
    specs, extras = drawable(frozenset(missing))
    assert all(s in HYBRID_SPECS for s in specs)
    for spec in specs:
        kinds = {p.partition(":")[0] for p in spec.split(",")}
        assert not kinds & missing
        assert "groups" not in missing or len(spec.split(",")) == 1
        assert "three_kinds" not in missing or len(kinds) < 3
    for label in (label for pair in extras for label in pair):
        assert not {i.partition(":")[0] for i in label.split(";")} & missing
    # and nothing drawable is dropped: every layout and key that avoids them stays
    keep = [s for s in HYBRID_SPECS if not {p.partition(":")[0] for p in s.split(",")} & missing
            and ("groups" not in missing or "," not in s)
            and ("three_kinds" not in missing or len({p.partition(":")[0] for p in s.split(",")}) < 3)]
    assert list(dict.fromkeys(specs)) == keep   # each once (a new kind's layouts are repeated: weighted)
    assert list(extras) == [p for p in IDENTITY_PAIRS
                            if not {i.partition(":")[0] for e in p for i in e.split(";")} & missing]


def test_a_release_without_several_groups_never_draws_a_hybrid_layout():
    """Swarm examples turn the layout feature on only where a layout other than ``full`` is
    drivable (a lone ``swa:3`` group needs no coordinator of several groups)."""
    from kvspec.stateful.cache import CacheMachine

    class Probe(CacheMachine):
        def __init__(self, missing):  # only what _can reads
            self.kv_groups = None
            self.target = type("T", (), {"traits": type("Tr", (), {"cache_missing": frozenset(missing)})()})()

    assert Probe({"groups"})._can("groups") is True          # swa:3 alone
    assert Probe({"groups", "swa"})._can("groups") is False
    assert Probe(set())._can("groups") is True
    assert Probe({"lora", "salt", "mm"})._can("extra") is False
    assert Probe({"drafts"})._can("drafts") is False


def test_cache_api_missing_names_what_a_release_lacks():
    old = CacheApi(kinds=frozenset({"full", "swa"}), several_groups=False, external=False, draft_arg=True,
                   extra=frozenset({"lora", "salt", "mm"}), mm_layout="hashes", hit_values=2)
    assert old.missing == {"groups", "chunked", "external", "three_kinds", "compressed", "eagle"}
    two = CacheApi(kinds=frozenset({"full", "swa", "chunked"}), several_groups=True, external=False,
                   draft_arg=False, extra=frozenset({"lora", "salt", "mm"}), mm_layout="features", hit_values=2,
                   three_kinds=False)
    assert two.missing == {"external", "three_kinds", "compressed", "eagle"}
    new = CacheApi(kinds=frozenset({"full", "swa", "chunked", "compressed"}), several_groups=True, external=True,
                   draft_arg=False, extra=frozenset({"lora", "salt", "mm"}), mm_layout="features", hit_values=3,
                   eagle=True)
    assert new.missing == frozenset()


def test_installed_vllm_has_every_feature():
    pytest.importorskip("vllm")
    from kvspec.vllm.target import VllmTarget

    t = VllmTarget()
    assert t.groups and t.traits.cache_features
    assert t.traits.cache_missing == frozenset(), t.traits.cache_missing
    assert t.cache_api.mm_layout == "features" and t.cache_api.external


def test_parse_extra_in_the_older_layout():
    pytest.importorskip("vllm")
    from kvspec.vllm.groups import parse_extra

    kw = parse_extra("mm:Y@3+2;mm:X@1;salt:s", layout="hashes")
    assert kw["multi_modal_hashes"] == ["X", "Y"]   # offset order
    assert [(p.offset, p.length) for p in kw["multi_modal_placeholders"]] == [(1, 1), (3, 2)]
    assert len(kw["multi_modal_inputs"]) == 2 and kw["cache_salt"] == "s"
    new = parse_extra("mm:Y@3+2;mm:X@1")
    assert [f.identifier for f in new["mm_features"]] == ["X", "Y"]


def test_the_sweep_adds_an_engine_pass_where_the_engine_builds():
    vr = _tool()
    for version in ("0.8.0", "0.14.0", "0.27.0", "0.33.0"):
        without = vr.passes_for(version)
        with_engine = vr.passes_for(version, engine=True)
        assert with_engine[:-1] == without and all(p.level == "all" and not p.kv_groups for p in without)
        name, pol, level, kv_groups = with_engine[-1]
        assert (name, level, kv_groups) == (vr.ENGINE_PASS, "engine", "")
        both = [p.policies for p in without if p.name.endswith("caching both")]
        assert pol == (both[0] if both else without[-1].policies if len(without) > 1 else "")
        # an opt-in group kind the probe found: one cache pass drawing the layouts with it,
        # under the engine pass's policy, before the engine pass
        with_kind = vr.passes_for(version, engine=True, kinds=["compressed"])
        assert with_kind[:-2] == without and with_kind[-1] == with_engine[-1]
        assert with_kind[-2][2:] == ("cache", "with:compressed") and with_kind[-2].policies == pol
    assert vr.group_kinds({"new_group_kinds": ["compressed"]}) == ["compressed"] and vr.group_kinds({}) == []
    assert vr.engine_ok({"engine": "yes"}) and not vr.engine_ok({"engine": "no: x"}) and not vr.engine_ok({})


def test_findings_are_matched_and_labelled():
    vr = _tool()

    def finding(inv, level, caching, message=""):
        return {"invariant": inv, "level": level, "config": {"caching": caching}, "message": message}

    r = {"violations": [finding("NO_CRASH", "engine", True, "... the engine raised IndexError: list index out of range"),
                        finding("NO_CRASH", "cache", True, "... the target raised AssertionError: ")]}
    vr.annotate("0.9.0", r, "unhashed_free_first=false")
    eng, cache = r["violations"]
    assert "#19459" in eng["upstream"] and eng["label"] == "bug"
    assert "null block" in cache["upstream"] and cache["label"] == "bug"
    r = {"violations": [finding("NO_CRASH", "engine", True, "IndexError")]}
    vr.annotate("0.9.1", r, "")    # outside #19459's releases: not matched, still a bug
    assert r["violations"][0]["upstream"] == "" and r["violations"][0]["label"] == "bug"
    mm = ("block 3: two different contents (group 0, extra keys (None, None, (('X', 1),)), prefix [1, 2, 3, 4] and "
          "group 0, extra keys (None, None, (('X', 2),)), prefix [1, 2, 3, 4]) got the same hash")
    r = {"violations": [finding("HASH_CHAIN", "cache", True, mm)]}
    vr.annotate("0.14.0", r, "unhashed_free_first=false")
    assert "#36708" in r["violations"][0]["upstream"] and r["violations"][0]["label"] == "bug"
    r = {"violations": [finding("EVICTION_ORDER", "pool", True)]}
    vr.annotate("0.10.0", r, "")   # the current-policy pass meets the policy of its time
    assert r["violations"][0]["label"] == "policy"
    r = {"violations": [finding("EVICTION_ORDER", "pool", False)]}
    vr.annotate("0.27.0", r, "")
    assert "#51482" in r["violations"][0]["upstream"] and r["violations"][0]["label"] == "bug"


def test_findings_are_matched_by_key_part_and_operation():
    """A HASH_CHAIN finding names the identity part its hash lost (``where``), and a pool
    finding the operation that broke it: each shipped bug is matched on its own releases only."""
    from kvspec.vllm.history import annotate

    def finding(inv, level, where=None, steps=()):
        return {"invariant": inv, "level": level, "config": {"caching": True}, "message": "",
                "where": where, "steps_text": list(steps)}

    r = {"violations": [finding("HASH_CHAIN", "cache", "key part: lora path"),
                        finding("HASH_CHAIN", "cache", "key part: lora name vs salt"),
                        finding("I1", "pool", steps=("Alloc(n=1)", "Touch(blocks=(1,))", "Free(blocks=(1, 1))")),
                        finding("I1", "pool", steps=("Alloc(n=1)", "Touch(blocks=(1,))"))]}
    annotate("0.22.0", r, "unhashed_free_first=false")
    lora_path, salt, double_free, touch = r["violations"]
    assert "#30931" in lora_path["upstream"] and "#44701" in salt["upstream"]
    assert "#42571" in double_free["upstream"] and touch["upstream"] == "" and touch["label"] == "bug"
    r = {"violations": [finding("HASH_CHAIN", "cache", "key part: lora path"),
                        finding("I1", "pool", steps=("Free(blocks=(1, 1))",))]}
    annotate("0.33.0", r, "")      # fixed there: a finding would be new, so a bug to read
    assert all(f["upstream"] == "" and f["label"] == "bug" for f in r["violations"])


def test_a_resumed_campaign_reuses_a_probe_of_the_same_code(tmp_path, monkeypatch):
    vr = _tool()
    calls = []

    def probe(version, cache):
        calls.append(version)
        return {"error": "no tree"} if version == "0.0.1" else {"engine": "yes", "version": version}

    monkeypatch.setattr(vr, "probe", probe)
    keep = tmp_path / "probes"
    assert vr.cached_probe("0.9.0", tmp_path, keep) == {"engine": "yes", "version": "0.9.0"}
    assert vr.cached_probe("0.9.0", tmp_path, keep) == {"engine": "yes", "version": "0.9.0"}
    assert calls == ["0.9.0"]   # the second came from the kept probe
    monkeypatch.setattr(vr, "code_fingerprint", lambda root=None: "other code")
    vr.cached_probe("0.9.0", tmp_path, keep)
    assert calls == ["0.9.0", "0.9.0"]   # kept under another fingerprint: probed again
    vr.cached_probe("0.0.1", tmp_path, keep)
    vr.cached_probe("0.0.1", tmp_path, keep)
    assert calls.count("0.0.1") == 2   # an error is never kept

"""The cache machine's per-example feature weighting (swarm testing) and its colliding
identities: plain examples come at the rate the weights say, the shared alphabet makes
salts, adapter names and multimodal items collide, and a hash key that leaves out part of
an adapter's identity is found within a bounded example count."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import get_state_machine_test

from kvspec.spec.model.groups import parse_extra
from kvspec.spec.ops import Admit, Step
from kvspec.targets.registry import load_target

CORPUS = Path(__file__).resolve().parents[1] / "kvspec" / "corpus" / "impl"


def _run(machine, examples: int, steps: int) -> None:
    test = get_state_machine_test(machine, settings=settings(
        max_examples=examples, stateful_step_count=steps, deadline=None, database=None,
        phases=(Phase.generate,), derandomize=True, suppress_health_check=list(HealthCheck)))
    test()


def _recording_machine(kv_groups=None):
    """The impl cache machine, recording each example's config and ops."""
    from kvspec.stateful import cache_machine
    base = cache_machine(load_target("impl"), kv_groups=kv_groups)
    examples: list[dict] = []

    class Recording(base):
        def start(self, config):
            examples.append({"config": config, "enabled": self.enabled, "ops": []})
            super().start(config)

        def run(self, op):
            examples[-1]["ops"].append(op)
            super().run(op)

    Recording.__name__ = base.__name__  # the derandomized seed follows the class name
    return Recording, examples


def test_plain_layout_is_drawn_at_the_rate_the_weights_give():
    from kvspec.stateful import cache as cm
    machine, examples = _recording_machine()
    n = 400
    _run(machine, n, 3)
    assert len(examples) >= n
    p = cm.plain_layout_probability()
    # derived from the weights: plain examples, plus swarm examples with groups off
    plain_share = cm.EXAMPLE_KINDS.count("plain") / len(cm.EXAMPLE_KINDS)
    assert 0 < plain_share < 1 and p == pytest.approx(plain_share + (1 - plain_share) / 2)
    full = sum(e["config"].kv_groups == "full" for e in examples) / len(examples)
    sigma = math.sqrt(p * (1 - p) / len(examples))
    assert abs(full - p) < 4 * sigma, (full, p)
    # an example with no feature at all draws none: no chunk, connector tokens, keys, drafts
    plain = [e for e in examples if not e["enabled"]]
    assert plain and all(e["config"].max_model_len is None for e in plain)
    for e in plain:
        for op in e["ops"]:
            if isinstance(op, Admit):
                assert op.chunk is None and op.external == 0 and op.extra is None, op
            if isinstance(op, Step):
                assert op.drafts == (), op
    # and every feature is drawn alone in some example
    from kvspec.stateful.cache import FEATURES
    assert {f for e in examples if len(e["enabled"]) == 1 for f in e["enabled"]} == set(FEATURES)


def test_pinned_groups_are_not_drawn():
    machine, examples = _recording_machine(kv_groups="full,swa:4")
    _run(machine, 60, 2)
    assert {e["config"].kv_groups for e in examples} == {"full,swa:4"}
    assert all("groups" not in e["enabled"] for e in examples)


def test_identities_collide_in_the_draws():
    """Over a bounded run: a salt equal to an adapter's name, one name for two adapters,
    and one multimodal item at two offsets (within a prompt or across prompts)."""
    machine, examples = _recording_machine()
    _run(machine, 300, 12)
    labels = {op.extra for e in examples for op in e["ops"] if isinstance(op, Admit) and op.extra}
    keys = [parse_extra(x) for x in labels]
    names = {k.lora.partition("@")[0] for k in keys if k.lora}
    adapters = {k.lora for k in keys if k.lora}
    salts = {k.salt for k in keys if k.salt}
    assert salts & names, (salts, names)
    assert any(len({a for a in adapters if a.partition("@")[0] == n}) > 1 for n in names), adapters
    offsets: dict[str, set] = {}
    for k in keys:
        for h, off, _ in k.mm:
            offsets.setdefault(h, set()).add(off)
    assert any(len(o) > 1 for o in offsets.values()), offsets
    # the model keeps them apart: a salt is not an adapter of the same name, and two
    # adapters under one name are two adapters
    assert parse_extra("salt:A").upto(4) != parse_extra("lora:A").upto(4)
    assert parse_extra("lora:A@B").upto(4) != parse_extra("lora:A").upto(4)
    assert parse_extra("lora:A@A") == parse_extra("lora:A")
    assert parse_extra("mm:A@2;mm:A@0") == parse_extra("mm:A@0;mm:A@2")


def test_adapter_keyed_by_name_is_found_within_bounded_examples(tmp_path):
    """The planted bug of the class "the hash key leaves out part of the identity": impl
    hashes a LoRA adapter by its name alone. Found within 1500 examples; its repro admits
    two adapters that share a name."""
    import json

    from kvspec.check.search import run_check
    bug = next(b for b in json.loads((CORPUS / "bugs.json").read_text()) if b["id"] == "lora_keyed_by_name")
    patch = str(CORPUS / bug["file"])
    report = run_check(load_target("impl", patch=patch), "impl", patch=patch, level="cache", seed=0,
                       max_examples=1500, report_dir=str(tmp_path))
    assert report.violations, "lora_keyed_by_name not found within 1500 examples"
    f = report.violations[0]
    assert f.invariant in bug["invariants"], f.invariant
    adapters = {parse_extra(op.extra).lora for op in f.steps if isinstance(op, Admit) and op.extra}
    adapters.discard(None)
    assert len({a.partition("@")[0] for a in adapters}) < len(adapters), adapters


def test_each_identity_pair_is_two_identities():
    """An example draws one pair and each admission one of its two labels (or none): every
    pair must be two identities the model keeps apart, or it could find nothing."""
    from kvspec.stateful.cache import EXTRAS, IDENTITY_PAIRS

    for a, b in IDENTITY_PAIRS:
        assert parse_extra(a).upto(4) != parse_extra(b).upto(4), (a, b)
    assert set(EXTRAS) == {label for pair in IDENTITY_PAIRS for label in pair}

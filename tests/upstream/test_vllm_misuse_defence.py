"""vLLM documents one misuse defence (issue 21): ``BlockPool.get_new_blocks`` asked for
more blocks than are free raises ``ValueError`` before it pops any. kvspec's declaration
holds that kind of misuse to ValueError (ATOMIC_REJECT otherwise) and leaves every other
misuse kind undocumented, so its findings stay robustness findings."""
import dataclasses

import pytest

pytest.importorskip("vllm.v1.core.block_pool",
                    reason="vllm's allocator is not importable: pip install --no-deps -r requirements/upstream.txt")

from kvspec.check.session import Session  # noqa: E402
from kvspec.spec.config import Config  # noqa: E402
from kvspec.spec.misuse import documented_errors  # noqa: E402
from kvspec.spec.ops import Alloc, Free  # noqa: E402
from kvspec.targets.registry import load_target  # noqa: E402


@pytest.fixture(scope="module")
def vllm():
    return load_target("vllm")


def test_the_declaration_lists_the_one_defence(vllm):
    assert vllm.traits.misuse_error_map == (("over_alloc", ValueError),)
    assert documented_errors(vllm.traits, "count 5 exceeds the 1 free blocks") == (ValueError,)
    # every other kind is undocumented: its findings are robustness findings
    assert documented_errors(vllm.traits, "double free of block 1 (held by 1)") == ()
    assert documented_errors(vllm.traits, "negative count -1") == ()


def test_over_capacity_is_refused_with_the_documented_error(vllm):
    s = Session(vllm, Config(level="pool", num_blocks=4))
    assert s.apply(Alloc(2)) == []
    assert s.misuse_reason(Alloc(5)) is not None
    assert s.apply(Alloc(5)) == []              # ValueError, state unchanged: defended


def test_another_declared_class_would_be_a_finding(vllm):
    class Other(Exception):
        pass

    s = Session(vllm, Config(level="pool", num_blocks=4))
    s.apply(Alloc(2))
    s.traits = dataclasses.replace(vllm.traits, misuse_error_map=(("over_alloc", Other),), misuse_errors=(Other,))
    found = s.apply(Alloc(5))
    assert found and found[0].invariant == "ATOMIC_REJECT" and "raised ValueError" in found[0].message


def test_an_undefended_misuse_is_not_held_to_the_class(vllm):
    """A free of an unheld block: vLLM accepts it; the finding is ATOMIC_REJECT ("accepted"),
    which the machines file as robustness, since the kind is undocumented."""
    s = Session(vllm, Config(level="pool", num_blocks=4))
    reason = s.misuse_reason(Free((1,)))
    assert reason is not None and documented_errors(vllm.traits, reason) == ()
    found = s.apply(Free((1,)))
    assert found and found[0].invariant == "ATOMIC_REJECT" and "accepted" in found[0].message

"""The vLLM adapter's call forms (kvspec.vllm.compat): read once per callable,
bound once, and passing exactly the names each release's callable takes. No vLLM
needed: the forms are read off plain Python callables shaped like two releases'."""
from __future__ import annotations

import inspect

import pytest

from kvspec.errors import TargetError
from kvspec.vllm import compat as compat


class OldPool:  # cache_full_blocks taking the hashes (to 0.10.x)
    def cache_full_blocks(self, request, blocks, block_hashes, num_cached_blocks, num_full_blocks, block_size,
                          hash_fn=None):
        return ("old", request, tuple(blocks), tuple(block_hashes), num_cached_blocks, num_full_blocks, block_size,
                hash_fn)


class NewPool:  # reading them off the request (0.11.0 on), with a group id
    def cache_full_blocks(self, request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id,
                          block_mask=None):
        return ("new", request, tuple(blocks), num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id)


FIXED = {"num_cached_blocks": 0, "block_size": 4, "kv_cache_group_id": 0, "hash_fn": "sha"}
VARYING = ("request", "blocks", "block_hashes", "num_full_blocks")


@pytest.mark.parametrize("cls", [OldPool, NewPool])
def test_a_bound_call_passes_only_the_names_the_release_takes(cls):
    fn = compat.bind(cls().cache_full_blocks, "cache_full_blocks()", FIXED, VARYING)
    got = fn(request="r", blocks=[1, 2], block_hashes=["h1", "h2"], num_full_blocks=2)
    expect = cls().cache_full_blocks(**{n: v for n, v in {**FIXED, "request": "r", "blocks": [1, 2],
                                                             "block_hashes": ["h1", "h2"], "num_full_blocks": 2}.items()
                                        if n in inspect.signature(cls.cache_full_blocks).parameters})
    assert got == expect


def test_a_required_parameter_nobody_supplies_is_a_target_error_at_bind_time():
    class Odd:
        def cache_full_blocks(self, request, blocks, mystery):
            return None

    with pytest.raises(TargetError, match="mystery"):
        compat.bind(Odd().cache_full_blocks, "cache_full_blocks()", FIXED, VARYING)
    with pytest.raises(TargetError, match="mystery"):
        compat.call(Odd().cache_full_blocks, "cache_full_blocks()", {"request": 1, "blocks": []})


def test_the_form_is_read_once_per_function_not_per_call_or_instance(monkeypatch):
    reads = []
    real = compat.params

    def counting(fn):
        reads.append(fn)
        return real(fn)

    monkeypatch.setattr(compat, "params", counting)

    class Pool:
        def cache_full_blocks(self, request, blocks, num_full_blocks):
            return num_full_blocks

    for _ in range(50):
        assert compat.call(Pool().cache_full_blocks, "x", {"request": 0, "blocks": [], "num_full_blocks": 3,
                                                           "unused": 9}) == 3
    assert len(reads) == 1


def test_a_class_form_is_its_constructors_and_keyword_only_names_count():
    class Request:
        def __init__(self, request_id, prompt_token_ids, *, block_hasher=None, lora_request=None):
            self.args = (request_id, tuple(prompt_token_ids), block_hasher, lora_request)

    make = compat.bind(Request, "Request()", {"lora_request": "L", "pooling_params": None},
                       ("request_id", "prompt_token_ids", "block_hasher"))
    assert make(request_id="a", prompt_token_ids=[1], block_hasher=None).args == ("a", (1,), None, "L")

    class OldRequest:  # no block_hasher: the varying name is dropped, not passed
        def __init__(self, request_id, prompt_token_ids, sampling_params=None):
            self.args = (request_id, tuple(prompt_token_ids), sampling_params)

    make = compat.bind(OldRequest, "Request()", {"sampling_params": "sp"},
                       ("request_id", "prompt_token_ids", "block_hasher"))
    assert make(request_id="b", prompt_token_ids=[2], block_hasher=object()).args == ("b", (2,), "sp")


def test_sampled_tokens_take_the_type_the_release_declares():
    """0.11.1 and 0.11.2 declare ``sampled_token_ids: list[np.ndarray]`` and call
    ``.tolist()`` on each; the other releases take lists. Passing lists to 0.11.1 made its
    update_from_output raise (a false NO_CRASH found by the release sweep)."""
    import dataclasses

    import numpy as np

    from kvspec.vllm.engine_compat import model_runner_output

    @dataclasses.dataclass
    class ArrayOutput:   # the 0.11.1 shape
        req_ids: list
        req_id_to_index: dict
        sampled_token_ids: "list[np.ndarray]"

    @dataclasses.dataclass
    class ListOutput:    # 0.11.0, 0.12.0 on
        req_ids: list
        req_id_to_index: dict
        sampled_token_ids: "list[list[int]]"

    a = model_runner_output(ArrayOutput, ["r1", "r2"], [[4], []], None)
    assert [t.tolist() for t in a.sampled_token_ids] == [[4], []]
    assert all(isinstance(t, np.ndarray) for t in a.sampled_token_ids)
    b = model_runner_output(ListOutput, ["r1"], [[4]], None)
    assert b.sampled_token_ids == [[4]]

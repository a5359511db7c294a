"""Kernel self-test corpus: every bug patch in kvspec/corpus/kernels must be caught.

Each patch is applied to a temporary copy of the kernels package, imported under a
fresh name, and run over a small fixed sweep; at least one case must miss the
float64 oracle. The unpatched kernels must pass the same sweep, so a catch is the
bug's doing and not the sweep's.
"""
from __future__ import annotations

import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

from kvspec.kernels.sweep import CORPUS_DIR, KernelCase, load_patched_kernels, run_case, unload_patched  # noqa: E402

BUGS = json.loads((CORPUS_DIR / "bugs.json").read_text())

# Small fp32 cases (tightest tolerance), each aimed at several bugs at once: block
# sizes other than the 16-token CPU tile, ragged lengths (NaN tails), seq_len 0 and
# more splits than the context needs (empty splits), GQA/MQA/MHA, causal extend
# with splits, a softcap.
SWEEP = [
    KernelCase(seq_lens=(0, 7, 23, 1), block_size=5, num_kv_heads=2, group=2, num_splits=3, q_gain=4.0, seed=1),
    KernelCase(seq_lens=(9, 40), q_lens=(4, 12), block_size=3, num_kv_heads=1, group=4, num_splits=2,
               softcap=5.0, q_gain=4.0, seed=2),
    KernelCase(seq_lens=(1, 17), block_size=1, num_kv_heads=2, group=1, head_dim=80, pad=0, seed=3),
]


def test_corpus_lists_the_required_bugs():
    ids = {b["id"] for b in BUGS}
    assert {"page_from_tile", "kv_load_unmasked", "merge_no_rescale", "no_inf_guard", "gqa_head_off_by_one"} <= ids
    for b in BUGS:
        assert (CORPUS_DIR / b["file"]).exists(), b["file"]
        assert b["level"] == "kernel"


def test_unpatched_kernels_pass_the_corpus_sweep():
    bad = [r.to_dict() for r in map(run_case, SWEEP) if not r.ok]
    assert not bad, bad


@pytest.mark.parametrize("bug", BUGS, ids=[b["id"] for b in BUGS])
def test_patch_is_caught(bug, tmp_path):
    mod = load_patched_kernels((CORPUS_DIR / bug["file"]).read_text(), tmp_path)
    try:
        # The copy must run its own (patched) kernel: an absolute kvspec.kernels import in
        # kernels/__init__.py would hand it the unpatched one.
        assert mod.paged_attention.__module__.startswith(mod.__name__ + "."), mod.paged_attention.__module__
        results = []
        for case in SWEEP:  # stop at the first catch: the rest would only cost time
            results.append(run_case(case, mod.paged_attention))
            if not results[-1].ok:
                break
    finally:
        unload_patched(mod)
    assert not results[-1].ok, f"{bug['id']} ({bug['title']}) was not caught: {[r.to_dict() for r in results]}"

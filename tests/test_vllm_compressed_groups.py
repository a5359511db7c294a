"""Compressed KV-cache groups (``--kv-groups compressed:R``: DeepSeek-V4's compressed MLA
spec) and H9 of reports/vllm-history.md: a hybrid coordinator that trims only its first
full-attention group to the hit all groups agreed on leaves a second full-like group
(another spec: a compressed one) holding cached blocks past that hit. Two symptoms, both
checked here: HIT_AGREEMENT at the admission, and, with connector tokens, a negative count
that the manager passes to ``BlockPool.get_new_blocks`` (reported as the manager's bug,
issue 37 part 6).

Whether a release has the bug is read off its own coordinator (what the truncation after
the fixed-point loop iterates over), never written down; the installed vLLM (0.33.0)
runs in-process, a release tree in a subprocess whose PYTHONPATH puts the tree first
(skipped, with the reason, where tools/vllm_releases.py has not extracted it)."""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvspec.spec.model.groups import Group, agreed_hit, canonical_groups, group_hit, needed_blocks, parse_groups

ROOT = Path(__file__).resolve().parents[1]

# r1 is admitted with 7 of its 8 tokens from a connector: its window group computes (and
# caches) only its last block, its two full-like groups all four. r2, the same prompt, then
# has a 3-block hit in the full-like groups and none in the window group: the agreed hit is 0.
CFG = dict(level="cache", num_blocks=30, block_size=2, caching=True, kv_groups="full,compressed:4,swa:2")
PROMPT = (1, 2, 3, 4, 5, 6, 7, 8)

REPLAY = r"""
import json, sys
from kvspec.check.replay import replay_outcome
from kvspec.spec.ops import Admit
cfg, prompt = json.loads(sys.argv[1])
out = {}
for ext in (0, 1):
    o = replay_outcome("vllm", cfg, [Admit("r1", tuple(prompt), external=7), Admit("r2", tuple(prompt), external=ext)],
                       op_timeout=None)
    v = o.violations[0] if o.failed else None
    out[str(ext)] = "pass" if v is None else [v.invariant, v.caller, v.message]
print(json.dumps(out))
"""


def _tool():
    spec = importlib.util.spec_from_file_location("vllm_releases", ROOT / "tools" / "vllm_releases.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _has_compressed_spec(tree: Path) -> bool:
    """An MLA spec with DeepSeek-V4's tokens per stored entry: ``compress_ratio`` on
    MLAAttentionSpec, later ``tokens_per_state`` on every attention spec."""
    src = (tree / "vllm" / "v1" / "kv_cache_interface.py").read_text()
    body = re.search(r"class MLAAttentionSpec\(.*?(?=\nclass )", src, re.S)
    return body is not None and ("compress_ratio:" in body.group(0) or "tokens_per_state:" in src)


def _trims_first_group_only(tree: Path) -> bool:
    """Whether the hybrid coordinator's truncation after its fixed-point loop cuts only
    ``attention_groups[0]`` to the agreed hit (rather than every full-attention group)."""
    src = (tree / "vllm" / "v1" / "core" / "kv_cache_coordinator.py").read_text()
    i = src.index("# Truncate")
    block = src[i:i + 400]
    return "self.attention_groups[0]" in block and "for group in self.attention_groups" not in block


def _replay() -> dict:
    """The replays, in this process (the installed vLLM)."""
    from kvspec.check.replay import replay_outcome
    from kvspec.spec.ops import Admit

    out = {}
    for ext in (0, 1):
        o = replay_outcome("vllm", CFG, [Admit("r1", PROMPT, external=7), Admit("r2", PROMPT, external=ext)],
                           op_timeout=None)
        v = o.violations[0] if o.failed else None
        out[str(ext)] = "pass" if v is None else [v.invariant, v.caller, v.message]
    return out


def _run(env: dict | None) -> dict:
    r = subprocess.run([sys.executable, "-c", REPLAY, json.dumps([CFG, PROMPT])], env=env, capture_output=True,
                       text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _check(got: dict, affected: bool) -> None:
    if not affected:
        assert got == {"0": "pass", "1": "pass"}, got
        return
    inv, caller, msg = got["0"]
    assert inv == "HIT_AGREEMENT" and "group 1 (compressed:4)" in msg and "past the 0 tokens" in msg, got["0"]
    inv, caller, msg = got["1"]
    # the manager's own arithmetic asked the pool for a negative count: its bug, named
    # (allocate_new_computed_blocks, allocate_external_computed_blocks from 0.26.0: one arithmetic)
    assert inv == "NO_CRASH" and caller.startswith("SingleTypeKVCacheManager.allocate_") \
        and "computed_blocks" in caller and "negative count" in msg, got["1"]


def test_a_compressed_group_is_full_attention_to_the_model():
    """compressed:R holds and shares blocks as full attention does (the ratio is page bytes),
    in a group of its own; a window group still lowers the hit every group agrees on."""
    groups = parse_groups("full, compressed:4,swa:2")
    assert canonical_groups("full, compressed:4,swa:2") == "full,compressed:4,swa:2"
    full, comp, swa = groups
    assert comp == Group("compressed", 4) and comp.whole and not swa.whole
    cached = {0, 1, 2}.__contains__
    assert group_hit(comp, cached, 7, 2) == group_hit(full, cached, 7, 2) == 6
    assert list(needed_blocks(comp, 6, 2)) == [0, 1, 2] and comp.skipped(5) == 0
    # the window group has cached only block 3: no hit at all
    assert agreed_hit(groups, lambda g: cached if g < 2 else {3}.__contains__, 7, 2) == 0
    with pytest.raises(ValueError):
        parse_groups("compressed")


# one affected release keeps CI short; 0.28.0, the last one, replays alike (docs-pending/history-i37eagle.md)
@pytest.mark.parametrize("version", ["0.20.0"])
def test_a_release_trimming_one_full_group_is_caught(version):
    tool = _tool()
    tree = tool.tree(version)
    if not (tree / "vllm" / "v1" / "core" / "kv_cache_coordinator.py").exists():
        pytest.skip(f"vLLM {version} is not extracted in {tree.parent} (python tools/vllm_releases.py --releases {version})")
    if not _has_compressed_spec(tree):
        pytest.skip(f"vLLM {version} has no compressed MLA spec (compress_ratio)")
    policies = "unhashed_free_first=false" if tool.version_key(version) < tool.version_key("0.24.0") else ""
    _check(_run(tool.env_for(version, policies=policies)), _trims_first_group_only(tree))


def test_installed_vllm_trims_every_full_group():
    import vllm

    tree = Path(vllm.__file__).resolve().parents[1]
    if not _has_compressed_spec(tree):
        pytest.skip("the installed vLLM has no compressed MLA spec")
    _check(_replay(), _trims_first_group_only(tree))

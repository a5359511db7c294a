"""What changed in vLLM's driven KV-cache code from release to release, as far as a finding
needs to know: the policies of each release's time, and the upstream changes (shipped bugs
and their fixes) a finding on a release is matched to.

A finding on an old release is one of three things. A *policy of its time* (vLLM documented
another free order then): the release sweep declares it in that release's second pass
(``POLICY_HISTORY``, the same keys as ``[tool.kvspec]``) so the search goes past it. A
*known upstream change*: a bug vLLM shipped and later fixed, matched by invariant, release
range, caching mode, level and the finding's message or code location (``KNOWN_CHANGES``),
so the report names its PR. Anything else is labelled a bug, to be read.

The list of shipped bugs, and how each release range was read off the releases' own code,
is ``reports/vllm-history.md``; the sweep is ``tools/vllm_releases.py``.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional


def version_key(v: str) -> tuple:
    """0.8.5.post1 sorts after 0.8.5 and before 0.9.0."""
    parts: list[Any] = []
    for p in v.split("."):
        m = re.match(r"(\d+)(?:post(\d+))?$", p)
        if m and m.group(2) is not None:
            parts += [int(m.group(1)), 0.5, int(m.group(2))]
        elif m:
            parts.append(int(m.group(1)))
        else:  # "post1" as its own component
            parts += [0.5, int(re.sub(r"\D", "", p) or 0)]
    return tuple(parts)


def in_range(version: str, first: str, until: str) -> bool:
    return version_key(first) <= version_key(version) < version_key(until)


# (first release, first release without it, declaration, what it was)
POLICY_HISTORY = (
    ("0.8.0", "0.24.0", "unhashed_free_first=false",
     "free_blocks appended every freed block to the tail, hashed or not, until #42656 "
     "(\"Apply LRU policy only to proper cache entries\") put unhashed blocks at the front (0.24.0)"),
    ("0.8.0", "0.9.0", 'free_order="fifo"',
     "with prefix caching off, KVCacheManager.free released a request's blocks head first "
     "(reversed only with caching on) until the single-type manager of 0.9.0"),
)


@dataclasses.dataclass(frozen=True)
class Change:
    """An upstream change a finding is matched to: every given field must match."""
    first: str                     # first release affected
    until: str                     # first release without it
    invariant: str
    caching: Optional[bool]        # the finding's caching mode, or None: either
    text: str                      # what the report says (PRs, releases)
    level: Optional[str] = None    # "pool", "cache", "engine", or None: any
    message: Optional[str] = None  # a regex the finding's message must contain
    where: Optional[str] = None    # a regex its code location / key part must contain
    op: Optional[str] = None       # the kind of operation that broke it ("Free")

    @property
    def policy(self) -> bool:
        return "policy of its time" in self.text

    def matches(self, version: str, finding: dict) -> bool:
        caching = (finding.get("config") or {}).get("caching")
        return (finding.get("invariant") == self.invariant and in_range(version, self.first, self.until)
                and (self.caching is None or caching == self.caching)
                and (self.level is None or finding.get("level") == self.level)
                and (self.message is None or re.search(self.message, finding.get("message") or "") is not None)
                and (self.where is None or re.search(self.where, finding.get("where") or "") is not None)
                and (self.op is None or (finding.get("steps_text") or [""])[-1].startswith(self.op + "(")))


KNOWN_CHANGES = (
    Change("0.27.0", "0.28.0", "EVICTION_ORDER", False,
           "regression: with prefix caching off, free_blocks appends freed blocks, so the most recently "
           "freed is reused last. Introduced by vllm-project/vllm#48017 (\"Skip LRU hash-split in free_blocks "
           "when prefix caching is off\", merged 2026-07-08, described as a no-op); fixed by "
           "vllm-project/vllm#51482 (\"free_blocks: restore prepend (LIFO) reuse order when prefix caching is "
           "off\", merged 2026-08-08), first released in 0.28.0"),
    Change("0.8.0", "0.24.0", "EVICTION_ORDER", None,
           "policy of its time, not a bug: freed blocks without a hash went to the tail like cached ones; "
           "vLLM's current order (unhashed first) came with vllm-project/vllm#42656 (\"Apply LRU policy only "
           "to proper cache entries\", merged 2026-05-14), first released in 0.24.0"),
    Change("0.9.0", "0.9.1", "NO_CRASH", True,
           "vllm-project/vllm#19459: find_longest_cache_hit indexes block_hashes[i] past a stale "
           "req_to_block_hashes after preemption with speculative decoding (IndexError); 0.9.1 iterates with zip",
           level="engine", message=r"IndexError"),
    Change("0.9.0", "0.11.0", "NO_CRASH", True,
           "cache_full_blocks asserts the previous block's hash, which a sliding window has already replaced "
           "by the null block (AssertionError); gone in 0.11.0, where the hashes come from the Request. Not on "
           "vLLM's tracker; reachable only with a window of about one block (fix: "
           "reports/upstream_fixes/releases/vllm_0.9.0_swa_parent_hash.diff)",
           level="cache", message=r"AssertionError"),
    Change("0.9.0", "0.19.0", "HASH_CHAIN", True,
           "a multimodal input's extra key is its hash without its offset in the block: the same item at another "
           "offset over the same tokens gets the same block hash; fixed by vllm-project/vllm#36708 (\"disambiguate "
           "multimodal prefix cache keys\", merged 2026-03-10), first read fixed in 0.19.0 (0.18.x not read)",
           level="cache", message=r"extra keys \(.*\(\('"),
    Change("0.9.0", "0.19.0", "HASH_CHAIN", True,
           "vllm-project/vllm#36708 (as above): a multimodal item's key without its offset",
           level="cache", where=r"key part: mm offset"),
    Change("0.14.0", "0.32.0", "HASH_CHAIN", True,
           "vllm-project/vllm#30931: the LoRA key is the adapter's name only, so two adapters under one name "
           "share KV; fixed when the key took (\"lora\", name, path) (read in 0.32.0)",
           level="cache", where=r"key part: lora path"),
    Change("0.14.0", "0.32.0", "HASH_CHAIN", True,
           "vllm-project/vllm#44701 (PR #44706): LoRA name and cache_salt enter the block hash as bare strings, so "
           "a request salted X shares blocks with LoRA adapter X; tagged keys by 0.32.0",
           level="cache", where=r"key part: lora name vs salt"),
    Change("0.10.0", "0.26.0", "I1", None,
           "vllm-project/vllm#42571 (PR #42615): free_blocks decrements every listed block, then queues every "
           "block at 0 in a second pass, so a block listed twice (two holders released in one call) is queued "
           "twice; one loop from 0.26.0 (read; 0.23.x-0.25.x not read)",
           level="pool", op="Free"),
    Change("0.10.0", "0.26.0", "ACCOUNTING", None,
           "vllm-project/vllm#42571 (as above): a block listed twice in one free_blocks call is queued twice",
           level="pool", op="Free"),
    Change("0.8.4", "0.8.5", "SLOTS", None,
           "EAGLE lookahead slots not reserved for a WAITING (new or resumed) request: the waiting path's "
           "allocate_slots passes no num_lookahead_tokens, so the drafter writes past the table where the pool "
           "leaves nothing to preallocate: vllm-project/vllm#16612, PR #16613 superseded by #16941 (read fixed in "
           "0.8.5; lookahead slots came with #16370 in 0.8.4)",
           level="engine", message=r"lookahead"),
    Change("0.11.0", "0.26.0", "SLOTS", None,
           "EAGLE lookahead slots not reserved for a request with no computed tokens "
           "(effective_lookahead_tokens = 0 if num_computed_tokens == 0), so the drafter writes past the table: "
           "introduced by vllm-project/vllm#20340, fixed by #43733 (read fixed in 0.26.0)",
           level="engine", message=r"lookahead"),
    Change("0.9.0", "0.9.1", "NO_CRASH", None,
           "vllm-project/vllm#18829: with a KV connector, aborting a request still waiting asserts in "
           "KVCacheManager.get_block_ids (AssertionError); fixed by #18485",
           level="engine", message=r"get_block_ids"),
    Change("0.15.0", "0.32.0", "KV_INTEGRITY", True,
           "vllm-project/vllm#49449 (and #49377): a streaming session's next input replaces the token after its "
           "kept prefix, but update_block_hashes only appends, so a block the discarded token completed keeps that "
           "token's hash and is cached under it holding the new token's KV; 0.32.0 drops the hashes past the kept "
           "tokens (read: del session.block_hashes[...]); PRs #49619, #52806, #53156",
           level="engine"),
    Change("0.8.0", "0.11.1", "COMMON_PREFIX", None,
           "vllm-project/vllm#23130 (\"Async KVConnectors can break shared prefix check\"; PR #23485): "
           "get_num_common_prefix_blocks counts a block as shared by the batch when its ref_cnt equals the number "
           "of RUNNING requests, but requests outside RUNNING hold references too (a load parked in "
           "WAITING_FOR_REMOTE_KVS, a finished request whose send is in flight); read: 0.11.0 compares with "
           "len(self.running), 0.11.1 with len(self.req_to_blocks)",
           level="engine"),
    Change("0.24.0", "0.32.0", "COMMON_PREFIX", None,
           "vllm-project/vllm#55227 (open, \"Skip cascade prefixes during deferred KV frees\"): with async "
           "scheduling and a consumer KV connector a finished request leaves req_to_blocks while its blocks keep "
           "their references behind the step in flight (#45357's fence), so ref_cnt == len(req_to_blocks) "
           "holds for a block one survivor lacks; read from 0.24.0; 0.32.0 removes cascade attention (the count "
           "is always 0)",
           level="engine"),
    Change("0.24.0", "0.30.0", "NO_LEAK", None,
           "vllm-project/vllm#49674 (fixed by #49675): with async scheduling and a consumer KV connector a freed "
           "request's blocks wait behind the step in flight (#45357's fence), and the allocation retry preempts "
           "such a victim anyway: it reclaims nothing (zero-progress preemption cascades); the fence read from "
           "0.24.0, the guard (_request_blocks_can_be_freed) from 0.30.0",
           level="engine", message=r"free is deferred"),
    Change("0.9.0", "0.16.0", "KV_INTEGRITY", None,
           "vllm-project/vllm#32255 (\"Delay freeing blocks of aborted async loads\", merged 2026-01-13): aborting "
           "a request whose connector load is in flight frees its blocks at once, while the load still writes "
           "them; read without the delay to 0.15.1, with it from 0.16.0",
           level="engine", message=r"connector load was in flight"),
    Change("0.16.0", "0.29.0", "HIT_AGREEMENT", True,
           "the hybrid coordinator cuts only its first full-attention group to the agreed hit: a second "
           "full-like group of another spec (DeepSeek-V4's compressed MLA groups) keeps cached blocks past it "
           "(reports/vllm-history.md H9); every full-attention group cut from 0.29.0 (read)",
           level="cache", message=r"\(compressed:\d+\) took cached block"),
    Change("0.16.0", "0.29.0", "NO_CRASH", True,
           "the same (H9): the untrimmed group's manager asks BlockPool.get_new_blocks for a negative count "
           "(connector tokens), which the pool takes unchecked; fixed in 0.29.0 (read)",
           level="cache", message=r"negative count"),
    Change("0.10.0", "0.20.0", "MIN_HIT", True,
           "EAGLE's \"drop the last matched block\" applied more than once per candidate hit in a hybrid "
           "(reports/vllm-history.md H10): the other groups are looked up at the full group's already-dropped "
           "length and drop again (one block lost: 0.10.0-0.13.0, and the \"simple hybrid\" of 0.16.0-0.19.1, "
           "read), and the fixed-point loop (vllm-project/vllm#31707) re-applies it on every retry pass (issue "
           "#32802's spiral, down to 0: 0.14.0-0.15.x, and hybrids of three groups or more to 0.19.1, read); "
           "fixed in 0.20.0, which looks one block further for an EAGLE group and drops at most once per "
           "candidate (eagle_verified, read; #39171 and #33270 closed unmerged, the PR that landed it not "
           "established)",
           level="cache", message=r"EAGLE"),
)


def attribute(version: str, finding: dict, policies: str) -> str:
    """The upstream change that explains ``finding`` on ``version``, or "" (then it is read as a bug).
    A policy of its time does not explain a finding of the pass that declares that policy."""
    for change in KNOWN_CHANGES:
        if not change.matches(version, finding):
            continue
        if change.policy and policies and "unhashed_free_first=false" in policies:
            continue
        return change.text
    return ""


def label(finding: dict) -> str:
    """The sweep's label of a finding: "policy" where it is matched to a policy of the
    release's time (declared in that release's second pass), "bug" otherwise (kvspec's own
    hint label, where it set one, is kept)."""
    if finding.get("label"):
        return finding["label"]
    return "policy" if "policy of its time" in (finding.get("upstream") or "") else "bug"


def annotate(version: str, result: dict, policies: str) -> None:
    """Each finding of one pass matched to its upstream change and labelled."""
    for f in result.get("violations", []) + result.get("robustness", []):
        f["upstream"] = attribute(version, f, policies)
        f["label"] = label(f)

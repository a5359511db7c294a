"""``kvspec diff --patch DIFF``: CrossHair ``diffbehavior`` on the small helpers a patch changes.

Random search (``kvspec check``) and the bounded model checker (``kvspec mc``) run
the allocator on pools of a few blocks and prompts of a few tokens. A patch that
misbehaves only on a rare input (a free count of 65536, a token id near 2**63) is
out of their reach. CrossHair explores a function symbolically instead, so for the
allocator's *pure or small-state helpers* it can find such an input directly.

How it works:

1. The patch is applied to a temporary copy of ``kvspec.impl`` through the same
   patched-import path ``kvspec check --patch`` uses
   (``kvspec.targets.patched.import_patched_copy``).
2. The functions it changes are found by comparing the ASTs of each patched file
   with the original's (docstrings ignored), so a hunk's offsets do not matter.
3. Every changed function that has a *harness* below is compared: a harness module
   is written next to the patched copy, with one function per side calling the
   original (``kvspec.impl``) or the patched copy on the same symbolic inputs and
   returning everything observable (return value, and for the free queue the walk,
   the links and the counter after each operation). Inputs are restricted to the
   helper's documented preconditions (its ``pre:`` contract), so only valid use is
   compared. ``crosshair diffbehavior`` then searches for an input where the two
   sides differ.
4. Changed functions without a harness (BlockPool and KVCacheManager methods: large
   state, covered by ``kvspec check``) are listed as skipped.

Exit codes: 1 when a difference was found, 0 when none was found within the time
limit (which is not a proof of equivalence), 2 on a usage error (unreadable or
inapplicable patch, a target other than impl).

``python -m kvspec.check.crosshair ARGS...`` runs the ``crosshair`` command line with
one work-around: CrossHair reads ``# crosshair:`` directives from every parent
package's ``__init__.py``, which fails on the namespace package ``kvspec`` of an
editable install (``NotADirectoryError`` from importlib.resources); the shim turns
that into "no directives". ``crosshair check kvspec.impl.hashing`` therefore reads
``python -m kvspec.check.crosshair check kvspec.impl.hashing``.
"""
from __future__ import annotations

import ast
import copy
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

# -- harnesses -----------------------------------------------------------------------
# Each harness is Python source with two placeholders: {M} is the package to call
# (``kvspec.impl`` or the patched alias), {S} the side ("orig" or "patched"). The
# function's parameters are what CrossHair makes symbolic; its guard keeps inputs
# inside the helper's preconditions (identical on both sides, so a guarded input
# never counts as a difference).
# Small sizes first (cheap to check, and they keep CrossHair off long symbolic
# byte strings), then the int64 range of token ids.
_INT64 = "all(-2**63 <= t < 2**63 for t in {v})"
_SMALL = "len(token_ids) <= 4 and (parent is None or len(parent) <= 8) and (extra_keys is None or len(extra_keys) <= 2)"

HARNESSES: dict[str, str] = {
    "kv_cache_manager.max_hit_blocks": '''
def {S}_max_hit_blocks(num_tokens: int, block_size: int) -> Optional[int]:
    if not (num_tokens >= 1 and block_size >= 1):
        return None
    return {M}.kv_cache_manager.max_hit_blocks(num_tokens, block_size)
''',
    "kv_cache_manager.blocks_fit": '''
def {S}_blocks_fit(num_new_blocks: int, num_revived: int, num_free: int) -> Optional[bool]:
    if not (num_new_blocks >= 0 and num_revived >= 0 and num_free >= 0):
        return None
    return {M}.kv_cache_manager.blocks_fit(num_new_blocks, num_revived, num_free)
''',
    "hashing._encode": f'''
def {{S}}__encode(parent: Optional[bytes], token_ids: list[int], extra_keys: Optional[tuple[int, ...]]) -> Optional[bytes]:
    if not ({_SMALL} and {_INT64.format(v="token_ids")}):
        return None
    return {{M}}.hashing._encode(parent or b"", token_ids, extra_keys)
''',
    "hashing._extra_bytes": '''
def {S}__extra_bytes(extra_keys: Optional[tuple[int, ...]]) -> Optional[bytes]:
    if extra_keys is not None and len(extra_keys) > 2:
        return None
    return {M}.hashing._extra_bytes(extra_keys)
''',
    "hashing._decode": '''
def {S}__decode(data: bytes):
    if len(data) > 40:
        return None
    return {M}.hashing._decode(data)
''',
    "hashing.block_hash_input": f'''
def {{S}}_block_hash_input(parent: Optional[bytes], token_ids: list[int], extra_keys: Optional[tuple[int, ...]]) -> Optional[bytes]:
    if not ({_SMALL} and {_INT64.format(v="token_ids")}):
        return None
    return {{M}}.hashing.block_hash_input(parent, token_ids, extra_keys)
''',
    # hash_fn is the identity, so the harness returns the exact bytes that are hashed:
    # any difference there is a difference in the hash (up to collisions).
    "hashing.hash_block_tokens": f'''
def {{S}}_hash_block_tokens(parent: Optional[bytes], token_ids: list[int], extra_keys: Optional[tuple[int, ...]]) -> Optional[bytes]:
    if not ({_SMALL} and {_INT64.format(v="token_ids")}):
        return None
    return {{M}}.hashing.hash_block_tokens(_identity, parent, token_ids, extra_keys)
''',
    # Token lists as scalars plus a length: CrossHair explores scalars far faster than lists.
    "hashing.hash_request_tokens": f'''
def {{S}}_hash_request_tokens(block_size: int, num_tokens: int, t0: int, t1: int, t2: int, t3: int, t4: int):
    token_ids = [t0, t1, t2, t3, t4][:num_tokens]
    if not (1 <= block_size <= 3 and 0 <= num_tokens <= 5 and {_INT64.format(v="token_ids")}):
        return None
    return {{M}}.hashing.hash_request_tokens(_identity, block_size, token_ids)
''',
    # A request's block hashes after its prompt and after each decoded token.
    "kv_cache_manager.Request": f'''
def {{S}}_Request(block_size: int, num_prompt: int, num_tokens: int, t0: int, t1: int, t2: int, t3: int, t4: int):
    tokens = [t0, t1, t2, t3, t4][:num_tokens]
    if not (1 <= block_size <= 3 and 1 <= num_prompt <= num_tokens <= 5 and {_INT64.format(v="tokens")}):
        return None
    r = {{M}}.kv_cache_manager.Request("r", tokens[:num_prompt], block_size, _identity)
    seen = [list(r.block_hashes)]
    for t in tokens[num_prompt:]:
        r.append_output_token_ids(t)
        seen.append(list(r.block_hashes))
    return seen, r.num_tokens
''',
    # The free queue: a queue of ``n`` blocks, then three operations, each one
    # applied only where its precondition holds (so both sides see only valid use).
    # The observation after each operation: what it returned, the forward walk, the
    # backward walk, the counter, and the links of the blocks it took out.
    "free_queue.FreeKVCacheBlockQueue": '''
def {S}_FreeKVCacheBlockQueue(n: int, op1: int, op2: int, op3: int):
    # op = 5 * arg + kind; kind 0 popleft, 1 popleft_n(arg), 2 remove(block arg),
    # 3 append(block arg), 4 append_n(the first arg blocks not queued). Three scalar
    # ops rather than a list: CrossHair explores scalars far faster.
    if not (0 <= n <= 5 and 0 <= op1 < 30 and 0 <= op2 < 30 and 0 <= op3 < 30):
        return None
    ops = [op1, op2, op3]
    mod = {M}.free_queue
    blocks = [{M}.block.KVCacheBlock(i) for i in range(n)]
    q = mod.FreeKVCacheBlockQueue(list(blocks))
    queued = list(range(n))
    trace = [_queue_view(q)]
    for op in ops:
        kind, arg = op % 5, op // 5
        out = None
        if kind == 0 and queued:
            out = [q.popleft()]
            queued = queued[1:]
        elif kind == 1 and arg <= len(queued):
            out = q.popleft_n(arg)
            queued = queued[arg:]
        elif kind == 2 and arg in queued:
            q.remove(blocks[arg])
            out = [blocks[arg]]
            queued = [b for b in queued if b != arg]
        elif kind == 3 and arg < n and arg not in queued:
            q.append(blocks[arg])
            queued = queued + [arg]
        elif kind == 4:
            add = [b for b in range(n) if b not in queued][:arg]
            q.append_n([blocks[b] for b in add])
            queued = queued + add
        else:
            continue
        trace.append((op, [(b.block_id, b.prev_free_block is None, b.next_free_block is None) for b in out or []],
                      _queue_view(q)))
    return trace
''',
}

_PRELUDE = '''\
"""Generated by kvspec diff: the two sides CrossHair compares (see kvspec.check.crosshair)."""
from typing import Optional

import kvspec.impl
import {ALIAS}


def _identity(data: bytes) -> bytes:
    return data


def _queue_view(q):
    fwd, cur, guard = [], q.head.next_free_block, 0
    while cur is not None and cur is not q.tail and guard < 64:
        fwd.append(cur.block_id)
        cur, guard = cur.next_free_block, guard + 1
    back, cur, guard = [], q.tail.prev_free_block, 0
    while cur is not None and cur is not q.head and guard < 64:
        back.append(cur.block_id)
        cur, guard = cur.prev_free_block, guard + 1
    return fwd, back[::-1], q.num_free_blocks
'''

# The helpers each module-level name or class belongs to (a changed method of a
# class maps to the class's harness).
def _harness_key(module: str, qualname: str) -> Optional[str]:
    for key in (f"{module}.{qualname}", f"{module}.{qualname.split('.')[0]}"):
        if key in HARNESSES:
            return key
    return None


# -- finding what a patch changes --------------------------------------------------------
def _strip_doc(body: list[ast.stmt]) -> list[ast.stmt]:
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        return body[1:]
    return body


def _functions(source: str) -> dict[str, str]:
    """qualname -> normalized AST dump, for every function and method (nested classes too)."""
    out: dict[str, str] = {}

    def walk(nodes, prefix: str) -> None:
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + node.name
                clone = copy.copy(node)
                clone.body = _strip_doc(node.body)
                out[name] = ast.dump(clone, include_attributes=False)
                walk(node.body, name + ".")
            elif isinstance(node, ast.ClassDef):
                walk(node.body, prefix + node.name + ".")

    walk(ast.parse(source).body, "")
    return out


def changed_functions(original: str, patched: str) -> list[str]:
    """Qualified names of the functions the patch adds, removes or changes (docstrings ignored)."""
    a, b = _functions(original), _functions(patched)
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


# -- running CrossHair -----------------------------------------------------------------
@dataclass
class Comparison:
    function: str                  # module.qualname the patch changed
    harness: Optional[str]         # the harness compared, or None (skipped)
    verdict: str                   # "different", "no difference found", "skipped", "error"
    differences: list[str] = field(default_factory=list)  # CrossHair's "Given ..." lines
    seconds: float = 0.0
    detail: str = ""


def crosshair_command() -> list[str]:
    """The ``crosshair`` command line, run through this module's shim (see the module doc)."""
    return [sys.executable, "-m", "kvspec.check.crosshair"]


def _run_diffbehavior(harness_mod: str, key: str, env: dict, per_condition_timeout: float,
                      hard_timeout: float) -> Comparison:
    name = key.rsplit(".", 1)[1]
    cmd = crosshair_command() + ["diffbehavior", f"--per_condition_timeout={per_condition_timeout:g}",
                                 "--exception_equivalence=SAME_TYPE",
                                 f"{harness_mod}.orig_{name}", f"{harness_mod}.patched_{name}"]
    t0 = time.monotonic()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=hard_timeout)
    except subprocess.TimeoutExpired:
        return Comparison(key, key, "no difference found", seconds=time.monotonic() - t0,
                          detail=f"stopped at the hard limit of {hard_timeout:g}s")
    secs = time.monotonic() - t0
    text = (r.stdout or "") + (r.stderr or "")
    diffs = _differences(r.stdout or "")
    if diffs:
        return Comparison(key, key, "different", diffs, secs)
    if r.returncode == 0:
        return Comparison(key, key, "no difference found", seconds=secs)
    return Comparison(key, key, "error", seconds=secs, detail=text.strip().splitlines()[-1][:300] if text.strip() else f"exit {r.returncode}")


def _differences(stdout: str) -> list[str]:
    """CrossHair prints one block per differing input: 'Given: (...),' then what each side did."""
    blocks, cur = [], []
    for line in stdout.splitlines():
        if line.startswith("Given: ") and cur:
            blocks.append(" ".join(cur))
            cur = []
        if line.strip():
            cur.append(line.strip())
    if cur:
        blocks.append(" ".join(cur))
    return [re.sub(r"\s+", " ", b) for b in blocks if b.startswith("Given: ")]


def diff_patch(patch_path: str, per_condition_timeout: float = 10.0) -> dict:
    """Run the comparison for one impl patch; returns the JSON object of ``kvspec diff``."""
    from kvspec.patching import apply_unified_diff, parse_unified_diff, read_inside
    from kvspec.targets.impl_target import ImplTarget
    from kvspec.targets.patched import _tmp_dir, import_patched_copy, read_patch

    start = time.monotonic()
    text = read_patch(patch_path)
    pkg = ImplTarget.package_dir()

    def read(rel: str) -> str:  # paths validated by parse_unified_diff; never through a link out of impl
        if not rel.startswith("impl/"):
            raise FileNotFoundError(rel)
        return read_inside(pkg, rel[len("impl/"):])

    files = parse_unified_diff(text)
    patched_texts = apply_unified_diff(text, read)  # PatchError names file and hunk
    alias_mod = import_patched_copy(pkg, "impl", text, "impl")
    alias = alias_mod.__name__

    comparisons: list[Comparison] = []
    keys: list[tuple[str, str]] = []  # (changed function, harness key)
    for fp in files:
        rel = fp.path
        module = Path(rel[len("impl/"):]).with_suffix("").as_posix().replace("/", ".")
        original = read(rel) if not fp.new_file else ""
        for q in changed_functions(original, patched_texts[rel]):
            key = _harness_key(module, q)
            if key is None:
                comparisons.append(Comparison(f"{module}.{q}", None, "skipped",
                                              detail="not a pure or small-state helper: kvspec check covers it"))
            else:
                keys.append((f"{module}.{q}", key))

    todo = sorted({k for _, k in keys})
    results: dict[str, Comparison] = {}
    if todo:
        tmp = _tmp_dir()
        hname = f"_kvspec_diffharness_{hashlib.sha1(text.encode()).hexdigest()[:10]}"
        src = [_PRELUDE.replace("{ALIAS}", alias)]
        for key in todo:
            for side, mod in (("orig", "kvspec.impl"), ("patched", alias)):
                src.append(HARNESSES[key].replace("{S}", side).replace("{M}", mod))
        (tmp / f"{hname}.py").write_text("\n".join(src))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(tmp)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        # NONE_HASH is derived from PYTHONHASHSEED when it is set: then both sides agree on it
        env.setdefault("PYTHONHASHSEED", "0")
        for key in todo:
            results[key] = _run_diffbehavior(hname, key, env, per_condition_timeout,
                                             hard_timeout=per_condition_timeout * 4 + 60)
    for fn, key in keys:
        c = results[key]
        comparisons.append(Comparison(fn, key, c.verdict, c.differences, c.seconds, c.detail))

    compared = [c for c in comparisons if c.harness]
    verdict = ("different" if any(c.verdict == "different" for c in compared)
               else "error" if any(c.verdict == "error" for c in compared)
               else "no difference found" if compared else "nothing to compare")
    return {
        "patch": patch_path, "target": "impl", "verdict": verdict,
        "per_condition_timeout": per_condition_timeout,
        "functions": [asdict(c) | {"seconds": round(c.seconds, 2)} for c in comparisons],
        "differences": [d for c in compared for d in c.differences],
        "seconds": round(time.monotonic() - start, 2),
    }


def _text(res: dict) -> str:
    lines = [f"kvspec diff {res['patch']}: {res['verdict']}"]
    for c in res["functions"]:
        what = f"  {c['function']}: {c['verdict']}"
        if c["harness"] and c["harness"] != c["function"]:
            what += f" (compared through {c['harness']})"
        if c["detail"]:
            what += f" - {c['detail']}"
        lines.append(what)
        for d in c["differences"][:3]:
            lines.append(f"    {d}")
    if res["verdict"] == "no difference found":
        lines.append(f"  (CrossHair found no differing input within {res['per_condition_timeout']:g}s per function: "
                     f"not a proof of equivalence)")
    return "\n".join(lines)


def cmd_diff(args) -> int:
    from kvspec.errors import UsageError
    from kvspec.patching import PatchError

    if args.target != "impl":
        raise UsageError(f"kvspec diff: --target {args.target} is not supported; kvspec diff compares impl's helpers "
                         f"(use kvspec check for other targets)")
    if args.per_condition_timeout <= 0:
        raise UsageError("kvspec diff: --per-condition-timeout must be positive")
    try:
        res = diff_patch(args.patch, args.per_condition_timeout)
    except PatchError as e:
        raise UsageError(f"kvspec diff: patch {args.patch}: {e}") from None
    if args.json:
        print(json.dumps(res))
    else:
        print(_text(res))
    if res["verdict"] == "different":
        return 1
    if res["verdict"] == "error":
        raise UsageError(f"kvspec diff: crosshair failed: "
                         f"{next(c['detail'] for c in res['functions'] if c['verdict'] == 'error')}")
    return 0


# -- the crosshair shim (python -m kvspec.check.crosshair ARGS) ---------------------------
def crosshair_main(argv: Optional[list[str]] = None) -> int:
    import importlib.resources as resources

    files = resources.files

    def _files(package):
        try:
            return files(package)
        except NotADirectoryError:  # a namespace package of an editable install
            raise FileNotFoundError(str(package)) from None

    resources.files = _files
    from crosshair.main import main

    sys.argv = ["crosshair"] + list(sys.argv[1:] if argv is None else argv)
    try:
        main()
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else 1
    return 0


if __name__ == "__main__":
    sys.exit(crosshair_main())

"""Resolve a ``--target`` string (and ``--patch``) into a Target.

    impl                  kvspec's own allocator (default)
    vllm                  the installed vllm package's v1 BlockPool / KVCacheManager
    nanovllm[:PACKAGE]    a nano-vllm-style BlockManager (PACKAGE defaults to nanovllm)
    sglang                sglang's paged KV allocator (pool) and RadixCache (cache)
    lmcache               LMCache's paged memory allocator (pool)
    FILE.py:NAME          a user's class in a file
    module:NAME           a user's class in an importable module

``api`` (``--api``: nanovllm, kvcachemanager or blockpool) names a user target's API
instead of detecting it (see ``user_target``); the fixed targets refuse any other.

Every failure raises ``TargetError`` with one line fit for the terminal.
"""
from __future__ import annotations

from typing import Optional

from kvspec.patching import PatchError
from kvspec.targets.base import Target, TargetError
from kvspec.targets.patched import import_patched_copy, read_patch
from kvspec.targets.target_output import stdout_to_stderr


def load_target(spec: str = "impl", patch: Optional[str] = None, api: Optional[str] = None) -> Target:
    # Loading imports the target's package: what it prints then, and where its loggers are
    # bound (vLLM's StreamHandler takes ``sys.stdout`` as it is at its first import), must
    # land on stderr, never in a ``--json`` stdout.
    try:
        with stdout_to_stderr():
            return _load(spec, patch, api)
    except TargetError:
        raise
    except PatchError as e:
        raise TargetError(f"patch {patch}: {e}") from None
    except SyntaxError as e:
        raise TargetError(f"target {spec}: syntax error in {e.filename}:{e.lineno}: {e.msg}") from None
    except ImportError as e:
        raise TargetError(f"target {spec}: cannot import: {e}") from None


FIXED_API_TARGETS = ("impl", "vllm", "sglang", "lmcache")  # their own APIs, one per level


def _load(spec: str, patch: Optional[str], api: Optional[str]) -> Target:
    if api is not None:
        if spec in FIXED_API_TARGETS:
            raise TargetError(f"--api is for user targets (FILE.py:NAME, module:NAME): target {spec} has a fixed API")
        if (spec == "nanovllm" or spec.startswith("nanovllm:")) and api != "nanovllm":
            raise TargetError(f"--api {api}: target {spec} is a nano-vllm BlockManager (--api nanovllm)")
    if patch and spec in ("sglang", "lmcache"):
        try:
            read_patch(patch)   # a hostile diff is refused as for every target
        except (PatchError, TargetError) as e:
            if "refused" in str(e):
                raise
        raise TargetError(f"target {spec}: --patch is not supported for this target")
    diff = read_patch(patch) if patch else None
    if spec == "impl":
        from kvspec.targets.impl_target import ImplTarget
        if diff is None:
            return ImplTarget()
        mod = import_patched_copy(ImplTarget.package_dir(), "impl", diff, "impl")
        return ImplTarget(mod, label=f"impl+{patch}")
    if spec == "vllm":
        try:
            from kvspec.vllm.target import VllmTarget
        except ImportError as e:
            raise TargetError(f"target vllm: cannot import the vllm adapter: {e}") from None
        return VllmTarget(patch_text=diff, patch_name=patch)
    if spec in ("sglang", "lmcache"):
        if diff is not None:
            raise TargetError(f"target {spec}: --patch is not supported for this target")
        if spec == "sglang":
            from kvspec.targets.sglang_target import SglangTarget
            return SglangTarget()
        from kvspec.targets.lmcache_target import LMCacheTarget
        return LMCacheTarget()
    if spec == "nanovllm" or spec.startswith("nanovllm:"):
        try:
            from kvspec.targets.nanovllm_target import NanoVllmTarget
        except ImportError as e:
            raise TargetError(f"target {spec}: cannot import the nano-vllm adapter: {e}") from None
        package = spec.split(":", 1)[1] if ":" in spec else "nanovllm"
        t = NanoVllmTarget(package, patch_text=diff, patch_name=patch)
        t.patch_text = diff  # the engine level loads the package's scheduler under the same diff
        return t
    if ":" in spec:
        try:
            from kvspec.targets.user_target import load_user_target
        except ImportError as e:
            raise TargetError(f"target {spec}: cannot import the user-class adapter: {e}") from None
        return load_user_target(spec, api=api, patch_text=diff, patch_name=patch)
    raise TargetError(f"unknown target {spec!r}: use impl, vllm, sglang, lmcache, nanovllm[:PACKAGE], FILE.py:NAME or module:NAME")

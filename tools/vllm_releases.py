"""Maintainer tool: run kvspec's ``vllm`` target against every vLLM release that has
``vllm/v1/core/block_pool.py`` and write ``reports/vllm-releases.md`` (+ ``.json``).

    python tools/vllm_releases.py [--releases 0.8.0,0.20.0,...] [--max-examples 200]
                                  [--cache DIR] [--jobs 1] [--skip-fetch]

For each release, its wheel is downloaded with ``pip download --no-deps`` (into a
temporary directory, deleted afterwards) and only the ``vllm/`` package's non-binary
files are extracted into ``DIR/X/vllm`` (default ``~/.cache/kvspec/vllm-releases``):
never into site-packages, never into the repository. No CUDA code is needed: kvspec
drives the allocator on CPU. Then ``kvspec check --target vllm --level all --json``
runs in a subprocess whose ``PYTHONPATH`` starts with that tree, so it shadows the
installed vLLM, and the verdicts go into one row per release.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("KVSPEC_VLLM_RELEASES", Path.home() / ".cache" / "kvspec" / "vllm-releases"))
MARK = "vllm/v1/core/block_pool.py"
BINARY = re.compile(r"\.(so(\.\d+)*|pyd|dll|dylib|cubin|fatbin|a)$")


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


def pypi_versions() -> list[str]:
    """All vllm versions pip can see, oldest first (final releases only)."""
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "vllm"],
                         capture_output=True, text=True, check=True).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("Available versions:"))
    vs = [v.strip() for v in line.split(":", 1)[1].split(",")]
    return sorted((v for v in vs if re.fullmatch(r"[\d.]+(post\d+)?", v)), key=version_key)


def tree(version: str, cache: Path = CACHE) -> Path:
    """The directory that goes first on PYTHONPATH for ``version`` (it holds ``vllm/``)."""
    return cache / version


def fetch(version: str, cache: Path = CACHE) -> Optional[str]:
    """Extract ``version``'s ``vllm/`` sources into the cache. Returns None when they are
    there, or the reason they cannot be (no wheel, no block_pool.py)."""
    dest = tree(version, cache)
    if (dest / ".complete").exists():
        return None if (dest / MARK).exists() else f"no {MARK} in the wheel"
    with tempfile.TemporaryDirectory(prefix="kvspec-vllm-wheel-") as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"vllm=={version}",
                            "-d", tmp], capture_output=True, text=True)
        wheels = list(Path(tmp).glob("vllm-*.whl"))
        if r.returncode or not wheels:
            err = (r.stderr.strip().splitlines() or ["no wheel"])[-1]
            return f"pip download found no wheel: {err}"
        part = dest.with_name(dest.name + ".partial")
        shutil.rmtree(part, ignore_errors=True)
        with zipfile.ZipFile(wheels[0]) as z:
            for info in z.infolist():
                n = info.filename
                if n.startswith("vllm/") and not n.endswith("/") and not BINARY.search(n):
                    z.extract(info, part)
        (part / ".complete").write_text(wheels[0].name + "\n")
        shutil.rmtree(dest, ignore_errors=True)
        part.rename(dest)
    return None if (dest / MARK).exists() else f"no {MARK} in the wheel"

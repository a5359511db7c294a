"""``kvspec campaign``: the matrix, the one-line errors, and a tiny matrix on a local
Ray (two CPUs) whose verdicts and findings equal a one-process run, then a rerun that
skips the finished jobs. The two-node cluster with a node killed mid-run is in
test_campaign_cluster.py (slow)."""
from __future__ import annotations

import contextlib
import io
import json
import os
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kvspec.campaign.findings import dedup
from kvspec.campaign.matrix import load_campaign
from kvspec.cli import main
from kvspec.errors import UsageError

TINY = """
[campaign]
name = "tiny"

[[matrix]]
command = "check"
target = "impl"
patch = ["corpus:impl/no_evict.diff", ""]
level = "pool"
seed = 0
max_examples = 20

[[matrix]]
command = "mc"
patch = "corpus:impl/no_evict.diff"
blocks = 3
depth = 4
"""


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def write(tmp_path: Path, text: str, name: str = "c.toml") -> Path:
    f = tmp_path / name
    f.write_text(text)
    return f


# -- the matrix, no Ray ------------------------------------------------------------------
def test_axes_multiply_and_ids_are_stable(tmp_path, monkeypatch):
    f = write(tmp_path, """
[[matrix]]
command = "check"
target = "impl"
level = ["pool", "cache"]
seed = [0, 1, 2]
max_examples = 5
misuse = [false, true]
""")
    jobs = load_campaign(f).jobs
    assert len(jobs) == 2 * 3 * 2 and len({j.id for j in jobs}) == 12
    monkeypatch.chdir(tmp_path.parent)  # another working directory: the same ids
    assert [j.id for j in load_campaign(f).jobs] == [j.id for j in jobs]
    misuse = [j for j in jobs if j.options["misuse"] is True][0].argv()
    assert "--misuse" in misuse and "--max-examples" in misuse
    assert "--misuse" not in [j for j in jobs if j.options["misuse"] is False][0].argv()


def test_release_fills_pythonpath_and_env_axes(tmp_path):
    f = write(tmp_path, """
[[matrix]]
command = "check"
target = "vllm"
max_examples = 5
release = ["0.20.0", "0.33.0"]
pythonpath = ["/cache/{release}", "/cache/_deps"]
env = { KVSPEC_VLLM_POLICIES = ["", "unhashed_free_first=false"] }
""")
    jobs = load_campaign(f).jobs
    assert len(jobs) == 4
    assert {j.pythonpath[0] for j in jobs} == {"/cache/0.20.0", "/cache/0.33.0"}
    assert {j.env["KVSPEC_VLLM_POLICIES"] for j in jobs} == {"", "unhashed_free_first=false"}


def test_budget_jobs_share_the_campaign_example_database(tmp_path):
    f = write(tmp_path, """
[campaign]
db = "shared-db"

[[matrix]]
command = "check"
budget = 5
seed = [0, 1]

[[matrix]]
command = "check"
max_examples = 5
""")
    budget, counted = [j.argv() for j in load_campaign(f).jobs if "--budget" in j.argv()], \
        [j.argv() for j in load_campaign(f).jobs if "--max-examples" in j.argv()]
    assert len(budget) == 2 and all(a[a.index("--db") + 1] == str(Path.cwd() / "shared-db") for a in budget)
    assert counted and all("--db" not in a for a in counted)  # check refuses --db with --max-examples


def test_only_each_makes_one_job_per_patch(tmp_path):
    f = write(tmp_path, '[[matrix]]\ncommand = "patches"\ntarget = "impl"\nonly = "each"\nseeds = 1\ntimeout = 5\n')
    corpus = json.loads((Path(__file__).resolve().parents[1] / "kvspec/corpus/impl/bugs.json").read_text())
    assert sorted(j.options["only"] for j in load_campaign(f).jobs) == sorted(b["id"] for b in corpus)


def _corpus(target: str) -> list[dict]:
    return json.loads((Path(__file__).resolve().parents[1] / f"kvspec/corpus/{target}/bugs.json").read_text())


def _slow(target: str) -> set[str]:
    return {b["id"] for b in _corpus(target) if b.get("kind") == "equivalent" or b.get("engine") == "diff"}


def _trials(jobs) -> list[tuple[str, int]]:
    """(patch, seed) of every trial the jobs run, as kvspec patches reads --only/--first-seed/--seeds."""
    return sorted((i, j.options.get("first_seed", 0) + k) for j in jobs for i in j.options["only"].split(",")
                  for k in range(j.options["seeds"]))


def test_per_job_groups_the_patches_and_keeps_every_one_once(tmp_path):
    f = write(tmp_path, '[[matrix]]\ncommand = "patches"\ntarget = "impl"\nonly = "each"\nper_job = 4\nseeds = 1\n'
                        'timeout = 5\n')
    corpus, slow = _corpus("impl"), _slow("impl")
    assert slow, "the impl corpus has no slow patch: this test no longer tests the split"
    groups = [j.options["only"].split(",") for j in load_campaign(f).jobs]
    assert len(groups) == len(slow) + -(-(len(corpus) - len(slow)) // 4) and all(len(g) <= 4 for g in groups)
    assert sorted(i for g in groups for i in g) == sorted(b["id"] for b in corpus)


@pytest.mark.parametrize("target", ["impl", "nanovllm"])
def test_a_slow_patch_is_a_job_per_seed_and_every_trial_runs_once(tmp_path, target):
    """An equivalent mutant runs every seed to the timeout: as one job it would bound the
    campaign's wall time, so its seeds are jobs of their own; the quick patches keep one
    job for all seeds. The queue is longest first by the published trial times."""
    from kvspec.campaign.matrix import _mean_trial_seconds

    f = write(tmp_path, f'[[matrix]]\ncommand = "patches"\ntarget = "{target}"\nonly = "each"\nseeds = 4\n'
                        'timeout = 5\n')
    jobs, slow = load_campaign(f).jobs, _slow(target)
    assert _trials(jobs) == sorted((b["id"], k) for b in _corpus(target) for k in range(4))
    for j in jobs:
        assert j.options["seeds"] == (1 if j.options["only"] in slow else 4)
        assert j.argv()[j.argv().index("--seeds") + 1] == str(j.options["seeds"])
    published = _mean_trial_seconds(target)
    est = [published.get(j.options["only"], 60.0 if j.options["only"] in slow else 0.0) * j.options["seeds"]
           for j in jobs]
    assert est == sorted(est, reverse=True) and max(est) > 0
    assert len({j.id for j in jobs}) == len(jobs)


def test_seeds_per_job_splits_every_patch_in_ranges(tmp_path):
    f = write(tmp_path, '[[matrix]]\ncommand = "patches"\ntarget = "nanovllm"\nonly = "each"\nseeds = 7\n'
                        'seeds_per_job = 3\ntimeout = 5\n')
    jobs = load_campaign(f).jobs
    assert _trials(jobs) == sorted((b["id"], k) for b in _corpus("nanovllm") for k in range(7))
    assert {(j.options.get("first_seed", 0), j.options["seeds"]) for j in jobs} == {(0, 3), (3, 3), (6, 1)}


def test_a_patch_split_by_seed_merges_into_the_report_of_one_run(tmp_path):
    """Two seed ranges of a patch as two jobs give the trials, seeds count and verdict of
    one kvspec patches run over both seeds (fresh processes; the patch is found at once)."""
    from kvspec.campaign.matrix import Job
    from kvspec.campaign.patches import merged
    from kvspec.campaign.runner import run_serial

    base = {"target": "nanovllm", "only": "hit_no_ref", "timeout": 30}
    parts = run_serial([Job("a", "patches", {**base, "seeds": 1}),
                        Job("b", "patches", {**base, "seeds": 1, "first_seed": 1})], timeout=300)
    whole = run_serial([Job("w", "patches", {**base, "seeds": 2})], timeout=300)
    assert all(r["verdict"] == "pass" for r in parts + whole), [r.get("error") for r in parts + whole]
    assert [t["seed"] for t in parts[1]["result"]["trials"]] == [1]
    got, want = merged(parts, "c", 2, 1.0), merged(whole, "c", 2, 1.0)
    assert len(got) == len(want) == 1

    def shape(res):
        return (res["seeds"], res["verdict"], res["section"],
                [(t["id"], t["seed"], t["killed"], t.get("invariant")) for t in res["trials"]])
    assert shape(got[0]) == shape(want[0]) and got[0]["seeds"] == 2


def test_a_seed_range_without_kvspec_diff_leaves_a_rare_input_patch_to_the_range_from_0(tmp_path):
    """On impl, kvspec diff runs once per patch, in the seed range from 0. Another range
    of a rare-input patch (one only diff finds) passed before as fail (a campaign that split
    it exited 1 where kvspec patches exits 0); it now says the diff is the other range's,
    and the merge judges the patch by the range-0 diff, failing it when that range is missing."""
    import copy

    from kvspec.campaign.matrix import Job
    from kvspec.campaign.patches import merged
    from kvspec.campaign.runner import run_serial
    from kvspec.corpus.stats import DIFF_DEFERRED

    base = {"target": "impl", "only": "huge_pool_fast_path", "timeout": 2}
    rng = run_serial([Job("b", "patches", {**base, "seeds": 1, "first_seed": 1})], timeout=300)[0]
    assert rng["verdict"] == "pass" and rng["exit_code"] == 0, rng.get("error")
    row = rng["result"]["patches"][0]
    assert row["diff"] == {"verdict": DIFF_DEFERRED} and [t["seed"] for t in rng["result"]["trials"]] == [1]
    # the range from 0, as a run that diff caught would report it (built from the real range's record)
    zero = copy.deepcopy(rng)
    zero["id"], zero["result"]["trials"][0]["seed"] = "a", 0
    zero["result"]["patches"][0]["diff"] = {"verdict": "different", "seconds": 1.0}
    both = merged([rng, zero], "c", 2, 1.0)[0]
    assert both["verdict"] == "pass" and both["seeds"] == 2
    assert both["patches"][0]["diff"]["verdict"] == "different" and "diff" in both["patches"][0]["caught_by"]
    alone = merged([rng], "c", 1, 1.0)[0]  # the range from 0 lost: nothing judged the patch
    assert alone["patches"][0]["diff"] is None
    assert alone["verdict"] == ("pass" if alone["patches"][0]["kills"] else "fail")


@pytest.mark.parametrize("text, says", [
    ("[[matrix]]\ncommand = 'patches'\nper_job = 2\n", "per_job goes with only"),
    ("[[matrix]]\ncommand = 'patches'\nonly = 'each'\nper_job = 0\n", "per_job must be"),
    ("[[matrix]]\ncommand = 'patches'\nseeds_per_job = 2\n", "seeds_per_job goes with only"),
    ("[[matrix]]\ncommand = 'patches'\nonly = 'each'\nseeds_per_job = 0\n", "seeds_per_job must be"),
    ("[[matrix]]\ncommand = 'patches'\nonly = 'each'\nseeds_per_job = 2\nper_job = 2\n", "do not go together"),
    ("[[matrix]]\ncommand = 'patches'\nonly = 'each'\nfirst_seed = 2\n", "first_seed does not go"),
    ("[[matrix]]\ncommand = 'patches'\nonly = 'each'\nseeds = 0\n", "seeds must be"),
    ("not = [toml", "not valid TOML"),
    ("[campaign]\nname = 'x'\n", "no [[matrix]]"),
    ("[[matrix]]\ncommand = 'fuzz'\n", "command must be one of"),
    ("[[matrix]]\ncommand = 'check'\nmax_examples = 5\nblocks = 3\n", "check has no option 'blocks'"),
    ("[[matrix]]\ncommand = 'check'\nseed = [0, 1]\n", "needs max_examples"),
    ("[[matrix]]\ncommand = 'check'\nmax_examples = []\n", "empty list"),
    ("[campaign]\nretries = -1\n[[matrix]]\ncommand = 'mc'\n", "retries"),
    ("[campaign]\nwarm = 'yes'\n[[matrix]]\ncommand = 'mc'\n", "warm must be true or false"),
])
def test_a_bad_file_is_one_line_and_exit_2(tmp_path, text, says):
    f = write(tmp_path, text)
    with pytest.raises(UsageError, match="kvspec campaign"):
        load_campaign(f)
    rc, out, err = run(["campaign", str(f), "--results", str(tmp_path / "r"), "--json"])
    assert rc == 2 and says in err and len(err.strip().splitlines()) == 1, err
    assert json.loads(out)["verdict"] == "error"


def test_without_ray_one_line_says_how_to_install(tmp_path, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    rc, out, err = run(["campaign", str(write(tmp_path, TINY))])
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "pip install 'ray==2.60.0'" in err, err


def test_an_address_nobody_answers_is_one_line_and_exit_2(tmp_path):
    # before the local Ray below starts: a Ray already running in this process would be used instead
    rc, out, err = run(["campaign", str(write(tmp_path, TINY)), "--address", "127.0.0.1:1",
                        "--results", str(tmp_path / "r"), "--json"])
    assert rc == 2 and "no Ray cluster answers at 127.0.0.1:1" in err.strip().splitlines()[-1], err
    assert json.loads(out)["verdict"] == "error"


def test_findings_dedup_by_invariant_and_steps():
    v = lambda steps: {"invariant": "I4", "message": "m", "steps_text": steps, "minimal": True}
    recs = [{"id": "a", "command": "check", "result": {"violations": [v(["Alloc(n=1)", "Free"])]}},
            {"id": "b", "command": "check", "result": {"violations": [v(["Alloc(n=1)", "Free"])]}},
            {"id": "c", "command": "check", "result": {"violations": [v(["Alloc(n=2)"])]}}]
    got = dedup(recs)
    assert [(f["count"], f["jobs"]) for f in got] == [(1, ["c"]), (2, ["a", "b"])]


# -- warm jobs: forks of a long-lived kvspec process, no Ray ------------------------------
def _children(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (Linux /proc)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(x) for x in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except OSError:
            kids = []
        out += kids
        todo += kids
    return out


@pytest.fixture
def warm_client():
    from kvspec.campaign import warm
    from kvspec.campaign.runner import _env
    from kvspec.campaign.matrix import Job

    c = warm.WarmClient(_env(Job("x", "check", {})))
    saved, warm._client = warm._client, c
    try:
        yield c
    finally:
        warm._client = saved
        c.close()


def test_a_warm_job_gives_the_fresh_process_verdict_and_the_server_is_reused(tmp_path, warm_client):
    from kvspec.campaign.runner import run_job

    jobs = load_campaign(write(tmp_path, TINY)).jobs
    fresh = [run_job(j.to_dict(), 300, warm=False) for j in jobs]
    warm = [run_job(j.to_dict(), 300, warm=True) for j in jobs]
    assert [r["runner"] for r in fresh] == ["process"] * 3 and [r["runner"] for r in warm] == ["warm"] * 3
    assert _by_id(warm) == _by_id(fresh) and {v for v, _ in _by_id(warm).values()} == {"pass", "violation"}
    assert [r["exit_code"] for r in warm] == [r["exit_code"] for r in fresh]
    assert [sorted(r["repros"]) for r in warm] == [sorted(r["repros"]) for r in fresh]
    assert warm_client.started == 1 and len({r["pid"] for r in warm}) == 1  # one server, every job forked from it


def test_a_warm_job_searches_as_a_fresh_process_does(warm_client):
    """The warm server has kvspec's checkers imported before the job forks (warm.JOB_MODULES)
    and the search still draws what a fresh process draws: when Hypothesis mixed loaded
    modules' constants into its draws, importing kvspec.mc.search first made this check
    pass at 180 examples where a fresh process found I3 at example 62.

    The draws are compared on a clean run, by the steps they made: every op of every
    example counts, so any change of draws shows, and no finding's minimization (three
    minutes of the suite's time when this test used a patched target) is paid for."""
    from kvspec.campaign.warm import JOB_MODULES
    assert "kvspec.mc.search" in JOB_MODULES  # the import that once changed the draws
    from kvspec.campaign.matrix import Job
    from kvspec.campaign.runner import run_job

    job = Job("order", "check", {"target": "impl", "seed": 1, "max_examples": 180})
    fresh, warm = run_job(job.to_dict(), 300, warm=False), run_job(job.to_dict(), 300, warm=True)
    assert warm["runner"] == "warm" and fresh["verdict"] == warm["verdict"] == "pass"
    assert fresh["result"]["steps"] > 1000   # the draws made work to compare
    assert (warm["result"]["examples"], warm["result"]["steps"]) == (fresh["result"]["examples"], fresh["result"]["steps"])


def test_a_job_with_its_own_environment_is_a_fresh_process(tmp_path, warm_client):
    from kvspec.campaign.runner import run_job
    from kvspec.campaign.matrix import Job

    job = Job("env-job", "check", {"target": "impl", "level": "pool", "seed": 0, "max_examples": 5},
              env={"KVSPEC_X": "1"})
    r = run_job(job.to_dict(), 300, warm=True)
    assert r["runner"] == "process" and r["verdict"] == "pass" and warm_client.started == 0


def test_a_warm_job_past_its_limit_is_killed_with_its_workers_and_the_server_goes_on(warm_client):
    from kvspec.campaign.runner import run_job
    from kvspec.campaign.matrix import Job

    # popleft_loop is the impl corpus's equivalent mutant: every trial runs to --timeout
    hung = Job("hung", "patches", {"target": "impl", "only": "popleft_loop", "seeds": 2, "timeout": 60})
    r = run_job(hung.to_dict(), 3, warm=True)
    assert r["runner"] == "warm" and r["exit_code"] == 124 and r["verdict"] == "error"
    assert "job killed after its 3 s job_timeout" in r["error"]
    server = warm_client.proc
    assert server.poll() is None and _children(server.pid) == []  # the job and its trial worker are gone
    ok = Job("ok", "check", {"target": "impl", "level": "pool", "seed": 0, "max_examples": 5})
    assert run_job(ok.to_dict(), 300, warm=True)["verdict"] == "pass" and warm_client.started == 1


# -- the node server: one per node, several jobs at once over a Unix socket -----------------
@pytest.fixture
def node_server():
    from kvspec.campaign.warm import NodeServer

    s = NodeServer(dict(os.environ))
    assert s.ready(), "the node server did not start listening"
    try:
        yield s
    finally:
        s.close()


def test_the_node_server_runs_jobs_at_once_with_the_fresh_process_verdicts(tmp_path, node_server):
    from concurrent.futures import ThreadPoolExecutor

    from kvspec.campaign.runner import run_job

    jobs = load_campaign(write(tmp_path, TINY)).jobs
    with ThreadPoolExecutor(len(jobs)) as pool:  # every job's connection open at once
        node = list(pool.map(lambda j: run_job(j.to_dict(), 300, True, node_server.path), jobs))
    fresh = [run_job(j.to_dict(), 300, warm=False) for j in jobs]
    assert [r["runner"] for r in node] == ["warm-node"] * len(jobs)
    assert _by_id(node) == _by_id(fresh) and [r["exit_code"] for r in node] == [r["exit_code"] for r in fresh]
    assert [sorted(r["repros"]) for r in node] == [sorted(r["repros"]) for r in fresh]
    assert node_server.proc.poll() is None and _children(node_server.proc.pid) == []  # every job reaped


def test_a_node_job_past_its_limit_or_left_by_its_client_is_killed_and_the_server_goes_on(node_server):
    import socket
    import tempfile

    from kvspec.campaign.matrix import Job
    from kvspec.campaign.runner import run_job

    hung = Job("hung", "patches", {"target": "impl", "only": "popleft_loop", "seeds": 2, "timeout": 60})
    r = run_job(hung.to_dict(), 3, True, node_server.path)
    assert r["runner"] == "warm-node" and r["exit_code"] == 124 and "job killed after its 3 s job_timeout" in r["error"]
    assert _children(node_server.proc.pid) == []
    # a client that goes away (its Ray worker killed): the server kills that job
    with tempfile.TemporaryDirectory() as cwd:
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect(node_server.path)
        c.sendall((json.dumps({"argv": ["patches", "--target", "impl", "--only", "popleft_loop", "--seeds", "1",
                                        "--timeout", "60", "--jobs", "1", "--json"], "cwd": cwd, "timeout": 300,
                               "target": "impl"}) + "\n").encode())
        for _ in range(200):  # until the job runs
            if _children(node_server.proc.pid):
                break
            time.sleep(0.05)
        assert _children(node_server.proc.pid), "the job never started"
        c.close()
        for _ in range(200):
            if not _children(node_server.proc.pid):
                break
            time.sleep(0.05)
        assert _children(node_server.proc.pid) == []
    ok = Job("ok", "check", {"target": "impl", "level": "pool", "seed": 0, "max_examples": 5})
    assert run_job(ok.to_dict(), 300, True, node_server.path)["verdict"] == "pass"


def test_without_its_node_server_a_job_runs_in_the_workers_own(warm_client, tmp_path):
    from kvspec.campaign.matrix import Job
    from kvspec.campaign.runner import run_job

    ok = Job("ok", "check", {"target": "impl", "level": "pool", "seed": 0, "max_examples": 5})
    r = run_job(ok.to_dict(), 300, True, str(tmp_path / "no-such-socket"))
    assert r["runner"] == "warm" and r["verdict"] == "pass" and warm_client.started == 1


def test_a_server_that_dies_is_replaced_for_the_next_job(warm_client):
    from kvspec.campaign.runner import run_job
    from kvspec.campaign.matrix import Job

    ok = Job("ok", "check", {"target": "impl", "level": "pool", "seed": 0, "max_examples": 5})
    assert run_job(ok.to_dict(), 300, warm=True)["verdict"] == "pass"
    warm_client.proc.kill()
    warm_client.proc.wait()
    assert run_job(ok.to_dict(), 300, warm=True)["verdict"] == "pass" and warm_client.started == 2


# -- a tiny matrix on a local Ray ----------------------------------------------------------
@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray", reason="kvspec campaign runs on Ray (pip install -e '.[test]')")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        yield ray
    finally:
        ray.shutdown()


def _by_id(records: list[dict]) -> dict[str, tuple]:
    from kvspec.campaign.findings import findings_of
    return {r["id"]: (r["verdict"], sorted((f["invariant"], tuple(f["steps"])) for f in findings_of(r)))
            for r in records}


def test_tiny_matrix_on_local_ray_equals_one_process_and_resumes(tmp_path, local_ray, monkeypatch):
    from kvspec.campaign import execute as execute_mod
    from kvspec.campaign.runner import run_serial

    f = write(tmp_path, TINY)
    results = tmp_path / "results"
    rc, out, err = run(["campaign", str(f), "--results", str(results), "--json"])
    got = json.loads(out)
    assert rc == 1 and got["verdict"] == "violation", err[-3000:]
    assert got["counts"] == {"pass": 1, "violation": 2, "fail": 0, "error": 0}
    assert "[campaign] 3/3 done" in err  # the progress line

    jobs = load_campaign(f).jobs
    records = [json.loads((results / "jobs" / f"{j.id}.json").read_text()) for j in jobs]
    direct = run_serial(jobs, timeout=300)  # fresh python -m kvspec processes
    assert {r["runner"] for r in records} == {"warm-node"}  # forked from the node server the driver started
    assert _by_id(records) == _by_id(direct)  # same verdicts and findings as one process, job by job
    assert {x["invariant"] for x in got["findings"]} == {"I4"}
    # the report: Markdown, JSON, JUnit (one testcase per job, a failure per violation), the figure
    suite = ET.parse(results / "campaign.junit.xml").getroot().find("testsuite")
    assert len(suite.findall("testcase")) == 3 and len(suite.findall("testcase/failure")) == 2
    assert (results / "campaign.md").read_text().startswith("# kvspec campaign `tiny`")
    assert (results / "campaign_ttf.png").stat().st_size > 0
    repro = [x for x in got["findings"] if x.get("repro_files")][0]["repro_files"][0]
    assert Path(repro).is_file() and str(results) in repro  # kept, whichever node wrote it

    # rerun: one job's record removed; only that one runs again
    lost = jobs[0].id
    (results / "jobs" / f"{lost}.json").unlink()
    rc, out, err = run(["campaign", str(f), "--results", str(results), "--json"])
    again = json.loads(out)
    assert rc == 1 and again["skipped_done"] == 2 and _by_id(
        [json.loads((results / "jobs" / f"{j.id}.json").read_text()) for j in jobs]) == _by_id(direct)
    counts = {}
    for line in (results / "finished.log").read_text().splitlines():
        counts[line.split()[0]] = counts.get(line.split()[0], 0) + 1
    assert counts == {j.id: (2 if j.id == lost else 1) for j in jobs}

    # everything done: Ray is not even asked
    monkeypatch.setattr(execute_mod, "execute", lambda *a, **k: pytest.fail("a finished campaign ran jobs"))
    rc, out, _ = run(["campaign", str(f), "--results", str(results), "--json"])
    assert rc == 1 and json.loads(out)["skipped_done"] == 3


def test_a_local_campaign_runs_its_first_jobs_while_ray_starts(tmp_path):
    """Without a Ray of the caller's, the driver starts a local one and runs jobs itself
    meanwhile (its first job at once: Ray's start takes seconds); every job once, the
    same verdicts as fresh processes. A subprocess: the module's local_ray may be up."""
    import os
    import subprocess
    import sys

    from kvspec.campaign.runner import run_serial

    f = write(tmp_path, TINY)
    results = tmp_path / "results"
    r = subprocess.run([sys.executable, "-m", "kvspec", "campaign", str(f), "--results", str(results), "--json"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    got = json.loads(r.stdout)
    assert r.returncode == 1 and got["counts"] == {"pass": 1, "violation": 2, "fail": 0, "error": 0}, r.stderr[-3000:]
    jobs = load_campaign(f).jobs
    records = [json.loads((results / "jobs" / f"{j.id}.json").read_text()) for j in jobs]
    assert records[0].get("ran_on") == "driver, while Ray started"
    assert {r["runner"] for r in records} == {"warm-node"}  # the driver's and Ray's jobs: one server
    counts: dict[str, int] = {}
    for line in (results / "finished.log").read_text().splitlines():
        counts[line.split()[0]] = counts.get(line.split()[0], 0) + 1
    assert counts == {j.id: 1 for j in jobs}
    assert _by_id(records) == _by_id(run_serial(jobs, timeout=300))


def test_the_release_sweep_as_a_campaign_file_has_one_job_per_release_and_pass(tmp_path):
    import importlib.util
    spec = importlib.util.spec_from_file_location("vllm_releases", Path(__file__).resolve().parents[1]
                                                  / "tools" / "vllm_releases.py")
    vr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vr)
    versions = ["0.8.0", "0.27.0", "0.33.0"]
    engines = {"0.8.0": False, "0.27.0": True, "0.33.0": True}   # as the probe would say
    kinds = {"0.8.0": [], "0.27.0": ["compressed"], "0.33.0": ["compressed"]}
    f = write(tmp_path, vr.campaign_toml(versions, 50, tmp_path / "cache", engines=engines, engine_examples=7,
                                         kinds=kinds))
    jobs = load_campaign(f).jobs
    want = [(v, p.policies, p.level, p.kv_groups) for v in versions for p in vr.passes_for(v, engines[v], kinds[v])]
    assert len(jobs) == len(want) > len(versions)  # 0.8.0 has its time's policies too
    assert [w[2] for w in want].count("engine") == 2   # an engine pass where the engine builds
    assert [w[3] for w in want].count("with:compressed") == 2   # a pass per opt-in group kind
    for job, (v, pol, level, kv_groups) in zip(jobs, want):  # in order, as run_campaign reads them back
        assert job.pythonpath[0] == str(tmp_path / "cache" / v)
        assert job.env.get("KVSPEC_VLLM_POLICIES", "") == pol
        argv = job.argv()
        assert argv[:1] == ["check"] and "vllm" in argv
        assert argv[argv.index("--level") + 1] == level
        assert argv[argv.index("--max-examples") + 1] == ("7" if level == "engine" else "50")
        assert (argv[argv.index("--kv-groups") + 1] if "--kv-groups" in argv else "") == kv_groups
        assert argv[argv.index("--minimize") + 1] == "ddmin" and "--whole-budget" in argv   # the sweep's way


def test_the_driver_counts_its_own_job_as_running_while_ray_starts(monkeypatch):
    """The progress line's 'running' includes the job the driver runs itself while Ray
    starts (it once said 0 running then), and not once that job is done."""
    import threading

    from kvspec.campaign import execute, runner
    from kvspec.campaign.matrix import Job

    seen, built, holder = [], threading.Event(), {}

    def fake_run_job(job_d, timeout, warm, server):
        built.wait(10)  # until the test holds the object whose thread runs this
        seen.append(("during", holder["w"].busy))
        seen.append(("running, one Ray job out", execute.running_now(1, 2, holder["w"])))
        return {"id": job_d["id"], "verdict": "pass"}

    monkeypatch.setattr(runner, "run_job", fake_run_job)
    def on_done(record):
        seen.append(("done " + record["id"], holder["w"].busy))
        seen.append(("running, one Ray job out", execute.running_now(1, 2, holder["w"])))
    holder["w"] = execute._WhileRayStarts([Job("a", "check", {}), Job("b", "check", {})], 10, True, on_done)
    built.set()
    holder["w"].thread.join(10)
    assert seen[::2] == [("during", True), ("done a", False), ("during", True), ("done b", False)]
    assert [n for _, n in seen[1::2]] == [2, 1, 2, 1]  # the driver's job counted while it runs, not after
    assert execute.running_now(5, 2, None) == 2  # Ray's count is capped at its CPUs
    assert holder["w"].ran == 2

"""The command line never crashes, whatever a user types: Hypothesis draws ``argv`` for
every command from a grammar of good and bad pieces (options, values such as nan, inf,
-1, 0, huge numbers and garbage, targets such as missing files, a file with a syntax
error, a binary file, a class with a malformed ``kvspec_traits``, bad patches) and runs
``kvspec.cli.main`` in this process. Every run must end with exit code 0, 1 or 2, no
traceback and no "internal error", and under ``--json`` stdout must be one JSON object
(``{"verdict": "error", ...}`` for an error).

To stay fast the runs are bounded by construction: good counts are tiny (a few blocks,
one or two examples, batches of two examples), huge numbers are drawn only where they
are refused or cost nothing, and the parts that take seconds whatever the arguments
(the kernel sweep, the patch corpus's worker pool, CrossHair's subprocesses) are
replaced by stand-ins returning a result of the real shape. The arguments are still
parsed and checked by the real code.
"""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvspec.cli import main

CORPUS = Path(__file__).resolve().parents[1] / "kvspec" / "corpus" / "impl"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("fuzz")
    (d / "binary.bin").write_bytes(bytes(range(256)) * 4)
    (d / "syntax.py").write_text("class T(:\n    pass\n")
    (d / "badtraits.py").write_text("from kvspec.impl import KVCacheManager\n\n\n"
                                    "class T(KVCacheManager):\n    kvspec_traits = \"not a dict\"\n")
    (d / "good.py").write_text("from kvspec.impl import KVCacheManager\n\n\nclass T(KVCacheManager):\n    pass\n")
    (d / "raises.py").write_text("raise RuntimeError('at import')\n")
    (d / "garbage.diff").write_text("this is not a diff\n")
    (d / "empty.diff").write_text("")
    (d / "afile").write_text("x")
    # campaign files that are refused before Ray starts (a valid one would start Ray: seconds)
    (d / "nojobs.toml").write_text("[campaign]\nname = 'x'\n")
    (d / "nondet.toml").write_text("[[matrix]]\ncommand = 'check'\nseed = [0, 1]\n")
    (d / "badkey.toml").write_text("[[matrix]]\ncommand = 'mc'\nbudget = 'nan'\n")
    hostile = hostile_diffs(d)
    return {k: str(d / k) for k in ("binary.bin", "syntax.py", "badtraits.py", "good.py", "raises.py",
                                   "garbage.diff", "empty.diff", "afile", "nojobs.toml", "nondet.toml",
                                   "badkey.toml")} | {"dir": str(d)} | hostile


# Issue 32: diffs whose paths leave the tree. Each names a file under ``outside/`` of the
# test's directory (absolute, or reached through '..' from wherever kvspec's copy lies);
# no run may ever create it.
def _sentinel(d: Path, name: str) -> str:
    return str(d / "outside" / name)


def _new_file(path: str, body: str = "x = 1") -> str:
    return f"--- /dev/null\n+++ {path}\n@@ -0,0 +1 @@\n+{body}\n"


def hostile_diffs(d: Path) -> dict[str, str]:
    up = "../" * 40  # from any copy's depth back to /, then down to the sentinel
    texts = {
        "abs.diff": _new_file(_sentinel(d, "abs.py")),
        "abs_b.diff": _new_file("b/" + _sentinel(d, "abs_b.py")),
        "dotdot_impl.diff": _new_file("b/impl/" + up + _sentinel(d, "dotdot_impl.py").lstrip("/")),
        "dotdot_vllm.diff": _new_file("b/vllm/" + up + _sentinel(d, "dotdot_vllm.py").lstrip("/")),
        "dotdot_quoted.diff": _new_file('"b/impl/\\056\\056/' + up + _sentinel(d, "dotdot_q.py").lstrip("/") + '"'),
        "gitdotdot.diff": ("diff --git a/impl/" + up + _sentinel(d, "gitdotdot.py").lstrip("/") + " b/impl/" + up
                           + _sentinel(d, "gitdotdot.py").lstrip("/") + "\nnew file mode 100644\n"
                           + _new_file("b/impl/" + up + _sentinel(d, "gitdotdot.py").lstrip("/"))),
        "symlink.diff": ("diff --git a/impl/evil.py b/impl/evil.py\nnew file mode 120000\nindex 0000000..1111111\n"
                         + _new_file("b/impl/evil.py", _sentinel(d, "symlink.py")) + "\\ No newline at end of file\n"),
        "mode.diff": ("diff --git a/impl/block_pool.py b/impl/block_pool.py\nold mode 100644\nnew mode 120000\n"
                      "index 1111111..2222222\n--- a/impl/block_pool.py\n+++ b/impl/block_pool.py\n"
                      "@@ -1 +1 @@\n-x\n+" + _sentinel(d, "mode.py") + "\n"),
        "gitbinary.diff": ("diff --git a/impl/blob.bin b/impl/blob.bin\nnew file mode 100644\n"
                           "index 0000000..1111111\nGIT binary patch\nliteral 3\nKcmZ?wU;qFB0RR91\n\n"
                           "literal 0\nHcmV?d00001\n\n"),
        "binfiles.diff": ("diff --git a/impl/blob.bin b/impl/blob.bin\nindex 1111111..2222222 100644\n"
                          "Binary files a/impl/blob.bin and b/impl/blob.bin differ\n"),
        "rename.diff": ("diff --git a/impl/block_pool.py b/outside.py\nsimilarity index 100%\n"
                        "rename from impl/block_pool.py\nrename to outside.py\n"),
    }
    for name, text in texts.items():
        (d / name).write_text(text)
    return {name: str(d / name) for name in texts}


HOSTILE = ("abs.diff", "abs_b.diff", "dotdot_impl.diff", "dotdot_vllm.diff", "dotdot_quoted.diff", "gitdotdot.diff",
           "symlink.diff", "mode.diff", "gitbinary.diff", "binfiles.diff", "rename.diff")


NUMBERS = ["nan", "NaN", "inf", "-inf", "-1", "0", "1", "2", "1e309", "abc", "", "0x10", "1.5", "-0"]
NONFINITE = {"nan", "NaN", "inf", "-inf", "1e309"}
SMALL = ["1", "2", "0", "-1", "nan", "abc", "1.5", ""]
TIMES = NUMBERS + ["0.01", "1e308"]  # where a huge time costs nothing (tiny runs, stand-ins)
BUDGETS = ["nan", "inf", "-inf", "-1", "0", "-0", "1e309", "abc", "", "0.01", "0.05"]  # check's search time


def _targets(f: dict) -> list[str]:
    return ["impl", "impl", "nope", "/no/such/file.py:T", f["syntax.py"] + ":T", f["binary.bin"] + ":T",
            f["badtraits.py"] + ":T", f["good.py"] + ":T", f["good.py"] + ":Missing", f["raises.py"] + ":T",
            "no_such_module:X", "os:path", ":", ""]


def _patches(f: dict) -> list[str]:
    return [str(CORPUS / "no_evict.diff"), f["binary.bin"], f["garbage.diff"], f["empty.diff"], f["dir"],
            "/no/such.diff", f["syntax.py"]] + [f[h] for h in HOSTILE]


def grammar(f: dict) -> dict[str, dict[str, list]]:
    """command -> option -> the values drawn for it (None: a flag without a value)."""
    common = {"--json": [None], "--bogus": [None, "1"]}
    groups = ["full", "full,swa:4", "mamba", "", "swa:0", "garbage", "full,chunked:8"]
    return {
        "check": {**common, "--target": _targets(f), "--patch": _patches(f),
                  "--api": ["blockpool", "kvcachemanager", "nanovllm", "bad"],
                  "--level": ["pool", "cache", "all", "bad"], "--misuse": [None], "--kv-groups": groups,
                  "--seed": NUMBERS + ["99999999999999999999999"], "--budget": BUDGETS,
                  "--max-examples": SMALL, "--derandomize": [None], "--jobs": SMALL + ["10000"],
                  "--op-timeout": TIMES, "--report-dir": [f["dir"] + "/r", f["afile"] + "/x", "/proc/no/such"],
                  "--db": [f["dir"] + "/db"]},
        "mc": {**common, "--target": _targets(f), "--patch": _patches(f),
               "--api": ["blockpool", "kvcachemanager", "nanovllm"], "--level": ["pool", "cache", "bad"],
               "--blocks": SMALL, "--depth": SMALL, "--requests": SMALL, "--kv-groups": groups,
               "--max-model-len": SMALL, "--caching": ["on", "off", "x"], "--symmetry": ["on", "off"],
               "--fork": ["auto", "compact", "pickle", "deepcopy", "replay", "driver", "x"],
               "--workers": SMALL, "--check-once": ["on", "off"], "--time-cap": TIMES, "--mem-cap": TIMES,
               "--report-dir": [f["dir"] + "/m", f["afile"] + "/x"]},
        "patches": {**common, "--target": ["impl", "vllm", "bad"], "--seeds": SMALL, "--timeout": TIMES,
                    "--jobs": SMALL + ["10000"], "--only": ["no_evict", "nope", "", ","], "--kv-groups": groups,
                    "--report-dir": [f["dir"] + "/p", f["afile"] + "/x"]},
        "kernels": {**common, "--device": ["cpu", "cuda", "tpu"], "--cases": SMALL + ["10**9"],
                    "--seed": NUMBERS},
        "bench": {**common, "--target": _targets(f), "--ops": SMALL + ["-5", "100", "x"], "--seed": NUMBERS},
        "diff": {**common, "--patch": _patches(f), "--target": ["impl", "vllm"],
                 "--per-condition-timeout": TIMES},
        "api": {**common},
        "campaign": {**common, "--address": ["nope:1", "", "127.0.0.1:1"],
                     "--results": [f["dir"] + "/c", f["afile"] + "/x"]},
    }


def _campaign_files(f: dict) -> list[str]:
    return [f["nojobs.toml"], f["nondet.toml"], f["badkey.toml"], f["binary.bin"], f["syntax.py"], f["empty.diff"],
            f["dir"], "/no/such.toml"]


@st.composite
def argvs(draw, f: dict) -> list[str]:
    g = grammar(f)
    command = draw(st.sampled_from(sorted(g) + ["", "nope", "--json"]))
    argv = [command] if command else []
    if command == "campaign" and draw(st.booleans()):  # FILE.toml is positional; missing, it is a usage error
        argv.append(draw(st.sampled_from(_campaign_files(f))))
    opts = g.get(command, {})
    for opt in draw(st.lists(st.sampled_from(sorted(opts)), max_size=5)) if opts else []:
        value = draw(st.sampled_from(opts[opt]))
        argv += [opt] if value is None else [opt, value]
    if command == "check" and "--budget" not in argv and "--max-examples" not in argv:
        argv += ["--max-examples", "2"]  # bounded: the default is a 30 s budget
    if command == "mc" and "--depth" not in argv:
        argv += ["--depth", "2"]  # bounded: the default depth 8 on 5 blocks takes seconds
    if command == "bench" and "--ops" not in argv:
        argv += ["--ops", "100"]
    return argv


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse's --help, never an error
            rc = e.code if isinstance(e.code, int) else 0
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture
def bounded(monkeypatch, tmp_path):
    """The stand-ins for the parts that cost seconds whatever the arguments, tiny batches,
    and a working directory of the test's own (default repro directories land there)."""
    from kvspec.check import search
    monkeypatch.setattr(search, "EXAMPLES_PER_BATCH", 2)
    monkeypatch.chdir(tmp_path)

    def sweep(device: str, seed: int, count):
        if device == "cuda":
            from kvspec.errors import UsageError
            raise UsageError("kvspec kernels: --device cuda needs a CUDA GPU (stand-in)")
        return {"device": device, "mode": "stand-in", "seed": seed, "cases": count or 30, "seconds": 0.0,
                "rule": "-", "floor": 0.0, "per_dtype": {}, "passed": True, "failures": []}
    import kvspec.kernels.sweep as kernels
    monkeypatch.setattr(kernels, "run_sweep", sweep)

    def pool(work, jobs, progress):
        rows = []
        for fn, task, _ in work:
            if fn == "run_trial":
                rows.append({"_fn": fn, "id": task["id"], "seed": task["seed"], "applied": True, "killed": False,
                             "invariant": None, "also": [], "seconds_to_failure": None, "shrunk_steps": None,
                             "repro_steps": None, "minimal_steps": None, "minimal_proven": False, "config": None,
                             "error": None, "wall_seconds": 0.0})
            else:
                rows.append({"_fn": fn, "id": task["id"], "diff": {"verdict": "no difference found", "seconds": 0.0,
                                                                    "differences": [], "functions": []}})
        return rows
    import kvspec.corpus.command as patches
    monkeypatch.setattr(patches, "run_pool", pool)

    from kvspec.check import crosshair
    monkeypatch.setattr(crosshair, "_run_diffbehavior", lambda harness, key, env, pct, hard: crosshair.Comparison(
        key, key, "no difference found", seconds=0.0))


def check_run(argv: list[str]) -> None:
    rc, out, err = run(argv)
    said = f"argv {argv}: exit {rc}\nstdout: {out[-2000:]}\nstderr: {err[-2000:]}"
    assert rc in (0, 1, 2), said
    hostile = [a for a in argv if a.endswith(HOSTILE)]
    if hostile:  # a hostile diff is refused with one line, and nothing lands outside the copy
        outside = Path(hostile[0]).parent / "outside"
        assert not (outside.exists() and any(outside.iterdir())), said
        if argv[0] in ("check", "mc", "diff") and "--help" not in argv:
            assert rc == 2, said
    assert "Traceback" not in out + err, said
    assert "internal error" not in out + err, said
    if NONFINITE & set(argv):  # NaN or infinity where a count or a time is due: refused, never a verdict
        assert rc == 2, said
    if "--json" in argv and "--help" not in argv:
        obj = json.loads(out)  # one JSON object, nothing else
        assert isinstance(obj, dict), said
        if rc == 2:
            assert obj.get("verdict") == "error" and obj.get("error"), said
    if rc == 2:
        assert err.strip() and len(err.strip().splitlines()) >= 1, said


KNOWN = [  # the inputs of issue 22, first: each once crashed, hung or passed by accident
    ["check", "--budget", "nan"],
    ["check", "--max-examples", "1", "--patch", "{binary.bin}"],
    ["check", "--max-examples", "1", "--target", "{badtraits.py}:T", "--json"],
    ["check", "--max-examples", "1", "--target", "/no/such/file.py:T", "--json"],
    ["mc", "--time-cap", "nan", "--depth", "1"],
    ["diff", "--patch", "{binary.bin}", "--json"],
    ["check", "--budget", "inf", "--json"],
    ["api", "bogus", "--json"],
    ["mc", "--depth", "1", "--target", "{badtraits.py}:T"],
    ["bench", "--ops", "10", "--target", "{badtraits.py}:T", "--json"],
    ["campaign", "{nondet.toml}", "--json"],
    ["campaign", "{binary.bin}", "--address", "nope:1"],
    ["campaign", "--json"],
]


HOSTILE_RUNS = [[command, "--target", target, "--patch", "{" + diff + "}"] + extra
                for command, extra in (("check", ["--max-examples", "1"]), ("mc", ["--depth", "1"]))
                for target in ("impl", "vllm", "nanovllm", "sglang", "{good.py}:T")
                for diff in HOSTILE] + [["diff", "--patch", "{" + diff + "}"] for diff in HOSTILE]


@pytest.mark.parametrize("argv", HOSTILE_RUNS, ids=" ".join)
def test_hostile_diffs_are_refused_with_one_line_and_nothing_written(argv, files, bounded):
    for name, path in files.items():
        argv = [x.replace("{" + name + "}", path) for x in argv]
    for j in ([], ["--json"]):
        rc, out, err = run(argv + j)
        said = f"argv {argv + j}: exit {rc}\nstdout: {out[-2000:]}\nstderr: {err[-2000:]}"
        assert rc == 2, said
        assert len(err.strip().splitlines()) == 1 and "refused" in err, said
        assert not (Path(files["dir"]) / "outside").exists(), said
        if j:
            assert json.loads(out)["verdict"] == "error", said


@pytest.mark.parametrize("argv", KNOWN, ids=" ".join)
def test_known_bad_inputs(argv, files, bounded):
    for name, path in files.items():
        argv = [x.replace("{" + name + "}", path) for x in argv]
    check_run(argv)


def test_every_command_ends_with_0_1_or_2_no_traceback_and_json(files, bounded):
    @settings(max_examples=120, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(argvs(files))
    def fuzz(argv):
        check_run(argv)

    fuzz()

"""The ``kvspec`` command line (a contract: see DESIGN.md).

Exit codes: 0 nothing found, 1 a violation found, 2 a usage or target error (one
line on stderr, never a traceback).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from typing import Optional, Sequence

from kvspec.errors import Interrupted, KvspecError, UsageError

PATCHES_REPORT_DIR = "kvspec-patches"  # kvspec patches --report-dir: never the checkout's committed reports/ by default


# -- values: a count or a time is checked where it is parsed, so NaN, infinity, zero or
# a negative number is one line and exit 2 in every command, never a silent "pass".
def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects a whole number, not {text!r}") from None


def count(minimum: int = 1):
    """An argparse type: a whole number >= ``minimum``."""
    def parse(text: str) -> int:
        n = _int(text)
        if n < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum} (got {text})")
        return n
    parse.__name__ = "count"
    return parse


def seconds(zero_ok: bool = False):
    """An argparse type: a finite number of seconds (or GiB), positive (or 0 where it
    means "off"); NaN and infinity are refused."""
    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expects a number, not {text!r}") from None
        if math.isnan(x) or math.isinf(x):
            raise argparse.ArgumentTypeError(f"must be a finite number (got {text})")
        if x < 0 or (x == 0 and not zero_ok):
            raise argparse.ArgumentTypeError(f"must be {'0 or more' if zero_ok else 'positive'} (got {text})")
        return x
    parse.__name__ = "number"
    return parse


class _HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" not in text and action.option_strings
                and not any(action.default is x for x in (None, False, argparse.SUPPRESS))):
            text += " (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kw):
        kw.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kw)

    def error(self, message: str):  # one line, exit 2
        # "argument --budget: must be positive (got 0)" -> "--budget must be positive (got 0)"
        m = re.match(r"argument ([-\w/]+): ((?:must|expects) .*)", message)
        if m:
            message = f"{m.group(1)} {m.group(2)}"
        raise UsageError(f"{self.prog}: {message}")


SEED_HELP = "seed of the search; the same seed gives the same examples"
JSON_HELP = "print one JSON object on stdout (an error too: {\"verdict\": \"error\", \"error\": ...})"
TARGET_HELP = "impl, vllm, nanovllm[:PKG], sglang, lmcache, FILE.py:NAME or module:NAME"


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kvspec", description="Verify paged KV-cache block allocators and paged-attention kernels.")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)

    c = sub.add_parser("check", help="run the stateful machines against a target")
    c.add_argument("--target", default="impl", help=TARGET_HELP)
    c.add_argument("--patch", help="unified diff applied to temporary copies of the target's sources (default: none)")
    c.add_argument("--api", choices=["blockpool", "kvcachemanager", "nanovllm", "allocator"],
                   help="API of a user target (default: detected from its methods)")
    c.add_argument("--level", choices=["pool", "cache", "engine", "all"], default="all",
                   help="which machine: the block pool, the cache manager, the engine's own scheduler driving it "
                        "(vllm, nanovllm; not part of all), or every pool/cache level the target supports")
    c.add_argument("--misuse", action="store_true", help="mix misuse calls into the valid operations (default: off)")
    c.add_argument("--kv-groups", default=None, help="KV-cache groups sharing the pool, e.g. full,swa:4, full,chunked:8 or (vllm 0.20 on) full,compressed:4,swa:2, or with:KIND: every example draws one of the layouts with a KIND group (cache level; default: full, or drawn per example for targets that support groups)")
    c.add_argument("--seed", type=_int, default=0, help=SEED_HELP)
    c.add_argument("--budget", type=seconds(), default=None, metavar="S",
                   help="seconds of search (default 30); for interactive use: the verdict depends on the machine")
    c.add_argument("--max-examples", type=count(1), default=None, metavar="N",
                   help="deterministic mode: stop after N examples, never on time, so the same commit, target and "
                        "seed give the same verdict, examples, steps and repro on any machine (for CI); "
                        "excludes --budget (default: off)")
    c.add_argument("--derandomize", action="store_true",
                   help="deterministic mode with the default example count (1000, "
                        "kvspec.check.search.DETERMINISTIC_EXAMPLES) "
                        "unless --max-examples is given; excludes --budget (default: off)")
    c.add_argument("--max-findings", type=count(1), default=None, metavar="N",
                   help="distinct findings to report: after a finding the search goes on with its signature "
                        "(invariant, operation, code location) excluded, each finding cut down with its own repro, "
                        "while fruitful (up to twice the examples at which the latest finding was made, as "
                        "Hypothesis does with several bugs) and within --max-examples or --budget, counted over "
                        "the whole run; 1: stop at the first (default: 5, kvspec.check.search.MAX_FINDINGS)")
    c.add_argument("--minimize", choices=("full", "ddmin"), default="full",
                   help="how each finding is cut down: full (ddmin, then a bounded BFS that proves the repro shortest "
                        "where it can; default) or ddmin (ddmin alone, nothing proven: the release sweep's way, where "
                        "the proof on an old release's slow calls took most of a job)")
    c.add_argument("--whole-budget", action="store_true",
                   help="after a finding, search the whole of --max-examples (or --budget) for further distinct "
                        "findings, not only while fruitful (the release sweep's way: a release may hold several bugs)")
    c.add_argument("--jobs", type=count(1), default=1, metavar="N",
                   help="N worker processes with seeds SEED..SEED+N-1, their distinct findings merged (one per signature, "
                        "up to --max-findings; all stop once one worker holds that many) (budget mode; "
                        "capped at the CPU cores available, with a note)")
    c.add_argument("--db", default=None, metavar="DIR",
                   help="Hypothesis example database directory shared by the workers and later runs: "
                        "failures found before are replayed first (budget mode; default: none)")
    c.add_argument("--op-timeout", type=seconds(zero_ok=True), default=10.0, metavar="S",
                   help="seconds one target call may take before it is a NO_HANG finding (default 10; 0: off)")
    c.add_argument("--json", action="store_true", help=JSON_HELP)
    c.add_argument("--report-dir", default=None, metavar="DIR",
                   help="write repros and the report files (kvspec-check.json, .md, .junit.xml) here; checked "
                        "for writing before the search (default: repros only, to reports/repros)")

    m = sub.add_parser("mc", help="exhaustive bounded model checking")
    m.add_argument("--target", default="impl", help=TARGET_HELP)
    m.add_argument("--patch", help="unified diff applied to temporary copies of the target's sources (default: none)")
    m.add_argument("--api", choices=["blockpool", "kvcachemanager", "nanovllm", "allocator"],
                   help="API of a user target (default: detected from its methods)")
    m.add_argument("--level", choices=["pool", "cache"], default=None,
                   help="which machine: the block pool or the cache manager (default: the level the target "
                        "supports, pool where it has both)")
    m.add_argument("--blocks", type=count(1), default=5, help="usable blocks")
    m.add_argument("--depth", type=count(0), default=8, help="operations per path at most")
    m.add_argument("--requests", type=count(1), default=2, help="cache level: live requests at most")
    m.add_argument("--kv-groups", default="full", help="KV-cache groups sharing the pool, e.g. full,swa:4 (cache level)")
    m.add_argument("--max-model-len", type=count(1), default=None, metavar="N",
                   help="per-request token cap (cache level, targets with cache features; default: none)")
    m.add_argument("--caching", choices=["on", "off"], default=None,
                   help="prefix caching (default: on where the target supports it, else off)")
    m.add_argument("--symmetry", choices=["on", "off"], default="on",
                   help="merge states equal up to renaming blocks, labels, requests (default on)")
    m.add_argument("--fork", choices=["auto", "compact", "pickle", "deepcopy", "replay", "driver"], default="auto",
                   help="how a state is put back to try each op (default auto: the first that round-trips)")
    m.add_argument("--workers", type=count(1), default=1, metavar="N",
                   help="processes for a level-synchronous parallel search (same states and counterexample; "
                        "more than the CPU cores is capped, with a note)")
    m.add_argument("--seen", choices=["fingerprint", "exact"], default="fingerprint",
                   help="keep a 64-bit fingerprint per state, as TLC does (default), or the whole canonical key")
    m.add_argument("--partitions", type=count(1), default=None, metavar="N",
                   help="partition the states by fingerprint over N Ray actors (TLC's distributed mode; "
                        "a local Ray unless --ray-address); --time-cap checked between levels, no memory cap")
    m.add_argument("--ray-address", default=None, help="with --partitions: the Ray cluster to use")
    m.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="with --partitions: write each level's seen sets, states and traces here")
    m.add_argument("--resume", action="store_true", help="with --partitions: go on from --checkpoint's last level")
    m.add_argument("--check-once", choices=["on", "off"], default="on",
                   help="run the state invariants once per distinct state, as TLC does (default on)")
    m.add_argument("--time-cap", type=seconds(), default=300.0, metavar="S",
                   help="seconds the search may run; it stops with partial counts")
    m.add_argument("--mem-cap", type=seconds(), default=2.0, metavar="GIB",
                   help="GiB the search may grow the process by; it stops with partial counts")
    m.add_argument("--json", action="store_true", help=JSON_HELP)
    m.add_argument("--report-dir", default=None, metavar="DIR",
                   help="write the counterexample's repro here (default: reports/repros)")

    pt = sub.add_parser("patches", help="measure bug-finding power on the bundled bug corpus")
    pt.add_argument("--target", choices=["impl", "vllm", "nanovllm"], default="impl", help="whose bug corpus to run")
    pt.add_argument("--seeds", type=count(1), default=10, help="trials per patch, seeds 0..N-1 (K..K+N-1 with --first-seed)")
    pt.add_argument("--first-seed", type=count(0), default=0, metavar="K",
                    help="the first seed: a run split over machines runs its seed ranges as separate commands, "
                         "with the trials of one run (kvspec diff, on impl, runs in the range that starts at 0; another range "
                         "leaves a rare-input patch to it rather than failing it)")
    pt.add_argument("--timeout", type=seconds(), default=60.0, metavar="S", help="seconds per trial")
    pt.add_argument("--jobs", type=count(1), default=None,
                    help="worker processes (default: CPU count; more than that is capped, with a note)")
    pt.add_argument("--only", help="comma-separated patch ids (default: every patch of the corpus)")
    pt.add_argument("--level", choices=["all", "engine"], default="all",
                    help="all: the target's pool and cache machines; engine: the engine's own scheduler (vllm)")
    pt.add_argument("--kv-groups", default=None, help="KV-cache groups sharing the pool, e.g. full,swa:4, full,chunked:8 or (vllm 0.20 on) full,compressed:4,swa:2, or with:KIND: every example draws one of the layouts with a KIND group (cache level; default: full, or drawn per example for targets that support groups)")
    pt.add_argument("--json", action="store_true", help=JSON_HELP)
    pt.add_argument("--report-dir", default=PATCHES_REPORT_DIR, metavar="DIR",
                    help="write patches.json, patches.md and patches_ttf.png here (default: kvspec-patches/ in the "
                         "working directory; pass --report-dir reports to update the checkout's committed report)")

    k = sub.add_parser("kernels", help="check the Triton paged-attention kernels against the float64 oracle")
    k.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the kernels run")
    k.add_argument("--cases", type=count(1), default=None, help="generated cases (default: 30 on cpu, 48 on cuda)")
    k.add_argument("--seed", type=_int, default=0, help=SEED_HELP)
    k.add_argument("--json", action="store_true", help=JSON_HELP)

    b = sub.add_parser("bench", help="ops/second of a fixed-seed pool-level trace, nothing checked")
    b.add_argument("--target", default="impl", help=TARGET_HELP)
    b.add_argument("--ops", type=_int, default=200_000, help="operations in the trace")
    b.add_argument("--seed", type=_int, default=0, help="seed of the trace")
    b.add_argument("--json", action="store_true", help=JSON_HELP)

    ap = sub.add_parser("api", help="the calls kvspec makes on a user's allocator and the internals it reads")
    ap.add_argument("api", nargs="?", choices=["blockpool", "kvcachemanager", "nanovllm", "allocator"],
                    help="one API (default: all three)")
    ap.add_argument("--json", action="store_true", help=JSON_HELP)

    cp = sub.add_parser("campaign", help="a matrix of check/mc/patches jobs as Ray tasks, resumable (needs ray)")
    cp.add_argument("file", metavar="FILE.toml", help="the campaign file: [campaign] and [[matrix]] tables")
    cp.add_argument("--address", default=None, metavar="RAY_ADDRESS",
                    help="a Ray cluster's address, HEAD:6379 (default: start a local Ray instance)")
    cp.add_argument("--results", default=None, metavar="DIR",
                    help="results directory: one JSON per finished job, skipped on a rerun, and the report "
                         "(default: the file's [campaign] results, else kvspec-campaign/NAME)")
    cp.add_argument("--json", action="store_true", help=JSON_HELP)

    d = sub.add_parser("diff", help="CrossHair diffbehavior on the helpers of impl (kvspec.impl) a patch changes")
    d.add_argument("--patch", required=True, help="unified diff against kvspec/impl (required)")
    d.add_argument("--target", default="impl", help="only impl: the helpers compared are kvspec.impl's")
    d.add_argument("--per-condition-timeout", type=seconds(), default=10.0, metavar="S",
                   help="CrossHair's seconds per compared helper")
    d.add_argument("--json", action="store_true", help=JSON_HELP)
    return p


def _dispatch(a: argparse.Namespace) -> int:
    if a.command == "check":
        from kvspec.check.command import cmd_check
        return cmd_check(a)
    if a.command == "mc":
        from kvspec.mc.command import cmd_mc
        return cmd_mc(a)
    if a.command == "patches":
        from kvspec.corpus.command import cmd_patches
        return cmd_patches(a)
    if a.command == "kernels":
        from kvspec.kernels.sweep import cmd_kernels
        return cmd_kernels(a)
    if a.command == "bench":
        from kvspec.targets.bench import cmd_bench
        return cmd_bench(a)
    if a.command == "api":
        from kvspec.targets.contract import cmd_api
        return cmd_api(a)
    if a.command == "diff":
        from kvspec.check.crosshair import cmd_diff
        return cmd_diff(a)
    if a.command == "campaign":  # Ray is imported inside, only here: it takes seconds
        from kvspec.campaign.command import cmd_campaign
        return cmd_campaign(a)
    raise UsageError("kvspec: choose a command: check, mc, patches, kernels, bench, diff, api, campaign "
                     "(see kvspec --help)")


def _error(message: str, argv: Sequence[str]) -> int:
    """A usage or target error: one line on stderr, exit 2; under ``--json`` also one
    JSON object on stdout, so a tool reading stdout always gets an answer."""
    line = message if message.startswith("kvspec") else f"kvspec: error: {message}"
    line = " ".join(line.split())  # one line, whatever the message held
    try:
        print(line, file=sys.stderr)
        if "--json" in argv:
            command = next((x for x in argv if not x.startswith("-")), None)
            print(json.dumps({"verdict": "error", "error": line, "command": command, "exit_code": 2}))
    except BrokenPipeError:   # the reader went away (its parent was killed): nobody is left to tell
        pass
    return 2


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line. Run as ``kvspec`` / ``python -m kvspec`` (``argv`` None), the
    command runs in a forked child (``kvspec.guard``): a run the code under test ends
    (``os._exit``, a signal) exits 2 with one line, never 0. ``main(argv)`` called from
    Python runs in the calling process."""
    if argv is None:
        from kvspec.guard import run_guarded
        line = list(sys.argv[1:])
        return run_guarded(lambda: _main(line), line, _error)
    return _main(list(argv))


def _main(argv: list[str]) -> int:
    try:
        args = build_parser().parse_args(argv)
        return _dispatch(args)
    except KvspecError as e:
        return _error(str(e), argv)
    except BrokenPipeError:  # the reader of stdout went away (``kvspec ... | head``): nothing left to say there
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        print("kvspec: stdout was closed before the output was written", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # a command that reports what it reached catches this itself
        print("kvspec: interrupted", file=sys.stderr)
        return e.exit_code if isinstance(e, Interrupted) else 130
    except Exception as e:  # our own bug: say so in one line, keep the traceback on request
        if os.environ.get("KVSPEC_DEBUG"):
            raise
        return _error(f"kvspec: internal error: {type(e).__name__}: {e} (set KVSPEC_DEBUG=1 for the traceback)", argv)


if __name__ == "__main__":
    sys.exit(main())

"""The ``kvspec`` command line (a contract: see DESIGN.md).

Exit codes: 0 nothing found, 1 a violation found, 2 a usage or target error (one
line on stderr, never a traceback).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from kvspec.errors import KvspecError, UsageError




class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2
        raise UsageError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kvspec", description="Verify paged KV-cache block allocators and paged-attention kernels.")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)

    c = sub.add_parser("check", help="run the stateful machines against a target")
    c.add_argument("--target", default="impl", help="impl (default), vllm, nanovllm[:PKG], FILE.py:NAME, module:NAME")
    c.add_argument("--patch", help="unified diff applied to temporary copies of the target's sources")
    c.add_argument("--api", choices=["blockpool", "kvcachemanager", "nanovllm"], help="API of a user target")
    c.add_argument("--level", choices=["pool", "cache", "all"], default="all")
    c.add_argument("--misuse", action="store_true", help="mix misuse calls into the valid operations")
    c.add_argument("--kv-groups", default=None, help="KV-cache groups sharing the pool, e.g. full,swa:4 or full,chunked:8 (cache level; default: full, or drawn per example for targets that support groups)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--budget", type=float, default=None,
                   help="seconds of search (default 30); for interactive use: the verdict depends on the machine")
    c.add_argument("--max-examples", type=int, default=None, metavar="N",
                   help="deterministic mode: stop after N examples, never on time, so the same commit, target and "
                        "seed give the same verdict, examples, steps and repro on any machine (for CI); "
                        "excludes --budget")
    c.add_argument("--derandomize", action="store_true",
                   help="deterministic mode with the default example count (1000, "
                        "kvspec.check.search.DETERMINISTIC_EXAMPLES) "
                        "unless --max-examples is given; excludes --budget")
    c.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="N worker processes with seeds SEED..SEED+N-1; all stop at the first violation (budget mode)")
    c.add_argument("--db", default=None, metavar="DIR",
                   help="Hypothesis example database directory shared by the workers and later runs: "
                        "failures found before are replayed first (budget mode)")
    c.add_argument("--op-timeout", type=float, default=10.0, metavar="S",
                   help="seconds one target call may take before it is a NO_HANG finding (default 10; 0: off)")
    c.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    c.add_argument("--report-dir", default=None, help="write repros and reports here (default reports/repros)")

    m = sub.add_parser("mc", help="exhaustive bounded model checking")
    m.add_argument("--target", default="impl")
    m.add_argument("--patch")
    m.add_argument("--api", choices=["blockpool", "kvcachemanager", "nanovllm"], help="API of a user target")
    m.add_argument("--level", choices=["pool", "cache"], default="pool")
    m.add_argument("--blocks", type=int, default=5, help="usable blocks")
    m.add_argument("--depth", type=int, default=8)
    m.add_argument("--requests", type=int, default=2, help="cache level: live requests at most")
    m.add_argument("--kv-groups", default="full", help="KV-cache groups sharing the pool, e.g. full,swa:4 (cache level)")
    m.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="per-request token cap (cache level, targets with cache features; default: none)")
    m.add_argument("--caching", choices=["on", "off"], default=None,
                   help="prefix caching (default: on where the target supports it, else off)")
    m.add_argument("--symmetry", choices=["on", "off"], default="on",
                   help="merge states equal up to renaming blocks, labels, requests (default on)")
    m.add_argument("--fork", choices=["auto", "compact", "pickle", "deepcopy", "replay", "driver"], default="auto",
                   help="how a state is put back to try each op (default auto: the first that round-trips)")
    m.add_argument("--workers", type=int, default=1, metavar="N",
                   help="processes for a level-synchronous parallel search (same states and counterexample)")
    m.add_argument("--check-once", choices=["on", "off"], default="on",
                   help="run the state invariants once per distinct state, as TLC does (default on)")
    m.add_argument("--time-cap", type=float, default=300.0)
    m.add_argument("--mem-cap", type=float, default=2.0, help="GiB the search may grow the process by")
    m.add_argument("--json", action="store_true")
    m.add_argument("--report-dir", default=None)

    pt = sub.add_parser("patches", help="measure bug-finding power on the bundled bug corpus")
    pt.add_argument("--target", choices=["impl", "vllm", "nanovllm"], default="impl")
    pt.add_argument("--seeds", type=int, default=10)
    pt.add_argument("--timeout", type=float, default=60.0)
    pt.add_argument("--jobs", type=int, default=None, help="worker processes (default: CPU count)")
    pt.add_argument("--only", help="comma-separated patch ids")
    pt.add_argument("--kv-groups", default=None, help="KV-cache groups sharing the pool, e.g. full,swa:4 or full,chunked:8 (cache level; default: full, or drawn per example for targets that support groups)")
    pt.add_argument("--json", action="store_true")
    pt.add_argument("--report-dir", default="reports")

    k = sub.add_parser("kernels", help="check the Triton paged-attention kernels against the float64 oracle")
    k.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    k.add_argument("--cases", type=int, default=None, help="generated cases (default: 30 on cpu, 48 on cuda)")
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("--json", action="store_true")

    b = sub.add_parser("bench", help="ops/second of a fixed-seed pool-level trace, nothing checked")
    b.add_argument("--target", default="impl")
    b.add_argument("--ops", type=int, default=200_000)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--json", action="store_true")

    ap = sub.add_parser("api", help="the calls kvspec makes on a user's allocator and the internals it reads")
    ap.add_argument("api", nargs="?", choices=["blockpool", "kvcachemanager", "nanovllm"],
                    help="one API (default: all three)")
    ap.add_argument("--json", action="store_true")

    d = sub.add_parser("diff", help="CrossHair diffbehavior on the helpers a patch changes")
    d.add_argument("--patch", required=True)
    d.add_argument("--target", default="impl")
    d.add_argument("--per-condition-timeout", type=float, default=10.0)
    d.add_argument("--json", action="store_true")
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
    raise UsageError("kvspec: choose a command: check, mc, patches, kernels, bench, diff, api (see kvspec --help)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return _dispatch(args)
    except KvspecError as e:
        print(f"kvspec: error: {e}" if not str(e).startswith("kvspec") else str(e), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvspec: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # our own bug: say so in one line, keep the traceback on request
        if os.environ.get("KVSPEC_DEBUG"):
            raise
        print(f"kvspec: internal error: {type(e).__name__}: {e} (set KVSPEC_DEBUG=1 for the traceback)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

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
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--budget", type=float, default=30.0, help="seconds of search (default 30)")
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
    m.add_argument("--time-cap", type=float, default=300.0)
    m.add_argument("--mem-cap", type=float, default=2.0, help="GiB")
    m.add_argument("--json", action="store_true")
    m.add_argument("--report-dir", default=None)

    pt = sub.add_parser("patches", help="measure bug-finding power on the bundled bug corpus")
    pt.add_argument("--target", choices=["impl", "vllm", "nanovllm"], default="impl")
    pt.add_argument("--seeds", type=int, default=10)
    pt.add_argument("--timeout", type=float, default=60.0)
    pt.add_argument("--jobs", type=int, default=None, help="worker processes (default: CPU count)")
    pt.add_argument("--only", help="comma-separated patch ids")
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
    if a.command == "diff":
        from kvspec.check.crosshair import cmd_diff
        return cmd_diff(a)
    raise UsageError("kvspec: choose a command: check, mc, patches, kernels, bench, diff (see kvspec --help)")


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

"""Field corpus of full checkouts: kvspec's engine level (and all levels) on public nano-vllm-style
engines, run as a stranger would (issue 36).

Why: the engine level drives a user's manager through the package's OWN Scheduler; only full
checkouts (scheduler, sequence, config and manager together) show whether kvspec reads them right.
The corpus is not ours: each checkout is a snapshot of a public repository (``fetch`` tool ->
bare git dir under /work/.mirror/owner+name/repo), unpacked to CORPUS/owner+name with
``git archive HEAD``. For each manifest entry the script runs, from the checkout's root,

    kvspec check --target FILE:CLASS --level LEVEL --max-examples N --seed 0 --json

for LEVEL in engine and all, and records the load result, each finding and the time. Classes are
by reading each repo's code (tools/field_checkouts_classes.json, keyed
"owner/name[/sub]@short:LEVEL:INVARIANT": {"class": "real bug" | "kvspec error" | "policy", "reason"}).

    python tools/field_checkouts.py --corpus /tmp/fc --unpack        # unpack mirrors, run, write
    python tools/field_checkouts.py --render-only                     # re-render after classifying
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
CLASSES = ROOT / "tools" / "field_checkouts_classes.json"
OUT_JSON = Path(os.environ.get("FC_JSON", ROOT / "reports" / "field-checkouts.json"))
OUT_MD = ROOT / "reports" / "field-checkouts.md"
MIRROR = Path("/work/.mirror")
LEVELS = ("engine", "all")

# (repo, sub-directory holding the engine inside the checkout ("" = root), manager file:class)
MANIFEST: list[tuple[str, str, str]] = [
    ("GeeeekExplorer/nano-vllm", "", "nanovllm/engine/block_manager.py:BlockManager"),
    ("AEM001/nano-vllm-1", "", "nanovllm/engine/block_manager.py:BlockManager"),
    ("CodingPlatelets/nano-vllm-v1", "", "nanovllm/engine/block_manager.py:BlockManager"),
    ("tang-jiapeng/nano-vllm-v1", "", "nanovllm/engine/block_manager.py:BlockManager"),
    ("ProIg-Chaa/nano-vllm-radix", "", "nanovllm/engine/block_manager.py:BlockManager"),
    ("jianzhnie/mini-vllm", "", "minivllm/engine/block_manager.py:BlockManager"),
    ("HuangRZzzz/nano-vllm-GPU-offload", "", "nanovllm/engine/block_manager.py:BlockManager"),
    ("Deng-XueCheng/llm-serving-resource-control", "", "nanovllm/engine/block_manager.py:BlockManager"),
    ("B1uee/micro-vLLM", "", "nanovllm/engine/block_manager.py:BlockManager"),
    ("Odysseusq/VLCache", "", "nanovllm/engine/block_manager.py:BlockManager"),
    ("Wenyueh/MinivLLM", "", "src/myvllm/engine/block_manager.py:BlockManager"),
    ("pzsacc/nano-vllm-lite", "nano_vllm/nano-vllm_chunked_prefill", "nanovllm/engine/block_manager.py:BlockManager"),
    ("pzsacc/nano-vllm-lite", "nano_vllm/nano-vllm_kvcompress", "nanovllm/engine/block_manager.py:BlockManager"),
    ("pzsacc/nano-vllm-lite", "nano_vllm/nano-vllm-full", "nanovllm/engine/block_manager.py:BlockManager"),
]


def mirror_of(repo: str) -> Path:
    return MIRROR / repo.replace("/", "+") / "repo"


def commit_of(repo: str) -> str:
    return subprocess.run(["git", "--git-dir", str(mirror_of(repo)), "rev-parse", "HEAD"],
                          capture_output=True, text=True).stdout.strip()


def unpack(repo: str, corpus: Path) -> None:
    dest = corpus / repo.replace("/", "+")
    if dest.is_dir():
        return
    dest.mkdir(parents=True)
    arch = subprocess.run(["git", "--git-dir", str(mirror_of(repo)), "archive", "HEAD"], capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=arch.stdout)


def key(repo: str, sub: str, commit: str) -> str:
    return f"{repo}{'/' + sub if sub else ''}@{commit[:7]}"


def run_one(repo: str, sub: str, target: str, level: str, corpus: Path, n: int, timeout: float) -> dict[str, Any]:
    cwd = corpus / repo.replace("/", "+") / sub
    cmd = [sys.executable, "-m", "kvspec", "check", "--target", target, "--level", level,
           "--max-examples", str(n), "--seed", "0", "--json", "--report-dir", f"/tmp/fcrep/{cwd.name}-{level}"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    t0 = time.time()
    try:
        p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"level": level, "result": "timeout", "seconds": round(time.time() - t0, 1)}
    rec: dict[str, Any] = {"level": level, "rc": p.returncode, "seconds": round(time.time() - t0, 1),
                           "stderr_tail": p.stderr.strip().splitlines()[-3:]}
    try:
        doc = json.loads(p.stdout)
    except json.JSONDecodeError:
        rec["result"] = "crash"
        return rec
    if doc.get("verdict") == "error" or p.returncode == 2:
        rec["result"], rec["error"] = "load error", doc.get("error")
    else:
        rec["result"] = "findings" if doc.get("violations") else "pass"
        rec["findings"] = [{"invariant": v.get("invariant"), "steps": len(v.get("steps") or v.get("repro", {}).get("steps", []) or []),
                            "message": (v.get("message") or "")[:400], "label": v.get("label")}
                           for v in doc.get("violations", [])]
        rec["examples"] = doc.get("examples")
    return rec


def render(doc: dict[str, Any], classes: dict[str, Any]) -> str:
    rows, n_find, n_real, n_engine_mis = [], 0, 0, 0
    for e in doc["entries"]:
        k = key(e["repo"], e["sub"], e["commit"])
        for r in e["runs"]:
            fs = r.get("findings") or []
            if not fs:
                what = r.get("error") or ""
                rows.append(f"| {e['repo']}{'/' + e['sub'] if e['sub'] else ''} | `{e['commit'][:7]}` | {r['level']} | "
                            f"{r['result']} ({r.get('seconds')} s) | {what[:200]} | — | — | "
                            f"{classes.get(k + ':' + r['level'] + ':load', {}).get('reason', '')} |")
            for f in fs:
                c = classes.get(f"{k}:{r['level']}:{f['invariant']}", {"class": "unclassified", "reason": ""})
                n_find += 1
                n_real += c["class"] == "real bug"
                n_engine_mis += r["level"] == "engine" and c["class"] == "kvspec error"
                rows.append(f"| {e['repo']}{'/' + e['sub'] if e['sub'] else ''} | `{e['commit'][:7]}` | {r['level']} | "
                            f"findings ({r.get('seconds')} s) | {f['invariant']}: {f['message'][:160]} | {f.get('label') or '—'} | "
                            f"{c['class']} | {c['reason']} |")
    head = [f"Runner: `{doc['command']}` ({doc['when']}, kvspec HEAD `{doc['head']}`).", "",
            f"- findings: {n_find}; real bugs: {n_real}; engine-level kvspec misreadings: {n_engine_mis}",
            f"- first-run precision (both levels): {n_real}/{n_find}" + (f" = {100 * n_real / n_find:.0f}%" if n_find else ""), "",
            "| repository | commit | level | result | finding / error | kvspec's label | class | reason |",
            "|---|---|---|---|---|---|---|---|"]
    return "\n".join(head + rows) + "\n"


def merged(files: list[Path]) -> dict[str, Any]:
    """One document from runs written separately (one level each, run side by side)."""
    docs = [json.loads(f.read_text()) for f in files]
    out = {k: docs[0][k] for k in ("command", "when", "head")}
    out["command"] = " ; ".join(d["command"] for d in docs)
    by: dict[tuple, dict] = {}
    for d in docs:
        for e in d["entries"]:
            k = (e["repo"], e["sub"])
            if k in by:
                by[k]["runs"] += e["runs"]
            else:
                by[k] = dict(e, runs=list(e["runs"]))
    out["entries"] = list(by.values())
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, default=Path("/tmp/fc"))
    ap.add_argument("--unpack", action="store_true")
    ap.add_argument("--only", default="")
    ap.add_argument("--levels", default=",".join(LEVELS))
    ap.add_argument("--max-examples", type=int, default=50)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--render-only", action="store_true")
    ap.add_argument("--merge", nargs="*", default=[], help="with --render-only: run files (one per level) to merge")
    ap.add_argument("--table-out", type=Path, default=Path("/tmp/field-checkouts-table.md"))
    a = ap.parse_args(argv)
    classes = json.loads(CLASSES.read_text()) if CLASSES.is_file() else {}
    if a.render_only:
        a.table_out.write_text(render(merged([Path(f) for f in a.merge] or [OUT_JSON]), classes))
        return 0
    old = json.loads(OUT_JSON.read_text()) if OUT_JSON.is_file() else {"entries": []}
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    doc = {"command": " ".join(["python", "tools/field_checkouts.py", *(argv if argv is not None else sys.argv[1:])]),
           "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "head": head,
           "entries": [e for e in old["entries"] if a.only and a.only not in e["repo"] + "/" + e["sub"]]}
    for repo, sub, target in MANIFEST:
        if a.only and a.only not in repo + "/" + sub:
            continue
        if a.unpack:
            unpack(repo, a.corpus)
        entry = {"repo": repo, "sub": sub, "target": target, "commit": commit_of(repo), "runs": []}
        for level in a.levels.split(","):
            entry["runs"].append(run_one(repo, sub, target, level, a.corpus, a.max_examples, a.timeout))
            print(repo, sub, level, entry["runs"][-1].get("result"), entry["runs"][-1].get("seconds"), flush=True)
        doc["entries"].append(entry)
        OUT_JSON.write_text(json.dumps(doc, indent=1))
    a.table_out.write_text(render(doc, classes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

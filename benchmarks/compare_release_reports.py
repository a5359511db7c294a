"""Compare two ``tools/vllm_releases.py`` reports (``vllm-releases.json``) release by
release and pass by pass: the verdict, the findings (invariant and minimal steps) and,
where both runs used the same code, the examples and steps searched.

    python benchmarks/compare_release_reports.py A.json B.json [--strict]

``--strict`` also compares examples and steps (deterministic runs of the same commit by
two paths, e.g. the script and ``--campaign``). Exit 1 when anything compared differs."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _passes(path: Path) -> dict[tuple[str, str], dict]:
    doc = json.loads(path.read_text())
    out = {}
    for r in doc["releases"]:
        if not r.get("drivable"):
            out[(r["version"], "-")] = {"verdict": "not drivable"}
        for p in r.get("passes", []):
            out[(r["version"], p["name"])] = p
    return out


def _findings(p: dict) -> list:
    return sorted((f["invariant"], json.dumps(f.get("steps"), sort_keys=True))
                  for f in p.get("violations", []) + p.get("robustness", []))


def compare(a: Path, b: Path, strict: bool) -> int:
    pa, pb = _passes(a), _passes(b)
    keys = sorted(set(pa) | set(pb), key=lambda k: ([int(x) if x.isdigit() else x for x in k[0].replace("post", ".").split(".")], k[1]))
    same = differ = 0
    for k in keys:
        x, y = pa.get(k), pb.get(k)
        what = []
        if x is None or y is None:
            what.append("only in " + (b.name if x is None else a.name))
        else:
            if x.get("verdict") != y.get("verdict"):
                what.append(f"verdict {x.get('verdict')} / {y.get('verdict')}")
            if _findings(x) != _findings(y):
                what.append(f"findings {[f[0] for f in _findings(x)]} / {[f[0] for f in _findings(y)]}")
            if strict:
                for field in ("examples", "steps"):
                    if x.get(field) != y.get(field):
                        what.append(f"{field} {x.get(field)} / {y.get(field)}")
        if what:
            differ += 1
            print(f"{k[0]} [{k[1]}]: " + "; ".join(what))
        else:
            same += 1
    print(f"{same} of {same + differ} (release, pass) rows identical"
          f"{' in verdict, findings, examples and steps' if strict else ' in verdict and findings'}; {differ} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--strict", action="store_true")
    args = ap.parse_args()
    sys.exit(compare(args.a, args.b, args.strict))

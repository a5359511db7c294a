"""Figures for the reports, drawn with matplotlib's Agg canvas (no display, and the
global pyplot backend is left alone).

Each helper takes plain rows (dicts, as the benchmarks and ``--json`` outputs hold
them) and a path, writes a PNG there, and returns the path:

* ``states_per_second_vs_depth(rows, path)``: ``kvspec mc`` throughput against the
  depth bound; rows with ``depth`` and ``states_per_second`` (optionally
  ``transitions_per_second``), one line per ``level``/``blocks`` group;
* ``ttf_per_bug(rows, path)``: time to failure per corpus bug; rows with a name
  (``bug``, ``patch``, ``id`` or ``name``) and seconds (``seconds_to_failure``,
  ``seconds`` or ``ttf``: one number, a list of per-seed numbers, or None for a
  bug that was not found), one horizontal bar (the median) per bug with the seeds
  as dots and the missed ones marked;
* ``bandwidth_vs_context(rows, path)``: kernel bandwidth against context length;
  rows with ``context`` (or ``seq_len``/``context_len``) and ``gbps`` (or
  ``bandwidth_gbps``/``bandwidth``), one line per ``label``/``dtype``/``kernel``,
  and an optional ``peak_gbps`` keyword drawn as a dashed line;
* ``check_cost_vs_pool_size(rows, path)``: microseconds per step against pool size,
  checked and unchecked (``benchmarks/bench_check_cost.py``).
"""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

from kvspec.atomic_write import replacing

Row = Mapping[str, Any]


def _figure(width: float = 6.4, height: float = 4.0):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=120)
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot(1, 1, 1)


def _save(fig, path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    with replacing(p) as tmp:
        fig.savefig(tmp, format="png")
    return p


def _first(row: Row, keys: Sequence[str], default: Any = None) -> Any:
    for k in keys:
        if k in row and row[k] is not None:
            return row[k]
    return default


def _groups(rows: Iterable[Row], keys: Sequence[str]) -> dict[str, list[Row]]:
    out: dict[str, list[Row]] = {}
    for r in rows:
        parts = [f"{k} {r[k]}" if k == "blocks" else str(r[k]) for k in keys if r.get(k) is not None]
        out.setdefault(", ".join(parts) or "all", []).append(r)
    return out


def states_per_second_vs_depth(rows: Sequence[Row], path: str | Path, title: Optional[str] = None) -> Path:
    """States (and transitions, where given) per second against the depth bound."""
    fig, ax = _figure()
    rows = [r for r in rows if r.get("depth") is not None and r.get("states_per_second") is not None]
    if not rows:
        raise ValueError("states_per_second_vs_depth: no row has depth and states_per_second")
    for label, group in sorted(_groups(rows, ("level", "blocks")).items()):
        group = sorted(group, key=lambda r: r["depth"])
        line, = ax.plot([r["depth"] for r in group], [r["states_per_second"] for r in group], marker="o",
                        label=f"{label}: states/s")
        if all(r.get("transitions_per_second") is not None for r in group):
            ax.plot([r["depth"] for r in group], [r["transitions_per_second"] for r in group], marker="x",
                    linestyle="--", color=line.get_color(), label=f"{label}: transitions/s")
    ax.set_yscale("log")
    ax.set_xlabel("depth bound (steps)")
    ax.set_ylabel("per second (log scale)")
    ax.set_title(title or "kvspec mc: throughput against depth")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def _seconds(row: Row) -> list[Optional[float]]:
    v = _first(row, ("seconds_to_failure", "seconds", "ttf"))
    if isinstance(v, (list, tuple)):
        return [None if x is None else float(x) for x in v]
    return [None if v is None else float(v)]


def ttf_per_bug(rows: Sequence[Row], path: str | Path, title: Optional[str] = None,
                timeout: Optional[float] = None) -> Path:
    """Median time to failure per bug (bars, log scale), each seed a dot; a bug
    missed by every seed is drawn at ``timeout`` (or the largest time) and marked."""
    if not rows:
        raise ValueError("ttf_per_bug: no rows")
    data = []
    for r in rows:
        name = str(_first(r, ("bug", "patch", "id", "name"), "?"))
        secs = _seconds(r)
        found = [s for s in secs if s is not None]
        data.append((name, found, len(secs) - len(found)))
    everything = [s for _, f, _ in data for s in f]
    cap = timeout or (max(everything) * 2 if everything else 1.0)
    data.sort(key=lambda d: statistics.median(d[1]) if d[1] else float("inf"))
    fig, ax = _figure(6.4, max(2.5, 0.28 * len(data) + 1.2))
    ys = list(range(len(data)))
    floor = max(min(everything) / 2, 1e-4) if everything else 1e-3
    for y, (name, found, missed) in zip(ys, data):
        if found:
            ax.barh(y, statistics.median(found) - floor, left=floor, color="tab:blue", alpha=0.6)
            ax.scatter(found, [y] * len(found), s=8, color="tab:blue", zorder=3)
        if missed:
            ax.scatter([cap], [y], marker="x", color="tab:red", zorder=3)
            ax.annotate(f"missed {missed}", (cap, y), xytext=(4, -3), textcoords="offset points", fontsize=6,
                        color="tab:red")
    ax.set_yticks(ys)
    ax.set_yticklabels([d[0] for d in data], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("seconds to failure (log scale; bar: median over seeds, dots: seeds, x: missed)")
    ax.set_title(title or "time to failure per bug")
    ax.grid(True, axis="x", which="both", alpha=0.3)
    return _save(fig, path)


def bandwidth_vs_context(rows: Sequence[Row], path: str | Path, title: Optional[str] = None,
                         peak_gbps: Optional[float] = None) -> Path:
    """Achieved bandwidth (GB/s) against context length, one line per series."""
    pts = []
    for r in rows:
        ctx = _first(r, ("context", "context_len", "seq_len", "context_length"))
        bw = _first(r, ("gbps", "bandwidth_gbps", "bandwidth"))
        if ctx is not None and bw is not None:
            pts.append({**r, "_x": float(ctx), "_y": float(bw)})
    if not pts:
        raise ValueError("bandwidth_vs_context: no row has a context length and a bandwidth")
    fig, ax = _figure()
    key = next((k for k in ("label", "dtype", "kernel", "series") if any(k in p for p in pts)), None)
    for label, group in sorted(_groups(pts, (key,) if key else ()).items()):
        group = sorted(group, key=lambda p: p["_x"])
        ax.plot([p["_x"] for p in group], [p["_y"] for p in group], marker="o", label=label)
    if peak_gbps:
        ax.axhline(peak_gbps, linestyle="--", color="gray", label=f"peak {peak_gbps:g} GB/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens, log scale)")
    ax.set_ylabel("bandwidth (GB/s)")
    ax.set_title(title or "paged attention: bandwidth against context length")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def check_cost_vs_pool_size(rows: Sequence[Row], path: str | Path, title: Optional[str] = None) -> Path:
    """Microseconds per step against pool size (log-log): the rows of
    ``benchmarks/bench_check_cost.py`` (``blocks``, ``us_per_step``,
    ``unchecked_us_per_step``, optionally ``full_path_us_per_step``)."""
    rows = sorted((r for r in rows if r.get("blocks") and r.get("us_per_step")), key=lambda r: r["blocks"])
    if not rows:
        raise ValueError("check_cost_vs_pool_size: no row has blocks and us_per_step")
    fig, ax = _figure()
    series = (("us_per_step", "checked (as kvspec check runs)", "o", "-"),
              ("full_path_us_per_step", "checked, full path", "s", ":"),
              ("unchecked_us_per_step", "target only, nothing checked", "x", "--"))
    for key, label, marker, style in series:
        pts = [(r["blocks"], r[key]) for r in rows if r.get(key) is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, linestyle=style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("pool size (blocks, log scale)")
    ax.set_ylabel("microseconds per step (log scale)")
    ax.set_title(title or "cost of a checked step against pool size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)

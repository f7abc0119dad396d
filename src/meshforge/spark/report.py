"""The audit report: ``audit.json`` and a self-contained ``audit.html`` (inline SVG, no network).

Example::

    json_path, html_path = write_report(findings, "out/report")
"""

from __future__ import annotations

import html
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

__all__ = ["render_html", "write_report"]

_W, _H, _PAD = 640, 220, 36
_COLORS = ("#3366cc", "#dc3912", "#ff9900", "#109618", "#990099", "#0099c6")


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:,.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return "-" if value is None else str(value)


def _frame(body: str, title: str) -> str:
    return (
        f'<svg viewBox="0 0 {_W} {_H}" width="100%" role="img" aria-label="{_e(title)}">'
        f'<line x1="{_PAD}" y1="{_H - _PAD}" x2="{_W - 8}" y2="{_H - _PAD}" stroke="#888"/>'
        f'<line x1="{_PAD}" y1="8" x2="{_PAD}" y2="{_H - _PAD}" stroke="#888"/>{body}</svg>'
    )


def histogram_svg(bins: list[list[float]], title: str = "latency (ms)") -> str:
    """Bars of ``[low, high, count]`` bins."""
    if not bins:
        return "<p class=muted>no data</p>"
    top = max(int(b[2]) for b in bins) or 1
    step = (_W - _PAD - 12) / len(bins)
    bars = []
    for i, (low, high, count) in enumerate(bins):
        h = (int(count) / top) * (_H - _PAD - 16)
        x = _PAD + 2 + i * step
        bars.append(
            f'<rect x="{x:.1f}" y="{_H - _PAD - h:.1f}" width="{max(step - 2, 1):.1f}" height="{h:.1f}" '
            f'fill="{_COLORS[0]}"><title>{low:.1f}-{high:.1f} ms: {int(count)}</title></rect>'
        )
    labels = [
        f'<text x="{_PAD + 2 + i * step:.1f}" y="{_H - _PAD + 14}" font-size="10">{bins[i][0]:.0f}</text>'
        for i in range(0, len(bins), max(1, len(bins) // 6))
    ]
    labels.append(f'<text x="2" y="16" font-size="10">{top}</text>')
    return _frame("".join(bars + labels), title)


def timeline_svg(
    points: list[dict[str, Any]], series: tuple[str, ...] = ("events", "dead_letters")
) -> str:
    """One polyline per series over the minutes of ``points``."""
    if not points:
        return "<p class=muted>no data</p>"
    top = max(max(int(p.get(s, 0)) for p in points) for s in series) or 1
    n = len(points)
    xs = [_PAD + 4 + (i * (_W - _PAD - 16) / max(n - 1, 1)) for i in range(n)]
    parts = []
    for color, name in zip(_COLORS, series, strict=False):
        ys = [_H - _PAD - int(p.get(name, 0)) / top * (_H - _PAD - 16) for p in points]
        coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in zip(xs, ys, strict=True))
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{coords}"/>')
        parts += (
            [
                f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{color}"/>'
                for x, y in zip(xs, ys, strict=True)
            ]
            if n < 60
            else []
        )
    legend = "".join(
        f'<text x="{_W - 150}" y="{18 + 14 * i}" font-size="11" fill="{c}">&#9632; {_e(s)}</text>'
        for i, (c, s) in enumerate(zip(_COLORS, series, strict=False))
    )
    first, last = points[0]["minute"][:16], points[-1]["minute"][:16]
    axis = (
        f'<text x="{_PAD}" y="{_H - 8}" font-size="10">{_e(first)}</text>'
        f'<text x="{_W - 120}" y="{_H - 8}" font-size="10">{_e(last)}</text>'
        f'<text x="2" y="16" font-size="10">{top}</text>'
    )
    return _frame("".join(parts) + legend + axis, "counts per minute")


def hbars_svg(counts: dict[str, int], title: str) -> str:
    """Horizontal bars, one per key."""
    if not counts:
        return "<p class=muted>none</p>"
    items = list(counts.items())[:12]
    top = max(v for _, v in items) or 1
    height = 26 * len(items) + 10
    rows = []
    for i, (name, value) in enumerate(items):
        w = value / top * (_W - 270)  # room after the longest bar for its count
        y = 6 + i * 26
        rows.append(
            f'<text x="4" y="{y + 15}" font-size="12">{_e(name)[:28]}</text>'
            f'<rect x="190" y="{y}" width="{w:.1f}" height="20" fill="{_COLORS[i % len(_COLORS)]}"/>'
            f'<text x="{196 + w:.1f}" y="{y + 15}" font-size="12">{value}</text>'
        )
    return f'<svg viewBox="0 0 {_W} {height}" width="100%" role="img" aria-label="{_e(title)}">{"".join(rows)}</svg>'


def _table(rows: list[dict[str, Any]], empty: str) -> str:
    if not rows:
        return f"<p class=good>{_e(empty)}</p>"
    cols = list(rows[0].keys())
    head = "".join(f"<th>{_e(c)}</th>" for c in cols)
    body = "".join(
        "<tr>" + "".join(f"<td>{_e(_fmt(r.get(c)))}</td>" for c in cols) + "</tr>" for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _kv(items: dict[str, Any]) -> str:
    return (
        "<table>"
        + "".join(f"<tr><th>{_e(k)}</th><td>{_e(_fmt(v))}</td></tr>" for k, v in items.items())
        + "</table>"
    )


_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;background:#f6f7f9;color:#1d2330}
header{padding:22px 32px;color:#fff}header.ok{background:#1e7a46}header.bad{background:#b3261e}
h1{margin:0;font-size:22px}h2{font-size:16px;margin:0 0 10px}main{padding:20px 32px;display:grid;
grid-template-columns:repeat(auto-fit,minmax(420px,1fr));gap:18px}section{background:#fff;border-radius:8px;
padding:16px 18px;box-shadow:0 1px 3px rgba(0,0,0,.08)}.kpis{display:flex;gap:14px;flex-wrap:wrap;padding:16px 32px 0}
.kpi{background:#fff;border-radius:8px;padding:10px 16px;min-width:120px;box-shadow:0 1px 3px rgba(0,0,0,.08)}
.kpi b{display:block;font-size:22px}.kpi.bad b{color:#b3261e}table{border-collapse:collapse;width:100%;font-size:12px}
td,th{border-bottom:1px solid #e3e6ea;padding:4px 6px;text-align:left;vertical-align:top;word-break:break-all}
.good{color:#1e7a46}.muted{color:#777}footer{padding:8px 32px 24px;color:#777;font-size:12px}
"""


def render_html(findings: dict[str, Any]) -> str:
    """The report page: verdict, key figures, plots and the findings, in one file."""
    ok = bool(findings.get("ok"))
    c = findings.get("counts", {})
    lat = findings.get("latency_ms", {})
    dl = findings.get("dead_letters", {})
    v = findings.get("violations", {})
    kpis = [
        ("events", c.get("events"), False), ("effects in the store", c.get("effects"), False),
        ("commands landed", c.get("commands"), False),
        ("duplicate effects", c.get("duplicate_effects"), bool(c.get("duplicate_effects"))),
        ("doubled outputs", c.get("doubled_outputs"), bool(c.get("doubled_outputs"))),
        ("missing effects", c.get("missing_effects"), bool(c.get("missing_effects"))),
        ("lost outputs", c.get("lost_outputs"), bool(c.get("lost_outputs"))),
        ("dead letters", dl.get("total"), False), ("p50 latency ms", lat.get("p50"), False),
        ("p99 latency ms", lat.get("p99"), False),
    ]  # fmt: skip
    kpi_html = "".join(
        f'<div class="kpi{" bad" if bad else ""}"><b>{_e(_fmt(val))}</b>{_e(name)}</div>'
        for name, val, bad in kpis
    )
    verdict = "Exactly-once holds" if ok else "Exactly-once VIOLATED"
    latency_rows = {k: lat.get(k) for k in ("count", "min", "p50", "p90", "p99", "max", "mean")}
    if "processing" in lat:
        latency_rows.update({f"handler {k}": val for k, val in lat["processing"].items()})
    notes = "".join(f"<p class=muted>{_e(n)}</p>" for n in findings.get("notes", []))
    sections = [
        (
            "End-to-end latency (stored time minus the command's ts)",
            histogram_svg(lat.get("histogram", [])) + _kv(latency_rows),
        ),
        ("Events and dead letters per minute", timeline_svg(findings.get("timeline", []))),
        ("Dead letters by reason", hbars_svg(dl.get("by_reason", {}), "dead letters by reason")),
        (
            "Dead letters by subject",
            _kv(dl.get("by_subject", {})) if dl.get("by_subject") else "<p class=muted>none</p>",
        ),
        (
            "Duplicate effects",
            _table(v.get("duplicate_effects", []), "none: every output landed under one id"),
        ),
        (
            "Doubled outputs (one id stored as several stream messages)",
            _table(v.get("doubled_outputs", []), "none: every output is stored once"),
        ),
        (
            "Commands without an effect (not dead-lettered)",
            _table(v.get("missing_effects", []), "none") + notes,
        ),
        (
            "Lost outputs (stored, marked published, never landed)",
            _table(v.get("lost_outputs", []), "none"),
        ),
        ("Redeliveries", _kv(findings.get("redeliveries", {}))),
        ("Events by type", hbars_svg(c.get("events_by_type", {}), "events by type")),
        ("Dead letter examples", _table(dl.get("examples", []), "none")),
    ]
    body = "".join(f"<section><h2>{_e(t)}</h2>{h}</section>" for t, h in sections)
    generated = findings.get("generated_at", "")
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        f"<title>MeshForge audit: {_e(verdict)}</title><style>{_CSS}</style></head><body>"
        f'<header class="{"ok" if ok else "bad"}"><h1>MeshForge audit: {_e(verdict)}</h1>'
        f"<div>{_e(generated)}</div></header><div class=kpis>{kpi_html}</div><main>{body}</main>"
        f"<footer>inputs: {_e(json.dumps(findings.get('inputs', {})))}</footer></body></html>"
    )


def write_report(findings: dict[str, Any], output_dir: str | Path) -> tuple[Path, Path]:
    """Write ``audit.json`` and ``audit.html`` into ``output_dir``; returns both paths."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    findings.setdefault("generated_at", datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
    json_path, html_path = out / "audit.json", out / "audit.html"
    json_path.write_text(
        json.dumps(findings, indent=2, default=str, sort_keys=False) + "\n", encoding="utf-8"
    )
    html_path.write_text(render_html(findings), encoding="utf-8")
    return json_path, html_path

"""The pieces of batchinfer's HTML pages that more than one page uses (the job report,
app/job_report.py, and the history page, app/history_page.py): the stylesheet, the level colours,
escaping, how a number is shown, and tables whose cells are escaped unless marked :class:`Raw`.
Pure: text in, text out.
"""
from __future__ import annotations

import html
import math
from typing import Any, Iterable, Sequence

COLORS = {"ok": "#2e7d32", "warn": "#ef6c00", "fail": "#c62828", "none": "#607d8b"}

CSS = """
body{font-family:-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;margin:0;background:#f5f6f8;color:#1d232b}
header{background:#1d2b3a;color:#fff;padding:18px 28px}header h1{margin:0;font-size:22px}
header .sub{opacity:.8;font-size:13px;margin-top:4px}
main{padding:18px 28px;max-width:1180px}
section{background:#fff;border-radius:8px;padding:14px 18px;margin:0 0 16px;box-shadow:0 1px 2px rgba(0,0,0,.08)}
h2{font-size:16px;margin:0 0 10px}table{border-collapse:collapse;font-size:13px;width:100%}
th,td{text-align:left;padding:4px 8px;border-bottom:1px solid #e3e6ea}th{background:#f0f2f5}
td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}
.cards{display:flex;gap:10px;flex-wrap:wrap}.card{background:#fff;border-radius:8px;padding:10px 14px;
min-width:110px;box-shadow:0 1px 2px rgba(0,0,0,.08)}.card b{display:block;font-size:20px}
.card span{font-size:12px;color:#5b6570}.pill{color:#fff;border-radius:10px;padding:1px 8px;font-size:12px}
.card b .pill{color:#fff;font-size:16px;padding:2px 12px;display:inline-block;margin-bottom:2px}
.grid{display:flex;flex-wrap:wrap;gap:14px}.grid figure{margin:0}figcaption{font-size:12px;color:#5b6570}
.muted{color:#5b6570;font-size:13px}code{font-size:12px}
"""


def escape(value: Any) -> str:
    return html.escape(str(value), quote=True)


def number(value: Any, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    if isinstance(value, float):
        if value == int(value) and abs(value) < 1e15 or abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.{digits}g}"
    if isinstance(value, int):
        return f"{value:,}"
    return escape(value)


class Raw(str):
    """Markup made here, put into a table cell as it is (every other cell is escaped)."""


def pill(level: str) -> Raw:
    return Raw(f'<span class="pill" style="background:{COLORS.get(level, "#607d8b")}">{escape(level)}</span>')


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], numeric: Sequence[int] = ()) -> str:
    head = "".join(f'<th class="n">{escape(h)}</th>' if i in numeric else f"<th>{escape(h)}</th>"
                   for i, h in enumerate(headers))
    body = []
    for row in rows:
        cells = []
        for i, cell in enumerate(row):
            if isinstance(cell, Raw):
                text = str(cell)
            else:
                text = number(cell) if i in numeric else escape(cell if cell is not None else "–")
            cells.append(f'<td class="n">{text}</td>' if i in numeric else f"<td>{text}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"

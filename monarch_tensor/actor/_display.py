"""Rich displays for Jupyter (``_repr_html_``): a value mesh, a proc or host mesh, a mesh tensor or a global
sharded tensor, each as a table with one row per rank (or shard). Nothing here reads a value from the workers:
a display never synchronises."""

from __future__ import annotations

import html

MAX_ROWS = 64  # ranks shown; the rest are counted
MAX_CELL = 200  # characters of a value's repr


def table(title: str, header: list[str], rows: list[list], total: int | None = None) -> str:
    """An HTML table under a one-line title; cells are escaped (a value's repr may hold markup)."""
    def cell(v) -> str:
        text = v if isinstance(v, str) else repr(v)
        if len(text) > MAX_CELL:
            text = text[:MAX_CELL] + "…"
        return f"<td style='text-align:left'><code>{html.escape(text)}</code></td>"

    shown = rows[:MAX_ROWS]
    out = [f"<div><b>{html.escape(title)}</b>", "<table>",
           "<tr>" + "".join(f"<th style='text-align:left'>{html.escape(h)}</th>" for h in header) + "</tr>"]
    out += ["<tr>" + "".join(cell(v) for v in row) + "</tr>" for row in shown]
    out.append("</table>")
    n = len(rows) if total is None else total
    if n > len(shown):
        out.append(f"<i>… {n - len(shown)} more</i>")
    out.append("</div>")
    return "\n".join(out)


def coords(shape, rank_index: int) -> list:
    """The coordinates of the ``rank_index``-th point of ``shape``, one per dim."""
    point = shape.point(rank_index)
    return [point[n] for n in shape.names]

"""The docs' figures, generated from recorded benchmark runs.

A run is recorded as ``docs/figures/NAME.json``: the command, when and at which commit it ran, the machine's
CPUs and load average at its start and end, and every markdown table it printed::

    python bench/figures.py record train -- python bench/train_bench.py --fused --runs 2

A page shows a record in a block that ``render`` writes (the provenance line, the tables, and a bar chart of the
ratio columns, ``docs/figures/NAME.svg``); the text between the markers is generated, never edited::

    <!-- figure: train -->
    <!-- /figure -->

    python bench/figures.py render            # rewrite the blocks and charts
    python bench/figures.py render --check    # exit 1, naming them, where a block or chart is out of date

A run made before it could be recorded (its printed output kept in a file) is recorded from that output, with
what is known of it: ``record NAME --from-output FILE --date ... --commit ... --load A B -- COMMAND``.
"""

from __future__ import annotations

import argparse
import datetime
import html
import json
import os
import re
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDS = os.path.join(ROOT, "docs", "figures")
PAGES = os.path.join(ROOT, "docs")
BLOCK = re.compile(r"(<!-- figure: ([\w.-]+) -->\n)(.*?)(<!-- /figure -->)", re.S)
RATIO_CELL = re.compile(r"^(\d+(?:\.\d+)?)x$")


def tables(output: str) -> list[list[str]]:
    """The markdown tables in a bench's printed output: each a list of its lines, cells stripped of padding."""
    found: list[list[str]] = []
    current: list[str] = []
    for line in [*output.splitlines(), ""]:
        s = line.strip()
        if s.startswith("|") and s.endswith("|") and len(s) > 1:
            current.append("| " + " | ".join(c.strip() for c in s[1:-1].split("|")) + " |")
            continue
        if len(current) >= 3 and set(current[1].replace("|", "").replace(" ", "")) <= set("-:"):
            current[1] = "| " + " | ".join("---" for _ in _cells(current[0])) + " |"
            found.append(current)
        current = []
    return found


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip()[1:-1].split("|")]


def _git_commit() -> str:
    try:
        rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=30, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return rev + ("+changes" if dirty else "")


def record(name: str, command: list[str], from_output: str | None = None, date: str | None = None,
           commit: str | None = None, load: tuple[float, float] | None = None, directory: str = RECORDS,
           timeout: float | None = None) -> dict:
    """Run ``command`` from the repository's root (its output passes through) and record it as ``NAME.json``;
    or, with ``from_output``, record the output a past run printed. A run that fails, or prints no table, is
    not recorded."""
    if not re.fullmatch(r"[\w.-]+", name):
        raise ValueError(f"a figure's name is letters, digits, '.', '_' and '-': got {name!r}")
    if not command:
        raise ValueError("record needs the bench's command after '--'")
    if from_output is not None:
        if date is None or commit is None or load is None:
            raise ValueError("a run recorded from its output needs --date, --commit and --load (what was known "
                             "of it when it ran)")
        with open(from_output) as f:
            output = f.read()
    else:
        if date is not None or commit is not None or load is not None:
            raise ValueError("--date, --commit and --load describe a past run (--from-output); a run recorded "
                             "now takes them from this machine")
        load0 = os.getloadavg()[0]
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        commit = _git_commit()
        proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines = []
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                sys.stdout.write(line)
                lines.append(line)
            rc = proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
        if rc != 0:
            raise RuntimeError(f"{shlex.join(command)} exited with {rc}: nothing recorded")
        output = "".join(lines)
        load = (load0, os.getloadavg()[0])
    found = tables(output)
    if not found:
        raise RuntimeError(f"{shlex.join(command)} printed no markdown table: nothing recorded")
    rec = {"name": name, "command": shlex.join(command), "date": date, "commit": commit, "cpus": os.cpu_count(),
           "load": [round(load[0], 2), round(load[1], 2)], "tables": found}
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, name + ".json"), "w") as f:
        json.dump(rec, f, indent=1)
        f.write("\n")
    return rec


def chart(rec: dict) -> str | None:
    """An SVG bar chart of the first table's ratio columns (cells such as ``1.62x``), one bar per row and column,
    with a line at 1x; None when the table has no ratio column."""
    rows = [_cells(line) for line in rec["tables"][0]]
    head, body = rows[0], rows[2:]
    cols = [i for i in range(1, len(head)) if any(i < len(r) and RATIO_CELL.match(r[i]) for r in body)]
    # ("/ torchrun" after "CPU ms" reads "CPU ms / torchrun")
    label = {i: f"{head[i - 1]} {head[i]}" if head[i].startswith("/") else head[i] for i in cols}
    bars = [(r[0], i, float(RATIO_CELL.match(r[i]).group(1)))  # type: ignore[union-attr]
            for r in body for i in cols if i < len(r) and RATIO_CELL.match(r[i])]
    if not bars:
        return None
    top = max(2.0, max(v for _, _, v in bars) * 1.1)
    label_w, bar_w, row_h, pad = 330, 360, 18, 6
    width, height = label_w + bar_w + 60, pad * 2 + row_h * (len(bars) + 1)

    def x(v: float) -> float:
        return label_w + v / top * bar_w

    colours = ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="11">']
    for n, (row, col, v) in enumerate(bars):
        y = pad + n * row_h
        out.append(f'<text x="{label_w - 6}" y="{y + 12}" text-anchor="end">{html.escape(row)} '
                   f'({html.escape(label[col])})</text>')
        out.append(f'<rect x="{label_w}" y="{y + 3}" width="{x(v) - label_w:.1f}" height="{row_h - 6}" '
                   f'fill="{colours[cols.index(col) % len(colours)]}"/>')
        out.append(f'<text x="{x(v) + 4:.1f}" y="{y + 12}">{v:g}x</text>')
    y_end = pad + len(bars) * row_h
    out.append(f'<line x1="{x(1.0):.1f}" y1="{pad}" x2="{x(1.0):.1f}" y2="{y_end}" stroke="#333" '
               f'stroke-dasharray="3,2"/>')
    out.append(f'<text x="{x(1.0):.1f}" y="{y_end + 13}" text-anchor="middle">1x</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def block(rec: dict, page_dir: str, directory: str = RECORDS) -> str:
    """The generated text of a page's block for ``rec``."""
    load = rec["load"]
    text = [f"`{rec['command']}` on {rec['date']}, at commit {rec['commit']}, on {rec['cpus']} CPUs; load average "
            f"{load[0]:g} at the start and {load[1]:g} at the end (generated from `docs/figures/{rec['name']}.json` "
            f"by `python bench/figures.py render`):", ""]
    for t in rec["tables"]:
        text += [*t, ""]
    if chart(rec) is not None:
        rel = os.path.relpath(os.path.join(directory, rec["name"] + ".svg"), page_dir)
        text += [f"![the ratio columns of {rec['name']}, as bars]({rel})", ""]
    return "\n".join(text)


def render(check: bool = False, pages: str = PAGES, directory: str = RECORDS) -> list[str]:
    """Rewrite every figure block of the docs' pages, and every chart, from the records (``check``: change
    nothing). Returns what was (or, with ``check``, would be) rewritten; a block naming no record is an error."""
    stale: list[str] = []
    charts: dict[str, str | None] = {}
    for page in sorted(os.listdir(pages)):
        if not page.endswith(".md"):
            continue
        path = os.path.join(pages, page)
        with open(path) as f:
            text = f.read()

        def fill(m: re.Match, path: str = path) -> str:
            name = m.group(2)
            try:
                with open(os.path.join(directory, name + ".json")) as f:
                    rec = json.load(f)
            except FileNotFoundError:
                raise FileNotFoundError(f"{path}: the figure block {name!r} has no record "
                                        f"{os.path.join(directory, name + '.json')}") from None
            charts[name] = chart(rec)
            return m.group(1) + block(rec, pages, directory) + m.group(4)

        new = BLOCK.sub(fill, text)
        if new != text:
            stale.append(path)
            if not check:
                with open(path, "w") as f:
                    f.write(new)
    for name, svg in sorted(charts.items()):
        svg_path = os.path.join(directory, name + ".svg")
        old = open(svg_path).read() if os.path.exists(svg_path) else None
        if svg is not None and old != svg:
            stale.append(svg_path)
            if not check:
                with open(svg_path, "w") as f:
                    f.write(svg)
    return stale


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, command = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    rec = sub.add_parser("record", help="run a bench (the command after '--') and record it as NAME")
    rec.add_argument("name")
    rec.add_argument("--from-output", help="record the output a past run printed, kept in this file")
    rec.add_argument("--date", help="of a past run: when it ran (e.g. '2026-11-29 15:34 UTC')")
    rec.add_argument("--commit", help="of a past run: the commit it ran at")
    rec.add_argument("--load", nargs=2, type=float, metavar=("START", "END"),
                     help="of a past run: the load average at its start and end")
    ren = sub.add_parser("render", help="rewrite the docs' figure blocks and charts from the records")
    ren.add_argument("--check", action="store_true", help="change nothing; exit 1 where something is out of date")
    args = ap.parse_args(argv)
    if args.what == "record":
        r = record(args.name, command, args.from_output, args.date, args.commit,
                   tuple(args.load) if args.load else None)
        print(f"recorded {len(r['tables'])} table(s) as docs/figures/{args.name}.json; "
              f"`python bench/figures.py render` puts them in the docs")
        return 0
    if command:
        ap.error("render takes no command")
    stale = render(check=args.check)
    for path in stale:
        print(("out of date: " if args.check else "rewrote ") + os.path.relpath(path, ROOT))
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())

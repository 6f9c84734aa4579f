"""How the benchmarks report results: a Markdown table, a fixed-width text table of
figures against their targets, one figure formatted with a mark where it is missing, and
the JSON file of every figure."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path


def fmt(x: object, spec: str = ".2f", missing: str = "-") -> str:
    """``x`` formatted with the format ``spec`` (a number), ``str(x)`` (anything else), or
    ``missing`` when ``x`` is ``None`` or NaN."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return missing
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return format(x, spec)
    return str(x)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]], align: str | None = None) -> str:
    """A Markdown (GitHub) table: the ``header`` line, the alignment line, one line per
    row (each cell ``str()``-ed). ``align``: one letter per column, ``l`` (left) or
    ``r`` (right, for figures); default all left. Raises ``ValueError`` when ``align``
    does not match the header's length."""
    align = align or "l" * len(header)
    if len(align) != len(header):
        raise ValueError(f"align {align!r} has {len(align)} columns, the header {len(header)}")
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---:" if a == "r" else "---" for a in align) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def target_table(labels: Sequence[str], rows: Sequence[tuple[str, str, Sequence[str]]], title: str | None = None) -> str:
    """A fixed-width text table comparing runs: one column per run (``labels``), one line
    per row ``(what, target, values)`` with ``values`` one string per run; the names left
    aligned, the target and the values right aligned, a rule under the header, the
    ``title`` line above it when given."""
    w0 = max(len(r[0]) for r in rows)
    w1 = max(8, max(len(r[1]) for r in rows))
    wc = [max(len(lab), max(len(r[2][i]) for r in rows)) for i, lab in enumerate(labels)]
    out = [f"{'':<{w0}}  {'target':>{w1}}  " + "  ".join(f"{lab:>{wc[i]}}" for i, lab in enumerate(labels))]
    out.append("-" * len(out[-1]))
    for name, target, vals in rows:
        out.append(f"{name:<{w0}}  {target:>{w1}}  " + "  ".join(f"{v:>{wc[i]}}" for i, v in enumerate(vals)))
    return "\n".join(([title] if title is not None else []) + out)


def write_json(path: Path, data: object) -> Path:
    """Write ``data`` to ``path`` as JSON (indented one space, a newline at the end; keys
    that are not strings, such as HTTP statuses, written as strings), creating its
    folder. Returns ``path``. Raises ``TypeError`` for a value JSON cannot hold."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path

"""Rows of text cells aligned in columns: the tables that `python -m conformance compare` prints (report.py,
complexity.py)."""

from __future__ import annotations


def columns(lines: list[tuple[str, ...]], *, right: tuple[int, ...]) -> str:
    """The lines' cells padded to their column's width, the columns in `right` to the right; an empty line
    separates groups."""
    widths = [max(len(line[i]) for line in lines if line) for i in range(len(lines[0]))]
    return "\n".join("  ".join(cell.rjust(width) if i in right else cell.ljust(width)
                               for i, (cell, width) in enumerate(zip(line, widths, strict=False))).rstrip()
                     for line in lines)

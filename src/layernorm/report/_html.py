"""Small helpers for the self-contained HTML report: inline images and tables."""

from __future__ import annotations

import base64
import html
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = ["img_tag", "table"]


def img_tag(png: str | Path, alt: str = "") -> str:
    """An ``<img>`` whose PNG data is inline (a data URI), so the page stands alone."""
    data = base64.b64encode(Path(png).read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """An HTML table; cells are escaped text."""
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

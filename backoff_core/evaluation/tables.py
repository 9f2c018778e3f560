"""Markdown pieces every report section is written with."""

from __future__ import annotations

from pathlib import Path


def f(x, digits: int = 3) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(f(c) for c in row) + " |" for row in rows]
    return out + [""]


def img(plots: dict, name: str) -> list[str]:
    return [f"![{name}]({Path(plots[name]).name})", ""] if name in plots else []


def with_ci(x: float, ci: list | None, digits: int = 3) -> str:
    """'0.650 (0.600–0.700)', or the value alone where no interval was measured."""
    return f"{x:.{digits}f} ({ci[0]:.{digits}f}–{ci[1]:.{digits}f})" if ci else f(x, digits)

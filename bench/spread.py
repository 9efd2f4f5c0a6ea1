"""Alternating rounds and their summary, written once for every benchmark of two servers or settings.

A single run on a shared machine moves by ±30 %: a benchmark runs its sides in alternating
rounds (``alternate``), keeps every round's figures, and reports each figure as the median of
the rounds with the spread beside it (``spread``, ``spreads``), in a table of one row per figure
with the ratio of the medians (``ratio_row``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence
from typing import Any


def alternate(rounds: int, sides: Sequence[str], run: Callable[[int, str], Any], *,
              swap: bool = False) -> dict[str, list]:
    """Every side's results of ``rounds`` rounds: ``run(i, side)`` for each side in each round, in
    the order given (A B, A B, ...), or with ``swap`` reversed every other round (A B, B A, ...)."""
    raw: dict[str, list] = {side: [] for side in sides}
    for i in range(rounds):
        for side in (sides if not swap or i % 2 == 0 else sides[::-1]):
            raw[side].append(run(i, side))
    return raw


def spread(values: Iterable[float], digits: int | None = None) -> dict:
    """``{"median", "min", "max"}`` of the values (rounded to ``digits`` when given)."""
    values = list(values)
    out = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return out if digits is None else {k: round(v, digits) for k, v in out.items()}


def spreads(rounds: Iterable, figures: Iterable[str], pick: Callable[[Any, str], float | None]) -> dict:
    """The ``spread`` of each figure over the rounds (``pick(round, figure)``), skipping a round
    without it (None); a figure no round has is left out."""
    rounds = list(rounds)
    return {f: spread(vals) for f in figures if (vals := [v for r in rounds if (v := pick(r, f)) is not None])}


def cell(s: dict, dash: str = "–") -> str:
    """A spread as a table cell: ``median [min–max]``."""
    return f"{s['median']:.1f} [{s['min']:.1f}{dash}{s['max']:.1f}]"


def ratio_row(*labels: str, a: dict, b: dict) -> str:
    """One table row: the labels, side A's and side B's spread, and B's median over A's."""
    return "| " + " | ".join(labels) + f" | {cell(a)} | {cell(b)} | {b['median'] / a['median']:.2f}× |"

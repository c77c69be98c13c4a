"""Checks on a benchmark's written section that can fail (the smoke tests use them):
every reported ratio is a finite positive number, every same-math line reports a small
difference, and compiled FLOPs reported side by side are equal.

Timings themselves are not bounded: a quick run on a shared machine is noise. But a ratio
that is missing, NaN, infinite, zero or negative means broken timing code, and a
same-math line with a large difference means the two contenders no longer compute the
same thing.
"""

from __future__ import annotations

import math
import re

_NUMBER = r"[-+]?(?:\d[\d,]*\.?\d*(?:e[-+]?\d+)?|nan|inf)"


def _float(s: str) -> float:
    return float(s.replace(",", ""))


def section(text: str, name: str) -> str:
    """The text between ``<!-- bench:<name>:begin -->`` and its end marker."""
    m = re.search(rf"<!-- bench:{name}:begin -->(.*?)<!-- bench:{name}:end -->", text, re.S)
    assert m, f"no section {name!r} in:\n{text[:2000]}"
    return m.group(1)


def bold_ratios(text: str, at_least: int = 1) -> list[float]:
    """The headline ratios (``**1.234x**``); each must be finite and positive."""
    found = re.findall(rf"\*\*({_NUMBER})x\*\*", text, re.I)
    assert len(found) >= at_least, (f"expected >= {at_least} **ratio** values", text)
    values = [_float(v) for v in found]
    bad = [v for v in values if not (math.isfinite(v) and v > 0)]
    assert not bad, (f"ratios not finite and positive: {bad}", text)
    return values


def table_column(text: str, row_start: str, column: int) -> float:
    """The number in `column` (0 = the first cell) of the table row whose first cell
    starts with `row_start`; finite and positive."""
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0].startswith(row_start):
            cell = cells[column].strip("*").removesuffix("x")
            value = _float(cell)
            assert math.isfinite(value) and value > 0, (line, value)
            return value
    raise AssertionError(f"no table row starting with {row_start!r} in:\n{text}")


def max_diffs(text: str, at_least: int = 1, tol: float = 1e-5) -> list[float]:
    """The ``max |... diff| ... <number>`` values of the same-math lines; each <= tol."""
    found = re.findall(r"max \|[\w ]+ diff\|[^;\n]*?(" + _NUMBER + r")(?=[;\n]|$)", text)
    assert len(found) >= at_least, (f"expected >= {at_least} 'max |... diff|' lines", text)
    values = [_float(v) for v in found]
    bad = [v for v in values if not (math.isfinite(v) and 0 <= v <= tol)]
    assert not bad, (f"same-math differences above {tol}: {bad}", text)
    return values


def loss_pairs(text: str, at_least: int = 1, rtol: float = 1e-6) -> list[tuple[float, float]]:
    """The ``loss ... <blox> ... raw <raw>`` pairs of the same-math lines; each equal to
    rtol (both finite)."""
    pattern = (
        r"loss(?: of step \d+)?:? (?:blox )?(" + _NUMBER + r"),? (?:vs )?raw (" + _NUMBER + r")"
    )
    found = re.findall(pattern, text)
    assert len(found) >= at_least, (f"expected >= {at_least} 'loss ... raw ...' lines", text)
    pairs = [(_float(a), _float(b)) for a, b in found]
    for a, b in pairs:
        assert math.isfinite(a) and math.isfinite(b), (a, b, text)
        assert abs(a - b) <= rtol * max(1.0, abs(b)), (a, b, text)
    return pairs


def equal_flops(text: str, at_least: int = 1) -> None:
    """Rows ``| ... | <blox> | <raw> | yes |`` report equal counts."""
    rows = re.findall(r"^\|[^|\n]*\| (\d+) \| (\d+) \| (yes|no) \|", text, re.M)
    assert len(rows) >= at_least, (f"expected >= {at_least} FLOPs rows", text)
    for a, b, same in rows:
        assert a == b and same == "yes", (a, b, same, text)

"""A Griffe extension that mkdocs.yml loads for the API pages; the package does not use it.

blox writes Google-style docstrings with two habits that Griffe's Google parser does not
read as intended; this rewrites them before parsing, so the docstrings stay as they are:

- doctest examples in the body, or under ``Example:`` (an admonition for Griffe, not a
  code section). As Markdown, ``>>>`` is a block quote three levels deep; each such
  block is put in a ```` ```pycon ```` fence.
- several arguments described together (``kernel_init, bias_init: ...``, possibly with
  the names continued on the next line). The parser takes the whole list as one name
  and warns that it is not in the signature; the entry is split into one entry per
  name, each with the shared description.
- class docstrings assembled at import time (``__doc__ = __doc__ + SHARED + ...`` in the
  class body, which static analysis cannot evaluate): they are read from the imported
  class.
- reStructuredText literal blocks (a paragraph ending in ``::``, then an indented
  block): the ``::`` would print as is; it becomes ``:`` (a line of only ``::`` goes),
  and the indented block is a Markdown code block already.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

import griffe

_ARGS_HEADER = re.compile(r"^(\s*)(Args|Arguments|Parameters|Params|Keyword Args):\s*$")
_NAMES = re.compile(r"^\**\w+(\s*,\s*\**\w+)*$")


def fence_doctests(text: str) -> str:
    """Wraps each run of doctest lines (from a ``>>>`` line to the next blank line) that
    is not in a fence yet in a ```` ```pycon ```` fence, at the run's indentation (an
    ``Example:`` section is indented)."""
    lines, out, i, fenced = text.split("\n"), [], 0, False
    while i < len(lines):
        stripped = lines[i].lstrip()
        if stripped.startswith(("```", "~~~")):
            fenced = not fenced
        if stripped.startswith(">>>") and not fenced:
            indent = lines[i][: len(lines[i]) - len(stripped)]
            j = i
            while j < len(lines) and lines[j].strip():
                j += 1
            out += [f"{indent}```pycon", *lines[i:j], f"{indent}```"]
            i = j
        else:
            out.append(lines[i])
            i += 1
    return "\n".join(out)


def split_grouped_args(text: str) -> str:
    """Splits ``a, b: description`` entries of an ``Args:`` section into ``a:`` and
    ``b:`` entries with the same description (continuation lines included)."""
    lines, out, i = text.split("\n"), [], 0
    while i < len(lines):
        header = _ARGS_HEADER.match(lines[i])
        out.append(lines[i])
        i += 1
        if not header:
            continue
        base = len(header.group(1))
        item_indent = None
        while i < len(lines) and lines[i].strip():
            line = lines[i]
            indent = len(line) - len(line.lstrip())
            if indent <= base:
                break
            item_indent = indent if item_indent is None else item_indent
            # One entry: its first line and the deeper-indented lines under it.
            j = i + 1
            while j < len(lines) and lines[j].strip():
                if len(lines[j]) - len(lines[j].lstrip()) <= item_indent:
                    break
                j += 1
            entry = lines[i:j]
            names, rest = _grouped_names(entry, item_indent)
            if names is None:
                out += entry
            else:
                for name in names:
                    out += [" " * item_indent + f"{name}: {rest[0]}", *rest[1:]]
            i = j
    return "\n".join(out)


def _grouped_names(entry: list[str], indent: int) -> tuple[list[str] | None, list[str]]:
    """The names of a grouped entry (None if it names one argument) and its description
    lines; the names may continue over lines that end with a comma."""
    head, k = "", 0
    while k < len(entry):
        part = entry[k].strip()
        head = f"{head} {part}".strip()
        k += 1
        if ":" in part or not part.endswith(","):
            break
    names_text, colon, first = head.partition(":")
    if not colon or not _NAMES.match(names_text.strip()) or "," not in names_text:
        return None, entry
    names = [n.strip() for n in names_text.split(",")]
    return names, [first.strip(), *entry[k:]]


def rst_literal_markers(text: str) -> str:
    """Drops the ``::`` of reStructuredText literal blocks outside fences."""
    out, fenced = [], False
    for line in text.split("\n"):
        stripped = line.strip()
        if stripped.startswith(("```", "~~~")):
            fenced = not fenced
        if not fenced and stripped == "::":
            continue
        if not fenced and stripped.endswith("::"):
            line = line.rstrip()[:-1]
        out.append(line)
    return "\n".join(out)


def rewrite(text: str) -> str:
    """All the rewrites above, in order."""
    return fence_doctests(rst_literal_markers(split_grouped_args(text)))


class BloxDocstrings(griffe.Extension):
    """Rewrites each docstring (see the module docstring) when its object is created."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj.docstring.value)

    def on_class(self, *, cls: griffe.Class, **kwargs: Any) -> None:
        if "__doc__" not in cls.members:
            return
        runtime = getattr(importlib.import_module(cls.module.path), cls.name)
        text = rewrite(inspect.cleandoc(runtime.__doc__ or ""))
        if cls.docstring is None:
            cls.docstring = griffe.Docstring(text, parent=cls)
        else:
            cls.docstring.value = text

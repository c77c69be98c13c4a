"""`Graph`: the static structure and naming of a model."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from blox.core._params import Path, format_path

if TYPE_CHECKING:
    from blox.core._module import Module

__all__ = ["Graph"]


class Graph:
    """A node in the static tree that names every module and parameter.

    A ``Graph`` holds no arrays. Each node has a name; its ``path`` is the tuple of
    names from the root, and a module bound to the node stores its parameters under
    ``path + (param_name,)``. Names may contain any characters.

    Args:
      name: this node's name (a non-empty string).

    >>> g = Graph('net')
    >>> enc = g.child('encoder')
    >>> (enc / 'lstm').path
    ('net', 'encoder', 'lstm')
    """

    __slots__ = ("name", "metadata", "_parent", "_children", "_module", "_path", "__weakref__")

    def __init__(self, name: str, *, _parent: Graph | None = None):
        if not isinstance(name, str):
            raise TypeError(f"Graph names are strings, got {type(name).__name__} {name!r}.")
        if not name:
            raise ValueError("Graph node must have a name (got an empty string).")
        self.name = name
        self.metadata: dict[str, Any] = {}
        self._parent = _parent
        self._children: dict[str, Graph] = {}
        self._module: Module | None = None
        self._path: Path = (_parent._path if _parent is not None else ()) + (name,)

    @property
    def path(self) -> Path:
        """The tuple of names from the root to this node."""
        return self._path

    @property
    def parent(self) -> Graph | None:
        """The parent node, or ``None`` for a root."""
        return self._parent

    @property
    def root(self) -> Graph:
        """The root of the tree this node belongs to."""
        node = self
        while node._parent is not None:
            node = node._parent
        return node

    @property
    def module(self) -> Module | None:
        """The module bound to this node, if any."""
        return self._module

    @property
    def children(self) -> dict[str, Graph]:
        """A copy of the ``{name: child}`` mapping, in creation order."""
        return dict(self._children)

    def child(self, name: str) -> Graph:
        """Creates and returns a new child node; a second child with one name is an error."""
        if name in self._children:
            raise ValueError(
                f"Graph node '{format_path(self._path)}' already has a child named {name!r}. "
                f"Each child name is used once; pick another name (e.g. '{name}_1'), or pass "
                "the existing module itself to share its parameters."
            )
        node = Graph(name, _parent=self)
        self._children[name] = node
        return node

    def __truediv__(self, name: str) -> Graph:
        return self.child(name)

    def walk(self) -> Iterator[tuple[Path, Module]]:
        """Yields ``(path, module)`` depth-first, in creation order, for bound nodes below."""
        for c in self._children.values():
            if c._module is not None:
                yield c._path, c._module
            yield from c.walk()

    def _bind(self, module: Module) -> None:
        if self._parent is None:
            raise ValueError(
                f"Cannot bind '{type(module).__name__}' to root graph node '{self.name}'. "
                f"Use graph.child('name') to create a child node, e.g. "
                f"{type(module).__name__}(graph.child('{type(module).__name__.lower()}'), ...)."
            )
        if self._module is not None:
            raise ValueError(
                f"Graph node '{format_path(self._path)}' is already bound to "
                f"{type(self._module).__name__}; a node holds one module. Create a new "
                "child for the second module, or pass the first module around to share it."
            )
        self._module = module

    def __repr__(self) -> str:
        return f"Graph('{format_path(self._path)}')"

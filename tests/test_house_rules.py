"""House rules of the blox source tree.

The rules, checked on the syntax of the source tree:

1. No module outside ``blox/core`` imports a private name of ``blox.core`` or reads a
   private attribute of a core object (`Params` storage, its private constructors and
   helpers, a core module's private methods): packages use the public API
   (``Params.leaves``/``with_leaves``/``from_items``/``metadata_entries``/
   ``with_metadata``, ``params[path].metadata``, ...).
2. No file of ``blox/core`` imports ``blox.parallel`` (not even lazily inside a
   function): the core stands alone, and ``blox.parallel`` builds on it.
3. No ``getattr``/``hasattr`` on the strings ``"vma"``/``"varying"``: varying manual axes
   are read from the public type, ``jax.typeof(x).manual_axis_type.varying``
   (``blox.core._sharding.varying_axes``).
4. No function over 80 lines from its ``def`` to its end, less its docstring (nested
   functions count toward their parent), except
   the ones listed in `ALLOWED_LONG` (none), which only shrinks.
5. Tensor parallelism is a mode of the nn layers: the TP names are subclasses of their
   nn layers with no computation of their own, and ``parallel/_tp.py`` repeats no run of
   6 lines of the nn layers (or of itself); ``nn/_yolo.py`` repeats no run of more than
   10 lines (`repeated_runs`, exact runs: a proxy for the `duplicates` tool, which CI
   does not have).
6. No issue numbers in docs or code: ``tests/test_no_issue_numbers.py``.

Each checker takes the repository root, so the tests also run it on a planted violation
in a temporary tree and see it found. The last tests check the public `Params` methods the
rules point to against item access and ``jax.tree``.
"""

from __future__ import annotations

import ast
import pathlib
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import blox as bx

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Private attributes of core objects that code outside blox/core must not read (a
# pragmatic list: the storage and private constructors of Params, its metadata
# helpers, a Module's private parameter reader). NamedTuple's `_replace`/`_fields`/
# `_asdict`/`_make` on namedtuples and `os._exit` are other things and are not listed
# (`_make` is flagged only as `Params._make`).
PRIVATE_ATTRS = {
    "_struct",
    "_values",
    "_from_items",
    "_get_value",
    "_thaw",
    "_freeze",
    "_make_info",
    "_set",
    "_info",
    "_param",
}

# Files allowed to read "vma"/"varying" with getattr (none: every file reads varying
# axes through blox.core._sharding.varying_axes, i.e. jax.typeof(x).manual_axis_type).
ALLOWED_VMA_GETATTR: set[str] = set()

# Functions allowed over 80 lines, (file, qualified name) -> lines (none; a new long
# function fails the test: split it into named steps).
ALLOWED_LONG: dict[tuple[str, str], int] = {}

MAX_LINES = 80


def _sources(root: pathlib.Path, under: str = "blox"):
    """``(relative posix path, parsed module)`` of every ``.py`` file under `under`."""
    for path in sorted((root / under).rglob("*.py")):
        yield path.relative_to(root).as_posix(), ast.parse(path.read_text(), str(path))


def _in_core(rel: str) -> bool:
    return rel.startswith("blox/core/")


def private_core_uses(root: pathlib.Path) -> list[tuple[str, int, str]]:
    """``(file, line, what)`` for every private ``blox.core`` name imported, and every
    private core attribute (`PRIVATE_ATTRS`, ``Params._make``) read, outside
    ``blox/core``; ``self``/``cls`` attributes are a class's own business."""
    found = []
    for rel, tree in _sources(root):
        if _in_core(rel):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("blox.core"):
                for alias in node.names:
                    if alias.name.startswith("_"):
                        found.append((rel, node.lineno, f"from {node.module} import {alias.name}"))
            elif isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Store):
                owner = node.value.id if isinstance(node.value, ast.Name) else None
                if owner in ("self", "cls"):
                    continue
                if node.attr in PRIVATE_ATTRS or (node.attr == "_make" and owner == "Params"):
                    found.append((rel, node.lineno, ast.unparse(node)))
    return found


def core_imports_of_parallel(root: pathlib.Path) -> list[tuple[str, int, str]]:
    """``(file, line, import)`` for every import of ``blox.parallel`` in ``blox/core``,
    at module scope or inside a function."""
    found = []
    for rel, tree in _sources(root):
        if not _in_core(rel):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            if any(n == "blox.parallel" or n.startswith("blox.parallel.") for n in names):
                found.append((rel, node.lineno, ast.unparse(node)))
    return found


def vma_getattrs(root: pathlib.Path) -> list[tuple[str, int, str]]:
    """``(file, line, call)`` for every ``getattr``/``hasattr`` on ``"vma"`` or
    ``"varying"`` under ``blox/``."""
    found = []
    for rel, tree in _sources(root):
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in ("vma", "varying")
            ):
                found.append((rel, node.lineno, ast.unparse(node)))
    return found


def _body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of the function from its ``def`` to its end, less its docstring's
    (the signature, nested functions and classes included)."""
    n = fn.end_lineno - fn.lineno + 1
    first = fn.body[0]
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        n -= first.end_lineno - first.lineno + 1
    return n


def long_functions(root: pathlib.Path, limit: int = MAX_LINES) -> list[tuple[str, str, int]]:
    """``(file, qualified name, lines)`` of every function under ``blox/`` whose body
    (`_body_lines`) is longer than `limit` lines. A nested function is also reported on
    its own (``outer.inner``), as a method is (``Class.method``)."""
    found = []

    def visit(node: ast.AST, prefix: str, rel: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = prefix + child.name
                n = _body_lines(child)
                if n > limit:
                    found.append((rel, name, n))
                visit(child, name + ".", rel)
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".", rel)
            else:
                visit(child, prefix, rel)

    for rel, tree in _sources(root):
        visit(tree, "", rel)
    return found


# ---------------------------------------------------------------------------
# The rules, on this tree
# ---------------------------------------------------------------------------


def _lines(found) -> str:
    return "\n".join(f"  {rel}:{line}: {what}" for rel, line, what in found)


def test_no_private_core_api_outside_core():
    found = private_core_uses(ROOT)
    assert not found, (
        "private blox.core names or attributes used outside blox/core (use the public "
        "Params/Module API, or add a public method to the core):\n" + _lines(found)
    )


def test_core_never_imports_parallel():
    found = core_imports_of_parallel(ROOT)
    assert not found, "blox/core imports blox.parallel:\n" + _lines(found)


def test_varying_axes_read_from_the_public_type():
    found = [f for f in vma_getattrs(ROOT) if f[0] not in ALLOWED_VMA_GETATTR]
    assert not found, (
        "getattr on 'vma'/'varying': use jax.typeof(x).manual_axis_type.varying "
        "(blox.core._sharding.varying_axes):\n" + _lines(found)
    )


def test_no_function_over_80_lines():
    found = [f for f in long_functions(ROOT) if (f[0], f[1]) not in ALLOWED_LONG]
    assert not found, (
        f"functions over {MAX_LINES} lines (split them into named steps):\n"
        + "\n".join(f"  {rel}: {name} ({n} lines)" for rel, name, n in found)
    )


def _code_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of the lines that count for repetition: stripped of white
    space, without blank lines, comments, imports and lone punctuation (as the
    `duplicates` tool reads code)."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        s = " ".join(line.split())
        if not s or s.startswith("#") or s.startswith(("import ", "from ")):
            continue
        if all(c in "()[]{},:;" for c in s):
            continue
        out.append((n, s))
    return out


def repeated_runs(a: str, b: str | None, min_lines: int) -> list[tuple[int, int, int]]:
    """``(line in a, line in b, length)`` of every maximal run of at least `min_lines`
    identical counted lines shared by texts `a` and `b` (`b` None: `a` with itself, the
    two places apart)."""
    la = _code_lines(a)
    lb = la if b is None else _code_lines(b)
    found = []
    for i in range(len(la)):
        for j in range(i + 1 if b is None else 0, len(lb)):
            if i and j and la[i - 1][1] == lb[j - 1][1]:
                continue  # inside a run found from its start
            k = 0
            while i + k < len(la) and j + k < len(lb) and la[i + k][1] == lb[j + k][1]:
                if b is None and i + k >= j:
                    break
                k += 1
            if k >= min_lines:
                found.append((la[i][0], lb[j][0], k))
    return found


TP_TWINS = {
    "ColumnParallelLinear": "Linear",
    "RowParallelLinear": "Linear",
    "ParallelMLP": "MLP",
    "ParallelMultiHeadAttention": "MultiHeadAttention",
    "ParallelTransformerBlock": "TransformerBlock",
}


def test_tensor_parallel_layers_are_their_nn_layers():
    """Tensor parallelism is a mode of the nn layers: each TP name is a subclass of its
    nn layer that adds no computation of its own, and parallel/_tp.py shares no run of 6
    lines with the nn layers' files (nor with itself)."""
    import blox as bx
    from blox import parallel as bp

    for tp, nn in TP_TWINS.items():
        cls = getattr(bp, tp)
        assert issubclass(cls, getattr(bx, nn)), (tp, nn)
        own = {k for k, v in vars(cls).items() if callable(v) and not k.startswith("__")}
        assert not own and "__call__" not in vars(cls), (tp, own)
    tp_src = (ROOT / "blox/parallel/_tp.py").read_text()
    for nn_file in ("_linear.py", "_attention.py", "_transformer.py"):
        nn_src = (ROOT / "blox/nn" / nn_file).read_text()
        assert not repeated_runs(nn_src, tp_src, 6), nn_file
    assert not repeated_runs(tp_src, None, 6)


def test_yolo_blocks_share_their_construction():
    """blox/nn/_yolo.py repeats no run of more than 10 lines."""
    runs = repeated_runs((ROOT / "blox/nn/_yolo.py").read_text(), None, 11)
    assert not runs, runs


# ---------------------------------------------------------------------------
# Each checker finds a planted violation
# ---------------------------------------------------------------------------


def _plant(root: pathlib.Path, rel: str, source: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))


def test_private_core_uses_finds_planted_violations(tmp_path):
    _plant(
        tmp_path,
        "blox/nn/_bad.py",
        """
        from blox.core import Params
        from blox.core._params import _thaw, format_path
        from blox.core._sequence import sequence_length

        def f(params, layer, self):
            a = params._struct.keys
            b = Params._make(params._struct, params._values)
            c = layer._param(params, "kernel", (2,), None, 1)
            d = self._param  # a class's own attribute: allowed
            e = params.leaves()
            return point._replace(x=1), os._exit
        """,
    )
    # The same reads inside blox/core are the container's own business.
    _plant(tmp_path, "blox/core/_ok.py", "def g(p):\n    return p._struct, p._values\n")
    found = sorted((line, what) for _, line, what in private_core_uses(tmp_path))
    assert found == [
        (3, "from blox.core._params import _thaw"),
        (7, "params._struct"),
        (8, "Params._make"),
        (8, "params._struct"),
        (8, "params._values"),
        (9, "layer._param"),
    ]


def test_core_imports_of_parallel_finds_planted_violations(tmp_path):
    _plant(
        tmp_path,
        "blox/core/_bad.py",
        """
        import jax

        def varying(x):
            from blox.parallel._mesh import varying_axes  # lazy, still an import

            return varying_axes(x)

        def g():
            import blox.parallel
            from blox import parallel
        """,
    )
    _plant(tmp_path, "blox/nn/_ok.py", "from blox.parallel._mesh import varying_axes\n")
    found = sorted((rel, line) for rel, line, _ in core_imports_of_parallel(tmp_path))
    assert found == [("blox/core/_bad.py", 5), ("blox/core/_bad.py", 10), ("blox/core/_bad.py", 11)]


def test_vma_getattrs_finds_planted_violations(tmp_path):
    _plant(
        tmp_path,
        "blox/parallel/_bad.py",
        """
        import jax

        def axes(x):
            aval = jax.typeof(x)
            mat = getattr(aval, "mat", None)
            if hasattr(aval, "vma"):
                return getattr(aval, "vma", ())
            return getattr(mat, "varying", ())

        def good(x):
            return jax.typeof(x).manual_axis_type.varying
        """,
    )
    found = sorted(line for _, line, _ in vma_getattrs(tmp_path))
    assert found == [7, 8, 9]


def test_long_functions_counts_a_planted_81_line_function(tmp_path):
    def lines(n: int) -> str:
        return "\n".join(f"    x{i} = {i}" for i in range(n))

    _plant(
        tmp_path,
        "blox/_long.py",
        f'''def long_one():
    """A docstring (not counted)
    over two lines."""
    def inner():
        return 0
{lines(77)}
    return x1


def exactly_80():
    """Docstring."""
{lines(78)}
    return 0


class C:
    def method(self):
{textwrap.indent(lines(79), "    ")}
        return 1
''',
    )
    found = long_functions(tmp_path)
    # long_one: def + the nested def (2 lines) + 77 assignments + return = 81; the
    # docstring is not counted. exactly_80 (def + 78 + return) is not reported.
    assert found == [("blox/_long.py", "long_one", 81), ("blox/_long.py", "C.method", 81)]
    assert long_functions(tmp_path, limit=81) == []


# ---------------------------------------------------------------------------
# The public Params API the rules point to (reference: item access and jax.tree)
# ---------------------------------------------------------------------------


def _sample_params():
    params = bx.Params()
    params[("net", "w")] = bx.Param(jnp.ones((2, 3)), metadata={"sharding": (None, "model")})
    params[("net", "b")] = bx.Param(jnp.zeros((3,)))
    params[("net", "step")] = bx.Param(jnp.zeros((), jnp.int32), trainable=False)
    return params.locked()


def test_params_leaves_and_with_leaves_keep_paths_flags_metadata_and_lock():
    params = _sample_params()
    assert list(params.leaves()) == [params[k].value for k in params.keys()]
    assert len(params.leaves()) == len(jax.tree.leaves(params))
    new = params.with_leaves([v + 1 for v in params.leaves()])
    assert jax.tree.structure(new) == jax.tree.structure(params)
    for k in params.keys():
        assert new[k].trainable == params[k].trainable
        assert new[k].metadata == params[k].metadata
        np.testing.assert_array_equal(new[k].value, params[k].value + 1)
    assert new.is_locked
    with pytest.raises(ValueError, match=r"2 leaves for 3 paths.*keys\(\) order"):
        params.with_leaves(params.leaves()[:2])


def test_params_from_items_rebuilds_params_and_refuses_misuse():
    params = _sample_params()
    rebuilt = bx.Params.from_items(reversed(params.items()), locked=True)
    assert jax.tree.structure(rebuilt) == jax.tree.structure(params)
    assert all(rebuilt[k].value is params[k].value for k in params.keys())
    with pytest.raises(ValueError, match="'net/w' twice"):
        bx.Params.from_items([(("net", "w"), bx.Param(1.0)), (("net", "w"), bx.Param(2.0))])
    with pytest.raises(TypeError, match=r"\(path, Param\) pairs"):
        bx.Params.from_items([(("net", "w"), 1.0)])
    with pytest.raises(KeyError, match="path tuples"):
        bx.Params.from_items([("net/w", bx.Param(1.0))])


def test_params_metadata_entries_and_with_metadata():
    params = _sample_params()
    assert params.metadata_entries("sharding") == {("net", "w"): (None, "model")}
    assert params.metadata_entries("absent") == {}
    meta = params[("net", "b")].metadata
    meta["sharding"] = ("model",)
    tagged = params.with_metadata({("net", "b"): meta, ("net", "w"): {}})
    assert tagged[("net", "b")].sharding == ("model",)
    assert tagged[("net", "w")].metadata == {}
    assert params[("net", "w")].sharding == (None, "model")  # the original is unchanged
    assert all(tagged[k].value is params[k].value for k in params.keys())
    assert tagged.is_locked and params.with_metadata({}) is params
    # Metadata is static pytree data: the tree structure changes with it, back when undone.
    assert jax.tree.structure(tagged) != jax.tree.structure(params)
    undone = tagged.with_metadata({("net", "b"): {}, ("net", "w"): {"sharding": (None, "model")}})
    assert jax.tree.structure(undone) == jax.tree.structure(params)
    with pytest.raises(KeyError, match="'net/c' not found"):
        params.with_metadata({("net", "c"): {}})
    with pytest.raises(TypeError, match="must be hashable"):
        params.with_metadata({("net", "b"): {"x": [1, [2, {3}]]}})


def test_repeated_runs_finds_a_planted_repetition():
    block = "\n".join(f"x{i} = f(x{i - 1}, {i})" for i in range(1, 8))
    a = f"def one():\n{textwrap.indent(block, '    ')}\n    return x7\n"
    b = f"# another file\nimport os\n\ndef two():\n{textwrap.indent(block, '  ')}\n"
    assert repeated_runs(a, b, 6) == [(2, 5, 7)]
    assert repeated_runs(a, b, 8) == []
    assert repeated_runs(a + "\n" + a, None, 6) == [(1, 11, 9)]  # line 10 is blank
    assert repeated_runs(a, None, 2) == []

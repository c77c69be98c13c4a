"""blox uses public JAX/Grain/Orbax APIs; a private import is allowed only where no public
accessor exists, inside one named function, and only while pyproject.toml pins an upper
bound on that package (so CI tests every version blox accepts).

The allow-list is the inventory: adding a private import means adding it here, with the
function that isolates it.
"""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]

# (file, enclosing function) -> the private module it may import.
ALLOWED = {
    ("blox/parallel/_mesh.py", "_vmap_axis_names"): "jax._src",
    ("blox/distributed/_init.py", "_coordinator_address"): "jax._src",
    ("blox/distributed/_init.py", "_backends_started"): "jax._src",
    ("blox/distributed/_init.py", "_cluster_env_types"): "jax._src",
}
PRIVATE = re.compile(r"^(jax|jaxlib|grain|orbax)\b.*\._src\b|^(jax|jaxlib|grain|orbax)\._src\b")


def _private_imports():
    found = []
    for path in sorted((ROOT / "blox").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text())
        parents = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                parents[child] = node
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if PRIVATE.search(name):
                    fn, up = None, parents.get(node)
                    while up is not None and fn is None:
                        if isinstance(up, ast.FunctionDef | ast.AsyncFunctionDef):
                            fn = up.name
                        up = parents.get(up)
                    found.append((rel, fn, name, node.lineno))
    return found


def test_private_imports_are_isolated_and_listed():
    unexpected = [
        f"{rel}:{line} imports {name} (in {fn or 'module scope'})"
        for rel, fn, name, line in _private_imports()
        if (rel, fn) not in ALLOWED or not name.startswith(ALLOWED[(rel, fn)])
    ]
    assert not unexpected, "private imports outside the allow-list:\n" + "\n".join(unexpected)


def test_packages_read_privately_have_an_upper_bound():
    text = (ROOT / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
    for package in {v.split(".")[0] for v in ALLOWED.values()}:
        spec = re.search(rf'"{package}([^"]*)"', deps)
        assert spec is not None, f"{package} is read privately but is not a dependency"
        assert "<" in spec.group(1), (
            f"pyproject.toml pins no upper bound on {package} ({spec.group(1)!r}), yet blox "
            f"imports its private modules: pin one that CI tests"
        )


def test_the_scan_finds_a_private_import(tmp_path):
    # The checker itself can fail: a module with a private import at module scope is found.
    sample = "from jax._src import core\nimport grain._src.python\n"
    tree = ast.parse(sample)
    names = [n.module if isinstance(n, ast.ImportFrom) else n.names[0].name for n in tree.body]
    assert all(PRIVATE.search(n) for n in names)
    assert not PRIVATE.search("jax.sharding")

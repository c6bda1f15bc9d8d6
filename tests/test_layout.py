"""The package's shape, read from its source with ``ast``: rooms by role and the
limits that keep them readable. Each check names what breaks it."""

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).parents[1]
FOLDERS = {"connector": "kvreel.connector", "scheduler": "kvreel.scheduler", "codec": "kvreel.codec",
           "dre": "kvreel.dre", "cli": "kvreel.cli"}
MAX_FILE_LINES, MAX_CLASS_LINES = 350, 250


def modules() -> dict[str, Path]:
    out = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            out[name] = path
    return out


def imports_of(path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules ``path`` imports, at its top or inside functions."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvreel"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in known else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("kvreel"))
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(path, known) for name, path in known.items()}


def test_no_file_or_class_is_too_long_to_read():
    long = []
    for name, path in modules().items():
        text = path.read_text()
        if len(text.splitlines()) > MAX_FILE_LINES:
            long.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                long.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long, long


def test_no_import_cycle_even_inside_functions():
    g = graph()
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(name):] + [name]))
        if name in done or name not in g:
            return
        for dep in sorted(g[name]):
            visit(dep, path + [name])
        done.add(name)

    for name in sorted(g):
        visit(name, [])


def test_rooms_import_only_what_their_role_allows():
    """The DRE runs in its own process and imports nothing of the connector; the
    connector's scheduler half and worker half never import each other (they
    talk through ``connector.metadata``'s messages)."""
    g = graph()
    wrong = [f"{m} imports {d}" for m, deps in g.items() for d in deps
             if (m.startswith("kvreel.dre") and not d.startswith("kvreel.dre"))
             or (m.startswith("kvreel.scheduler") and d.startswith("kvreel.connector.worker_side"))
             or (m.startswith("kvreel.connector.worker_side") and d.startswith("kvreel.scheduler"))]
    assert not wrong, wrong


def test_vllm_internals_are_reached_from_one_module():
    """A private vLLM name (a module or attribute starting with ``_``) appears only
    in ``connector/vllm_internals.py``, the file to change when vLLM moves one."""
    private = re.compile(r"\bvllm(\.\w+)*\._\w+|from vllm[\w.]* import [^\n]*\b_\w+")
    found = [f"{name}: {m.group(0)}" for name, path in modules().items()
             if not path.name == "vllm_internals.py" for m in private.finditer(path.read_text())]
    assert not found, found


def test_the_wheel_lists_every_package_folder():
    """setuptools installs only the packages pyproject.toml names: a new folder
    left out would be missing from the wheel and the Docker images."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {name for name, path in modules().items() if path.name == "__init__.py"}
    assert folders == listed, (folders - listed, listed - folders)

"""The package's shape, checked from its source: the four wings and their
import rules, the server wing's four rooms and theirs, every package's
``__init__`` naming all its modules, no import cycles, no module reading
another object's private attributes, and no file or class grown past a
size a reader can hold in mind.

Edges are the import statements written in each module, those inside
functions included; ``from pkg import name`` counts as an import of the
module ``pkg.name`` when there is one.  The parent packages that Python
loads implicitly on any import are not edges (every module would otherwise
depend on ``shmreplay/__init__.py``, which re-exports the client).
"""

from __future__ import annotations

import ast
import os
import pkgutil
import re

import pytest

PKG = "shmreplay"
ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), PKG)
MAX_FILE_LINES = 400
MAX_CLASS_LINES = 250


def modules() -> dict[str, str]:
    """module name -> file path, for every module of the package."""
    out = {}
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if not f.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), os.path.dirname(ROOT))[:-3]
            parts = rel.split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = os.path.join(dirpath, f)
    return out


def imports_of(name: str, path: str, known: set) -> set[str]:
    is_pkg = path.endswith("__init__.py")
    here = name if is_pkg else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        out.update(t for t in targets if t == PKG or t.startswith(PKG + "."))
    return {t for t in out if t in known} - {name}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def closure(graph, start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


# the replay store's three wings, and the inference channel's: a product of
# its own beside the store (no daemon), which may use the wire's segments and
# atomics and the root, and which neither the client nor the server uses
WINGS = ("client", "server", "wire", "inference")


def wing(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in WINGS else None


def test_the_four_wings_exist(graph):
    for w in WINGS:
        assert f"{PKG}.{w}" in graph and sum(wing(m) == w for m in graph) >= 4


@pytest.mark.parametrize("source, forbidden", [("client", {"server", "inference"}),
                                               ("server", {"client", "inference"}),
                                               ("wire", {"client", "server", "inference"}),
                                               ("inference", {"client", "server"})])
def test_wings_import_only_what_they_may(graph, source, forbidden):
    bad = {}
    for m in graph:
        if wing(m) == source:
            reached = {x for x in closure(graph, m) if wing(x) in forbidden or x == PKG}
            if reached:
                bad[m] = sorted(reached)
    assert not bad, f"{source} modules reach {forbidden} (or the package root): {bad}"


# the server wing's rooms, each with the rooms it may import; daemon.py, in
# the wing's hall, builds the daemon from all of them and no room imports it
ROOMS = {"tables": set(), "engine": {"tables"}, "disk": {"tables"},
         "control": {"tables", "engine", "disk"}}
HALL = {f"{PKG}.server", f"{PKG}.server.daemon"}


def room(name: str) -> str | None:
    parts = name.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "server" and parts[2] in ROOMS else None


def test_the_server_wing_is_four_rooms_and_its_hall(graph):
    server = {m for m in graph if wing(m) == "server"}
    assert {m for m in server if room(m) is None} == HALL
    for r in ROOMS:
        assert f"{PKG}.server.{r}" in graph and sum(room(m) == r for m in graph) >= 4, r


@pytest.mark.parametrize("source", sorted(ROOMS))
def test_server_rooms_import_only_the_rooms_below_them(graph, source):
    bad = {}
    for m in graph:
        if room(m) == source:
            reached = {x for x in closure(graph, m) if wing(x) == "server"
                       and room(x) not in ROOMS[source] | {source}}
            if reached:
                bad[m] = sorted(reached)
    assert not bad, f"server/{source} modules reach rooms above or beside them (or the hall): {bad}"


# server/tables/ is three rooms and the table that joins them: the slot
# books, the selection and the frame books, none of which imports another
# or the level above
TABLE_ROOMS = ("slots", "select", "frames")


def table_room(name: str) -> str | None:
    parts = name.split(".")
    return parts[3] if len(parts) > 3 and parts[1:3] == ["server", "tables"] else None


def test_the_tables_room_is_three_rooms_and_the_table():
    top = {m.name for m in pkgutil.iter_modules([os.path.join(ROOT, "server", "tables")])}
    assert {m for m in top if m not in TABLE_ROOMS} == {"table", "counters", "tablestats"}
    for r in TABLE_ROOMS:
        assert r in top
        assert len(list(pkgutil.iter_modules([os.path.join(ROOT, "server", "tables", r)]))) >= 4, r


@pytest.mark.parametrize("source", TABLE_ROOMS)
def test_the_tables_rooms_import_neither_each_other_nor_the_table(graph, source):
    bad = {}
    for m in graph:
        if table_room(m) == source:
            reached = {x for x in closure(graph, m) if wing(x) == "server" and table_room(x) != source}
            if reached:
                bad[m] = sorted(reached)
    assert not bad, f"server/tables/{source} modules reach beyond their room: {bad}"


def test_the_shared_root_modules_import_no_wing_but_wire(graph):
    # errors, schema, ratelimiter, priorities, ...: pure logic both sides use;
    # cli, bench, torch, sb3 and ray are tools over the client, not shared logic
    tools = {f"{PKG}.cli", f"{PKG}.bench", f"{PKG}.torch", f"{PKG}.sb3", f"{PKG}.ray"}
    for m, deps in graph.items():
        if m.count(".") == 1 and wing(m) is None and not any(m.startswith(t) for t in tools):
            assert not {d for d in closure(graph, m) if wing(d) in ("client", "server", "inference")}, m


def package_docstrings() -> dict[str, tuple[str, list[str]]]:
    """package folder -> (its ``__init__``'s docstring, the names of its
    modules: ``name.py`` for a file, ``name/`` for a sub-package)."""
    out = {}
    for dirpath, dirs, files in os.walk(ROOT):
        if "__init__.py" not in files:
            continue
        doc = ast.get_docstring(ast.parse(open(os.path.join(dirpath, "__init__.py")).read())) or ""
        names = [f for f in files if f.endswith(".py") and f != "__init__.py"]
        names += [d + "/" for d in dirs if os.path.exists(os.path.join(dirpath, d, "__init__.py"))]
        out[os.path.relpath(dirpath, os.path.dirname(ROOT))] = (doc, sorted(names))
    return out


def unnamed(doc: str, names: list[str]) -> list[str]:
    """The module names ``doc`` does not mention (``layout.py`` is not
    mentioned by ``rowlayout.py`` nor by ``wire/layout.py``)."""
    return [n for n in names if not re.search(r"(?<![\w./])" + re.escape(n) + r"(?![\w])", doc)]


def test_every_package_init_names_all_its_modules():
    """A reader opening a folder's ``__init__`` learns what each file in it
    is for: its docstring names every module and sub-package there."""
    bad = {pkg: missing for pkg, (doc, names) in package_docstrings().items()
           if (missing := unnamed(doc, names))}
    assert not bad, f"__init__ docstrings that do not name these modules: {bad}"


def test_the_docstring_checker_sees_an_unnamed_module():
    doc = "``layout.py`` (bytes), ``tables/`` (tables) and wire/names.py"
    assert unnamed(doc, ["layout.py", "rowlayout.py", "names.py", "tables/", "disk/"]) == [
        "rowlayout.py", "names.py", "disk/"]


def test_no_import_cycles(graph):
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_no_file_or_class_is_too_big():
    big = []
    for name, path in modules().items():
        src = open(path).read()
        lines = src.count("\n")
        if lines > MAX_FILE_LINES:
            big.append(f"{path}: {lines} lines")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ClassDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_CLASS_LINES:
                    big.append(f"{name}.{node.name}: {n} lines")
    assert not big, big


def test_the_rule_checker_sees_a_forbidden_import(tmp_path):
    """The checker itself: a client module importing the server is caught,
    including an import hidden inside a function."""
    src = tmp_path / "mod.py"
    src.write_text("def f():\n    from ..server import engine\n")
    known = {f"{PKG}.client.mod", f"{PKG}.server", f"{PKG}.server.engine"}
    assert imports_of(f"{PKG}.client.mod", str(src), known) == {f"{PKG}.server.engine"}


# reading a private name of another object or module: ``x._name`` where x
# is not self/cls, or ``from m import _name``.  A seam is a public name.
ALLOWED_PRIVATE = {"os._exit"}  # the stdlib's own spelling (numbaconf's fast exit)


def private_reads(src: str, path: str = "<src>") -> list[str]:
    out = []
    for node in ast.walk(ast.parse(src, path)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if ast.unparse(node) not in ALLOWED_PRIVATE:
                out.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom):
            out += [f"{path}:{node.lineno}: from {'.' * node.level}{node.module or ''} import {a.name}"
                    for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    return out


def test_no_module_reads_another_objects_private_attributes():
    bad = [hit for path in modules().values() for hit in private_reads(open(path).read(), path)]
    assert not bad, "reach-ins (give the object a seam instead):\n" + "\n".join(bad)


def test_the_private_read_checker_sees_a_reach_in():
    src = ("from .pipe import _helper\n"
           "class A:\n    def f(self, t):\n        return self._x + t._views + os._exit\n")
    assert [h.split(": ", 1)[1] for h in private_reads(src)] == ["from .pipe import _helper", "t._views"]


def layout_doc_rows() -> dict[str, set[str]]:
    """docs/layout.md's module table: folder ('' for the root) -> the module
    files its rows name, and every test file named in a row."""
    doc = os.path.join(os.path.dirname(ROOT), "docs", "layout.md")
    named, tests, folder = {}, set(), None
    for line in open(doc):
        if not line.startswith("| "):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        head = re.match(r"\*\*(\S+?)/?\*\*", cells[0])
        if head:
            folder = "" if head.group(1) == "root" else head.group(1).rstrip("/")
            continue
        if folder is None or len(cells) < 4:
            continue
        named.setdefault(folder, set()).update(re.findall(r"`([\w/]+(?:\.py)?)`", cells[0]))
        tests.update(re.findall(r"`((?:fault/)?test_\w+\.py)", cells[3]))
    return {"named": named, "tests": tests}


def test_docs_layout_names_every_module_and_real_test_files():
    rows = layout_doc_rows()
    missing = []
    for name, path in modules().items():
        rel = os.path.relpath(path, ROOT)
        folder, file = os.path.dirname(rel), os.path.basename(rel)
        if file == "__init__.py" or folder == "bench":  # a folder's face; bench/ is one row
            continue
        if file not in rows["named"].get(folder, set()):
            missing.append(rel)
    assert not missing, f"docs/layout.md's module table does not name {missing}"
    here = os.path.join(os.path.dirname(ROOT), "tests")
    gone = sorted(t for t in rows["tests"] if not os.path.exists(os.path.join(here, t)))
    assert not gone and rows["tests"], f"docs/layout.md names test files that do not exist: {gone}"

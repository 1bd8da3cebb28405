"""The layering ARCHITECTURE.md states, checked from the source.

The import graph is built with :mod:`ast` from every module under ``ccprofd/`` (generated protobuf
code excepted), with every ``import`` statement counted wherever it stands (function-level and
``TYPE_CHECKING`` imports included: a lazy import is still a dependency).  The allowed directions
are read from ARCHITECTURE.md's table, so the document and the check cannot drift apart.  The
checker itself is tested on small synthetic trees, so each rule is shown to fail when broken.
"""

from __future__ import annotations

import ast
import importlib
import re
import tomllib
from collections import defaultdict
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ccprofd"
EXCLUDED = ("export/gen",)
MAX_CLASS_LINES = 300
LONG_CLASS_MARK = "Why this class is long:"


# ------------------------------------------------------------------------------------- the graph
@dataclass(frozen=True)
class Import:
    module: str  # importing module, dotted
    target: str  # imported module (or package), dotted
    names: tuple[str, ...]  # names taken from it (empty for `import X`)
    line: int


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py")
                  if not any(str(p.relative_to(root)).startswith(ex) for ex in EXCLUDED))


def imports_of(path: Path, root: Path) -> list[Import]:
    """Every import statement of one file that names the project's package, resolved to absolute."""
    mod = module_name(path, root)
    is_pkg = path.name == "__init__.py"
    out: list[Import] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out += [Import(mod, a.name, (), node.lineno) for a in node.names
                    if a.name.split(".")[0] == root.name]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == root.name:
                out.append(Import(mod, target, tuple(a.name for a in node.names), node.lineno))
    return out


def unit_of(module: str, root: Path) -> str:
    """The package a module belongs to: the directory it is in (a subpackage is its own unit)."""
    parts = module.split(".")
    path = root.parent.joinpath(*parts)
    return module if path.is_dir() else ".".join(parts[:-1])


def layer_in(module: str, root: Path) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (root / parts[1]).is_dir() else ""


# -------------------------------------------------------------------------------- the rules table
def allowed_imports(doc: Path) -> dict[str, set[str]]:
    """ARCHITECTURE.md's table: package -> the packages it may import."""
    table: dict[str, set[str]] = {}
    rows = [line for line in doc.read_text(encoding="utf-8").splitlines() if line.startswith("| `")]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        pkg = cells[0].strip("`").rstrip("/")
        may = cells[-1]
        table[pkg] = set() if may in ("—", "-", "") else {m.strip().strip("`").rstrip("/")
                                                          for m in may.split(",")}
    everything = set(table)
    for pkg, may in table.items():
        if may == {"everything"}:
            table[pkg] = everything - {pkg}
    return table


def direction_violations(root: Path, table: dict[str, set[str]]) -> list[str]:
    out = []
    for path in source_files(root):
        for imp in imports_of(path, root):
            src, dst = layer_in(imp.module, root), layer_in(imp.target, root)
            if not src or not dst or src == dst:
                continue  # ccprofd/__init__.py (the version) may be imported by anyone
            if src not in table:
                out.append(f"{imp.module}: package {src!r} is not in ARCHITECTURE.md's table")
            elif dst not in table[src]:
                out.append(f"{path.relative_to(root.parent)}:{imp.line}: {src} imports {imp.target} "
                           f"({src} may import: {', '.join(sorted(table[src])) or 'nothing'})")
    return out


def module_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the project modules it imports (``from pkg import module`` counts as the module)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for path in source_files(root):
        for imp in imports_of(path, root):
            graph[imp.module].add(imp.target)
            for name in imp.names:
                if root.parent.joinpath(*f"{imp.target}.{name}".split(".")).with_suffix(".py").exists():
                    graph[imp.module].add(f"{imp.target}.{name}")
    return graph


def package_graph(root: Path) -> dict[str, set[str]]:
    """Top-level package -> the top-level packages its modules import."""
    graph: dict[str, set[str]] = defaultdict(set)
    for mod, targets in module_graph(root).items():
        for t in targets:
            a, b = layer_in(mod, root), layer_in(t, root)
            if a and b and a != b:
                graph[a].add(b)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(set(graph) | {w for ws in graph.values() for w in ws}):
        if v not in index:
            visit(v)
    return sorted(comps)


def sibling_violations(root: Path, siblings: tuple[str, ...], chooser: str) -> list[str]:
    """Siblings (e.g. tracing.instrumented, tracing.unwind) import neither each other nor are
    imported by their parent package's own modules, except ``chooser`` (the one that picks)."""
    out = []
    parent = siblings[0].rpartition(".")[0]
    for path in source_files(root):
        for imp in imports_of(path, root):
            src_unit = unit_of(imp.module, root)
            for sib in siblings:
                if not (imp.target == sib or imp.target.startswith(sib + ".")):
                    continue
                if src_unit in siblings and src_unit != sib:
                    out.append(f"{imp.module}:{imp.line}: imports its sibling {imp.target}")
                elif src_unit == parent and imp.module != chooser:
                    out.append(f"{imp.module}:{imp.line}: shared module imports {imp.target}")
    return out


def private_name_violations(root: Path) -> list[str]:
    """``from other_module import _private`` and ``other_module._private`` across modules."""
    out = []
    for path in source_files(root):
        mod = module_name(path, root)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        module_aliases: dict[str, str] = {}
        for imp in imports_of(path, root):
            for name in imp.names:
                base = name
                if base.startswith("_") and not base.startswith("__") and imp.target != mod:
                    out.append(f"{mod}:{imp.line}: imports private {imp.target}.{base}")
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == root.name:
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    if root.parent.joinpath(*full.split(".")).with_suffix(".py").exists():
                        module_aliases[a.asname or a.name] = full
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == root.name and a.asname:
                        module_aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in module_aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                out.append(f"{mod}:{node.lineno}: uses private {module_aliases[node.value.id]}.{node.attr}")
    return out


def long_classes(root: Path, limit: int = MAX_CLASS_LINES) -> list[str]:
    out = []
    for path in source_files(root):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                doc = ast.get_docstring(node) or ""
                if n > limit and LONG_CLASS_MARK not in doc:
                    out.append(f"{module_name(path, root)}.{node.name}: {n} lines")
    return out


# ------------------------------------------------------------------------------ the real package
def test_architecture_table_names_every_package() -> None:
    table = allowed_imports(ROOT / "ARCHITECTURE.md")
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert packages == set(table), f"packages vs ARCHITECTURE.md table: {packages ^ set(table)}"
    for pkg, may in table.items():
        assert may <= set(table), f"{pkg} may import unknown packages {may - set(table)}"


def test_imports_follow_architecture_directions() -> None:
    table = allowed_imports(ROOT / "ARCHITECTURE.md")
    assert direction_violations(PACKAGE, table) == []


def test_no_cycles_between_packages() -> None:
    assert cycles(package_graph(PACKAGE)) == []


def test_no_cycles_between_modules() -> None:
    """Not even inside a package: two modules importing each other (lazily or not) are one."""
    assert cycles(module_graph(PACKAGE)) == []


def test_tracer_modes_are_siblings() -> None:
    assert sibling_violations(PACKAGE, ("ccprofd.tracing.instrumented", "ccprofd.tracing.unwind"),
                              chooser="ccprofd.tracing.session") == []


def test_no_private_names_across_modules() -> None:
    assert private_name_violations(PACKAGE) == []


def test_no_overlong_classes_without_a_stated_reason() -> None:
    assert long_classes(PACKAGE) == []


def test_python_dash_m_entry_points_exist() -> None:
    """Every ``python -m ccprofd....`` the code and tests spawn names a runnable module."""
    pattern = re.compile(r'"-m",\s*"(ccprofd[\w.]*)"')
    found = set()
    for path in [*source_files(PACKAGE), *(ROOT / "tests").rglob("*.py"), *(ROOT / "bench").rglob("*.py")]:
        found |= set(pattern.findall(path.read_text(encoding="utf-8")))
    assert found, "no -m entry points found: the pattern is broken"
    for name in sorted(found):
        target = ROOT.joinpath(*name.split("."))
        if target.is_dir():
            assert (target / "__main__.py").exists(), f"-m {name}: package without __main__.py"
        else:
            text = target.with_suffix(".py").read_text(encoding="utf-8")
            assert 'if __name__ == "__main__":' in text, f"-m {name}: no __main__ guard"


def test_console_scripts_resolve() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    scripts = meta["project"]["scripts"]
    assert set(scripts) == {"ccprofd", "ccprofctl"}
    for spec in scripts.values():
        mod, _, func = spec.partition(":")
        assert callable(getattr(importlib.import_module(mod), func)), spec


def test_package_data_covers_every_bpf_source() -> None:
    """A wheel must carry every BPF C source and header the loaders read at run time."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    globs = meta["tool"]["setuptools"]["package-data"]["ccprofd"]
    data = [p for p in PACKAGE.rglob("*") if p.suffix in (".c", ".h")]
    assert data
    for p in data:
        rel = str(p.relative_to(PACKAGE))
        assert any(fnmatch(rel, g) and rel.count("/") == g.count("/") for g in globs), rel


# ------------------------------------------------------------------ the checker on synthetic trees
def _tree(tmp: Path, files: dict[str, str]) -> Path:
    root = tmp / "pkg"
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    for d in [root, *root.rglob("*")]:
        if d.is_dir() and not (d / "__init__.py").exists():
            (d / "__init__.py").write_text("")
    return root


TABLE = {"low": set(), "mid": {"low"}, "top": {"low", "mid"}}


def test_checker_finds_a_function_level_import_against_the_direction(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"low/a.py": "def f():\n    from pkg.top.b import g\n", "top/b.py": "g = 1\n",
                            "mid/c.py": "from pkg.low.a import f\n"})
    bad = direction_violations(root, TABLE)
    assert len(bad) == 1 and "low imports pkg.top.b" in bad[0]


def test_checker_finds_cycles(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"top/x/a.py": "from pkg.top.y.b import B\nA = 1\n",
                            "top/y/b.py": "def f():\n    from ..x import a\n",
                            "mid/c.py": "from pkg.top.x.a import A\n", "low/d.py": "from pkg.mid import c\n",
                            "top/z.py": "from pkg.low import d\n"})
    assert cycles(module_graph(root)) == [["pkg.top.x.a", "pkg.top.y.b"]]
    assert cycles(package_graph(root)) == [["low", "mid", "top"]]
    acyclic = _tree(tmp_path / "ok", {"top/x/a.py": "A = 1\n", "top/y/b.py": "from pkg.top.x.a import A\n"})
    assert cycles(module_graph(acyclic)) == [] and cycles(package_graph(acyclic)) == []


def test_checker_finds_siblings_importing_each_other(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"t/i/m.py": "def f():\n    from pkg.t.u.m import g\n", "t/u/m.py": "g = 1\n",
                            "t/session.py": "from pkg.t.i.m import f\n",
                            "t/shared.py": "from pkg.t.u import m\n"})
    bad = sibling_violations(root, ("pkg.t.i", "pkg.t.u"), chooser="pkg.t.session")
    assert len(bad) == 2
    assert any("pkg.t.i.m" in b and "sibling" in b for b in bad)
    assert any(b.startswith("pkg.t.shared") for b in bad)


def test_checker_finds_private_names(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"low/a.py": "_x = 1\ndef _f(): ...\n",
                            "mid/b.py": "from pkg.low.a import _x\n",
                            "mid/c.py": "from pkg.low import a\nprint(a._f)\n",
                            "mid/d.py": "from pkg.low.a import __doc__\n"})
    bad = private_name_violations(root)
    assert sorted(b.split(":")[0] for b in bad) == ["pkg.mid.b", "pkg.mid.c"]


REASON = f"'''Ok.\n\n    {LONG_CLASS_MARK} one state machine.'''"


def test_checker_finds_long_classes_without_a_reason(tmp_path: Path) -> None:
    body = "    x = 1\n" * 301
    root = _tree(tmp_path, {"low/a.py": f"class Big:\n    '''Big.'''\n{body}",
                            "low/b.py": f"class Ok:\n    {REASON}\n{body}"})
    assert long_classes(root) == ["pkg.low.a.Big: 303 lines"]


def test_table_parser_reads_the_markdown(tmp_path: Path) -> None:
    doc = tmp_path / "A.md"
    doc.write_text("| package | what | may import |\n|---|---|---|\n| `low/` | x | — |\n"
                   "| `mid/` | y, z | low |\n| `top/` | z | everything |\n")
    assert allowed_imports(doc) == {"low": set(), "mid": {"low"}, "top": {"low", "mid"}}

"""The package's shape: no import circle, modules of a readable size, docstrings that are not a
lab notebook, and no machine name or timing in package code (issue 39's "Must show")."""

import ast
import re
import statistics
from pathlib import Path

import megatron_rlhf

PACKAGE = Path(megatron_rlhf.__file__).resolve().parent
NAME = PACKAGE.name
MEDIAN_MAX_LINES = 150
MODULE_MAX_LINES = 500
DOCSTRING_MAX_SHARE = 0.12
# A machine name, a core count or a timing: these belong in docs/benchmarks, not in the code.
MEASUREMENT = re.compile(r"EPYC|Xeon|\b\d+-core\b|\bone core\b|\d+(\.\d+)? ?ms\b", re.IGNORECASE)


def _modules():
    """{dotted module name: source path} for every .py file of the package."""
    mods = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = (NAME,) + path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _import_time_nodes(tree):
    """Import statements that run when the module is imported: everything outside function bodies,
    so those under `if TYPE_CHECKING:`, `try:` or a class body count too."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        stack.extend(ast.iter_child_nodes(node))


def _imported(name, path, node, modules):
    """The package modules an import statement in module `name` (file `path`) loads."""
    if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
            pkg = pkg[:len(pkg) - (node.level - 1)]
            base = ".".join(pkg + ([base] if base else []))
        # `from pkg import mod` loads pkg.mod when that is a module, else a name from pkg.
        targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    found = set()
    for t in targets:
        # `import a.b.c` where only a.b is ours still loads a.b: take the longest known prefix.
        while t and t not in modules:
            t = t.rpartition(".")[0]
        if t:
            found.add(t)
    return found


def import_graph():
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[name] = set()
        for node in _import_time_nodes(tree):
            graph[name] |= _imported(name, path, node, modules)
    return graph


def find_cycles(graph):
    """One cycle (a list of modules, first repeated at the end) per strongly connected component."""
    index, low, on_stack, stack, sccs = {}, {}, set(), [], []

    def strongconnect(v):  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            sccs.append(set(scc))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    cycles = []
    for scc in sccs:
        start = min(scc)
        if len(scc) == 1 and start not in graph[start]:
            continue
        # Breadth-first from start back to start inside the component: a shortest cycle.
        prev, frontier = {}, [start]
        while frontier and start not in prev:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & scc):
                    if w not in prev:
                        prev[w] = v
                        nxt.append(w)
            frontier = nxt
        path, v = [start], prev[start]
        while v != start:
            path.append(v)
            v = prev[v]
        cycles.append([start] + path[:0:-1] + [start])
    return cycles


def docstring_lines(tree):
    """Line numbers of docstrings: a string statement that opens a module, class or function body,
    or that follows an assignment (an attribute docstring)."""
    lines = set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for i, stmt in enumerate(node.body):
            if (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
                    and isinstance(stmt.value.value, str)
                    and (i == 0 or isinstance(node.body[i - 1], (ast.Assign, ast.AnnAssign)))):
                lines.update(range(stmt.lineno, stmt.end_lineno + 1))
    return lines


def _line_counts():
    return {name: len(path.read_text().splitlines()) for name, path in _modules().items()}


# -- the tests -------------------------------------------------------------------------------


def test_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}
    assert sorted(find_cycles(graph)) == [["a", "b", "c", "a"], ["e", "e"]]


def test_import_graph_sees_type_checking_and_relative_imports(tmp_path):
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\n"
                     "def f():\n    from megatron_rlhf.x import c\n")
    nodes = list(_import_time_nodes(tree))
    modules = {"megatron_rlhf", "megatron_rlhf.x", "megatron_rlhf.x.a", "megatron_rlhf.x.b",
               "megatron_rlhf.x.c"}
    found = set().union(*(_imported("megatron_rlhf.x.a", tmp_path / "a.py", n, modules) for n in nodes))
    assert found == {"megatron_rlhf.x.b"}  # the import inside f() runs later, not at import time


def test_no_import_circle():
    cycles = find_cycles(import_graph())
    assert not cycles, "import circles in the package:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_module_sizes():
    counts = _line_counts()
    too_big = {n: c for n, c in counts.items() if c > MODULE_MAX_LINES}
    median = statistics.median(counts.values())
    assert not too_big, f"modules over {MODULE_MAX_LINES} lines: {sorted(too_big.items())}"
    assert median <= MEDIAN_MAX_LINES, f"median module is {median} lines (at most {MEDIAN_MAX_LINES})"


def test_docstring_share():
    total = doc = 0
    per_module = {}
    for name, path in _modules().items():
        src = path.read_text()
        n, d = len(src.splitlines()), len(docstring_lines(ast.parse(src)))
        total, doc = total + n, doc + d
        per_module[name] = d
    share = doc / total
    worst = sorted(per_module.items(), key=lambda kv: -kv[1])[:5]
    assert share <= DOCSTRING_MAX_SHARE, (f"docstrings are {share:.1%} of the package's {total} lines "
                                          f"(at most {DOCSTRING_MAX_SHARE:.0%}); most: {worst}")


def test_measurement_pattern():
    hits = ["one EPYC core", "a Xeon", "on 2-core CI", "one core", "121 -> 133 ms", "2.5ms"]
    misses = ["timeout_ms = 5", "items", "score 12 msgs", "core_count"]
    assert all(MEASUREMENT.search(s) for s in hits)
    assert not any(MEASUREMENT.search(s) for s in misses)


def test_no_machine_name_or_timing_in_package_code():
    found = []
    for name, path in _modules().items():
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if MEASUREMENT.search(line):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{i}: {line.strip()[:100]}")
    assert not found, (f"{len(found)} lines name a machine, a core count or a timing "
                       "(they belong in docs/benchmarks):\n" + "\n".join(found))

"""No import cycles between byteps's own modules.

Dependencies point one way: plugins -> byteps (common, config) -> core -> ...; launcher -> launch_env
-> config. This test reads every module's imports with ``ast`` (no module is imported, so it runs
without torch, TensorFlow, MXNet or a GPU), maps the folders to import names the way setup.py's
``package_dir`` does, and fails on any cycle, printing it.

Counted: ``import a.b``, ``from a import b`` (the module ``a.b`` when it is one of ours, else ``a``),
relative imports, and imports inside functions and methods (a function-level import is still a
dependency: it only hides the cycle from import time). Not counted: imports under
``if TYPE_CHECKING:``, cimports of the Cython sources (a ``.pyx`` extension is a module of its own,
with the dependencies of its plain import lines: ``from . import _server_core`` depends on the
extension, not on the package's ``__init__``), and the implicit import
of a module's parent packages (every module would then depend on ``byteps/__init__.py``).
"""
import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the folders the issue names; setup.py maps them (and more) onto import names
FOLDERS = ("byteps_py", "core", "summation", "scheduler", "topology", "plugins")

#: Cycles that are known and owned by someone, as sets of module names. Each entry must match one
#: strongly connected component exactly, so a cycle that grows is reported.
ALLOWED_CYCLES = []


def package_dir():
    """setup.py's PACKAGE_DIR (import name -> folder), read without running setup.py."""
    with open(os.path.join(ROOT, "setup.py")) as f:
        tree = ast.parse(f.read(), "setup.py")
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "PACKAGE_DIR" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no PACKAGE_DIR")


def modules():
    """{module name: (path, is_package)} of every .py file under FOLDERS, named as installed."""
    found = {}
    for pkg, folder in package_dir().items():
        if not folder.split("/")[0] in FOLDERS:
            continue
        base = os.path.join(ROOT, folder)
        mapped = {os.path.join(ROOT, f) for f in package_dir().values()} - {base}
        for dirpath, dirnames, filenames in os.walk(base):
            # a subfolder mapped to its own package is walked under that name; tests are not shipped
            dirnames[:] = [d for d in dirnames if os.path.join(dirpath, d) not in mapped
                           and d not in ("__pycache__", "tests")]
            rel = os.path.relpath(dirpath, base)
            prefix = pkg if rel == "." else pkg + "." + rel.replace(os.sep, ".")
            for name in filenames:
                if name.endswith(".pyx"):  # a compiled extension: a module of ours with no Python imports
                    found[f"{prefix}.{name[:-4]}"] = (os.path.join(dirpath, name), False)
                    continue
                if not name.endswith(".py"):
                    continue
                if name == "__init__.py":
                    found[prefix] = (os.path.join(dirpath, name), True)
                else:
                    found[f"{prefix}.{name[:-3]}"] = (os.path.join(dirpath, name), False)
    return found


def _type_checking_blocks(tree):
    """Nodes under ``if TYPE_CHECKING:`` / ``if typing.TYPE_CHECKING:``."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            t = node.test
            name = t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else None
            if name == "TYPE_CHECKING":
                for child in node.body:
                    skip.update(id(n) for n in ast.walk(child))
    return skip


def imports_of(name, path, is_package, known):
    """[(imported module, line)] of module ``name``, restricted to modules in ``known``."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    skip = _type_checking_blocks(tree)
    package = name if is_package else name.rpartition(".")[0]
    out = []

    def add(target, line):
        # the longest prefix that is one of ours ("byteps.core.gpu.cuda" -> "byteps.core.gpu")
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            out.append((target, line))

    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                add(sub if sub in known else source, node.lineno)
    return out


def pyx_imports(path, known):
    """[(imported module, line)] of a Cython source's ``import a.b`` / ``from a.b import c`` lines (absolute
    imports only, which is what our .pyx files use), restricted to modules in ``known``."""
    out = []
    with open(path) as f:
        for lineno, text in enumerate(f, 1):
            m = re.match(r"(?:from\s+([\w.]+)\s+import\s+([\w, ]+)|import\s+([\w.]+))\s*(?:#.*)?$", text)
            if not m:
                continue
            targets = [f"{m.group(1)}.{n.strip()}" for n in m.group(2).split(",")] if m.group(1) else [m.group(3)]
            for target in targets:
                while target and target not in known:
                    target = target.rpartition(".")[0]
                if target:
                    out.append((target, lineno))
    return out


def import_graph():
    """{module: {imported module: first line}} over byteps's own modules."""
    mods = modules()
    graph = {}
    for name, (path, is_package) in mods.items():
        edges = {}
        if path.endswith(".pyx"):  # Cython is not Python's grammar: its plain import lines, not cimports
            for target, line in pyx_imports(path, mods):
                edges.setdefault(target, line)
            graph[name] = edges
            continue
        for target, line in imports_of(name, path, is_package, mods):
            edges.setdefault(target, line)
        graph[name] = edges
    return graph


def strongly_connected(graph):
    """Tarjan's strongly connected components with more than one module (or a self-import)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def a_cycle(graph, comp):
    """A shortest cycle through ``comp``'s first module, as [m0, m1, ..., m0]."""
    start = min(comp)
    prev, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:  # back at the start: walk the predecessors from v
                    path = [v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return path[::-1] + [start]
                if w in comp and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {sorted(comp)}")


def describe(graph, cycle):
    mods = modules()
    steps = []
    for a, b in zip(cycle, cycle[1:]):
        path = os.path.relpath(mods[a][0], ROOT)
        steps.append(f"  {a} ({path}:{graph[a][b]}) imports {b}")
    return "\n".join(steps)


def test_the_graph_covers_the_package():
    graph = import_graph()
    # the folders map as setup.py says, function-level imports are seen
    assert "byteps.launcher" in graph and "byteps.core.engine" in graph and "byteps.torch.ops" in graph
    assert "byteps.server.server" in graph and "byteps.topology.strategy" in graph
    assert "byteps.core.gpu" in graph["byteps.build_info"]  # imported inside cuda_built()
    assert "byteps.core.stages" in graph["byteps.config"]  # imported inside a function


def test_cycle_finder_finds_and_prints_cycles():
    g = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}, "e": {"e": 5}}
    comps = strongly_connected(g)
    assert sorted(map(sorted, comps)) == [["a", "b", "c"], ["e"]]
    assert a_cycle(g, {"a", "b", "c"}) == ["a", "b", "c", "a"]
    assert a_cycle(g, {"e"}) == ["e", "e"]


def test_no_import_cycles():
    graph = import_graph()
    comps = strongly_connected(graph)
    unexpected = [c for c in comps if c not in ALLOWED_CYCLES]
    report = []
    for comp in unexpected:
        cycle = a_cycle(graph, comp)
        report.append(f"cycle among {sorted(comp)}:\n" + " -> ".join(cycle) + "\n" + describe(graph, cycle))
    assert not unexpected, "byteps modules import each other in a loop (let dependencies point one way: " \
                           "plugins -> byteps -> core):\n\n" + "\n\n".join(report)
    stale = [sorted(c) for c in ALLOWED_CYCLES if c not in comps]
    assert not stale, f"these allowed cycles are gone: delete them from ALLOWED_CYCLES: {stale}"

"""The layering of the house, checked from the source (README "Layout"):

    dflash/     the method: torch + transformers, never Ray, DeepSpeed, FastAPI or vLLM
    pipelines/  Ray Data / Ray Train programs: import dflash/, never serve/ or jobs/
    serve/      the Ray Serve app: imports dflash/, never pipelines/ or jobs/
    jobs/       wires the stages: may import all of the above

and no import cycle between project modules. Every import counts, including the lazy ones
inside functions: a cycle or an upward arrow is there whether or not it runs at start-up.

One file is a program, not a module: dflash/vllm_worker.py runs in the vLLM venv (it is the
only file that imports vllm) and nothing imports it; that is checked too.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("dflash", "pipelines", "serve", "jobs")
FORBIDDEN = {
    "dflash": {"ray", "deepspeed", "fastapi", "starlette", "vllm", "pipelines", "serve", "jobs"},
    "pipelines": {"serve", "jobs", "fastapi", "starlette"},
    "serve": {"pipelines", "jobs", "deepspeed"},
    "jobs": set(),
}
VLLM_PROGRAMS = {"dflash/vllm_worker.py": {"vllm"}}  # may import these; must import nothing of ours


def module_name(path: Path, root: Path = REPO) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, root: Path = REPO) -> set[str]:
    """Absolute module names imported anywhere in the file (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = module_name(path, root).split(".")
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + (path.name == "__init__.py")]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found |= {f"{mod}.{a.name}" for a in node.names}  # `from pkg import module`
    return found


def project_graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")]
    modules = {module_name(p): p for p in files}
    graph = {}
    for name, path in modules.items():
        graph[name] = {m for m in imports_of(path) if m in modules and m != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path [a, b, ..., a], or None. Plain DFS with colours."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_find_cycle_finds_one_and_only_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"a.x"}, "a.x": set(), "b": {"b"}}) == ["b", "b"]


def test_imports_of_sees_lazy_and_relative_imports(tmp_path):
    pkg = tmp_path / "dflash"
    pkg.mkdir()
    (pkg / "m.py").write_text("def f():\n    import ray\n    from . import other\n    from .x import y\n")
    assert {"ray", "dflash", "dflash.other", "dflash.x", "dflash.x.y"} <= imports_of(pkg / "m.py", tmp_path)


def test_no_layer_imports_what_it_must_not():
    problems = []
    for pkg, banned in FORBIDDEN.items():
        for path in sorted((REPO / pkg).rglob("*.py")):
            rel = str(path.relative_to(REPO))
            for mod in sorted(imports_of(path)):
                top = mod.split(".")[0]
                if rel in VLLM_PROGRAMS:
                    if top in PACKAGES:
                        problems.append(f"{rel} (run in the vLLM venv) imports our {mod}")
                elif top in banned:
                    problems.append(f"{rel} imports {mod}")
    assert not problems, "layering broken:\n" + "\n".join(problems)


def test_the_vllm_program_is_imported_by_nothing():
    importers = [name for name, deps in project_graph().items() if "dflash.vllm_worker" in deps]
    assert not importers, f"dflash/vllm_worker.py runs in the vLLM venv; imported by {importers}"


def test_no_import_cycle_between_project_modules():
    graph = project_graph()
    assert len(graph) > 20, "the scan found too few modules to mean anything"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)

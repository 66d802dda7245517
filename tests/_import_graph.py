"""The project's modules and the imports between them, read from the source (nothing is imported): the floors
the packages stand on (the rule tests/test_import_graph.py holds and docs/architecture.md draws), every project
module by name, and the graph of their imports. tests/test_commands.py walks the same modules."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


# Lowest first; a package may import packages of lower floors only (and itself). Several on one floor do not
# import each other.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("commands", "settings"),  # settings: a setting's choices or range on its dataclass field, plain data
    ("atomic_files", "configs", "objectives"),  # objectives: the table of objectives and samplers, plain data
    ("fid", "samplers"),
    ("dit_vca",),
    ("sit_vca",),
    ("generation",),
    ("training",),
    ("sample_arguments",),  # sample.py's parser and checks; sweep.py checks its points with them
    ("judges",),  # the classifiers and real images that the demo, the studies and bench.demo score with
    ("train", "sample", "demo"),
    ("scored_points",),  # an export sampled by sample.py's code, scored, recorded, reused: sweep's and the studies'
    ("sweep",),  # scored points of exports x guidance x scale, post-hoc EMA reconstructions by training.posthoc_ema
    ("bench",),  # speed and memory
    ("studies",),  # sample quality: trains with train.py, scores points with the judges, reports with bench's tools
)


FLOOR = {package: level for level, packages in enumerate(FLOORS) for package in packages}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    """Every module of the packages and top-level scripts above (tests and benchmarks' data excluded)."""
    modules = {}
    for path in REPO.rglob("*.py"):
        relative = path.relative_to(REPO)
        if relative.parts[0] in FLOOR or (len(relative.parts) == 1 and path.stem in FLOOR):
            modules[module_name(path)] = path
    return modules


def imported_modules(path: Path, name: str, known: set[str]) -> set[str]:
    """The project modules that `path` (module `name`) imports, wherever the import statement stands."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import sub` imports the module pkg.sub when there is one, else a name of pkg
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` of a name inside a module: its module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imported_modules(path, name, set(modules)) for name, path in modules.items()}


def top(module: str) -> str:
    return module.split(".")[0]

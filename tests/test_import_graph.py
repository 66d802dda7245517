"""The project's structure, held by the suite: packages import only packages on floors below their own, no module
imports itself back through a circle, a study imports no other study, and docs/architecture.md lists these floors;
in tests/, test modules import helper modules (tests/_*.py), never each other, and that page lists every helper.

The floors follow the README's data flow (configs -> training run -> export -> generation -> .npz -> fid), read
as "who may use whom": a command uses training, training uses generation, generation uses the models and
samplers. `commands` (the one user-error base and `run_command`) is the ground floor, so every package may
raise its errors; `fid` stands alone from the models (it only reads images and statistics). Every import
counts, also those inside functions or under `if TYPE_CHECKING:`: a circle drawn only for the type checker
is still a circle.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from _import_graph import FLOOR, FLOORS, REPO, import_graph, imported_modules, top

# What every study may import of the studies package besides itself: their shared machinery.
STUDY_MACHINERY = {"studies", "studies.runner", "studies.scorers", "studies.report"}


def test_every_project_package_has_a_floor():
    tops = {
        path.parts[0] if len(path.parts) > 1 else path.stem
        for path in (p.relative_to(REPO) for p in REPO.glob("*/__init__.py"))
    } | {"train", "sample", "demo"}
    assert tops - {"tests"} <= set(FLOOR), f"packages without a floor in FLOORS: {sorted(tops - set(FLOOR))}"


def test_packages_import_only_packages_below_them():
    arrows_up = sorted(
        f"{module} -> {target}"
        for module, targets in import_graph().items()
        for target in targets
        if top(target) != top(module) and FLOOR[top(target)] >= FLOOR[top(module)]
    )
    assert not arrows_up, "imports that run sideways or back up:\n" + "\n".join(arrows_up)


def test_fid_knows_nothing_of_models():
    graph = import_graph()
    outside = {top(target) for module, targets in graph.items() if top(module) == "fid" for target in targets}
    assert outside <= {"fid", "commands", "atomic_files"}, outside


def test_a_study_imports_no_other_study_and_not_the_demo():
    """The studies share their machinery (runner, scorers, report) and score with the judges, like the demo does:
    a study that imports another, or the demo as a library, ties two rooms' insides together."""
    graph = import_graph()
    studies = {module for module in graph if top(module) == "studies" and module not in STUDY_MACHINERY}
    assert studies, "no study found under studies/"
    ties = sorted(
        f"{module} -> {target}"
        for module in studies
        for target in graph[module]
        if (top(target) == "studies" and target not in STUDY_MACHINERY) or top(target) == "demo"
    )
    assert not ties, "a study imports another study or the demo:\n" + "\n".join(ties)


def documented_floors(page: Path) -> tuple[tuple[str, ...], ...]:
    """The numbered list of docs/architecture.md's "The rooms and their floors": the rooms named (in backticks)
    before the colon of each item, lowest floor first."""
    section = page.read_text().split("## The rooms and their floors", 1)[1].split("\n## ", 1)[0]
    floors = []
    for number, names in re.findall(r"^(\d+)\. ((?:`\w+`(?:, )?)+):", section, re.M):
        assert int(number) == len(floors) + 1, f"{page.name}: floor {number} out of order"
        floors.append(tuple(re.findall(r"`(\w+)`", names)))
    return tuple(floors)


def test_the_architecture_page_lists_these_floors():
    assert documented_floors(REPO / "docs" / "architecture.md") == FLOORS


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of the graph as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (circle := visit(target)):
                return circle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (circle := visit(node)):
            return circle
    return None


def test_no_module_imports_itself_through_a_circle():
    circle = find_circle(import_graph())
    assert circle is None, "import circle: " + " -> ".join(circle)


@pytest.mark.parametrize(
    "graph, expected",
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
    ],
)
def test_find_circle_finds_circles(graph, expected):
    assert find_circle(graph) == expected


def test_the_graph_sees_imports_inside_functions_and_type_checking(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from training.run import X\n"
        "def f():\n    from generation.export import Export\n    import dit_vca.models\n"
    )
    known = {"training.run", "generation.export", "dit_vca.models", "dit_vca", "training", "generation"}
    assert imported_modules(source, "training.trackers", known) == {
        "training.run",
        "generation.export",
        "dit_vca.models",
    }


def imports_of_test_modules(folder: Path) -> list[str]:
    """`file:line module` for every import, anywhere in a module of `folder`, of one of its test modules."""
    test_modules = {path.stem for path in folder.glob("test_*.py")}
    found = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            found += [f"{path.name}:{node.lineno} {name}" for name in names if name.split(".")[0] in test_modules]
    return found


def test_test_modules_import_helper_modules_never_each_other():
    """What several test files share lives in a helper module named after what it holds, with a leading underscore
    (docs/architecture.md, "The tests"). A test module that another one imports is a helper module under a test's
    name, and a test function imported with it is collected twice."""
    tests = REPO / "tests"
    assert not imports_of_test_modules(tests), "test modules imported by other modules:\n" + "\n".join(
        imports_of_test_modules(tests)
    )
    unnamed = [path.name for path in tests.glob("*.py") if not path.name.startswith(("test_", "_", "conftest."))]
    assert not unnamed, f"modules in tests/ that are neither test modules nor _helpers: {unnamed}"


def test_the_architecture_page_lists_every_helper_module():
    """tests/conftest.py sends a reader to docs/architecture.md's table of helper modules: it names all of them."""
    page = (REPO / "docs" / "architecture.md").read_text()
    unlisted = [path.name for path in sorted((REPO / "tests").glob("_*.py")) if f"`tests/{path.name}`" not in page]
    assert not unlisted, f"helper modules that docs/architecture.md's table of the tests leaves out: {unlisted}"


def test_the_test_module_check_sees_imports_anywhere(tmp_path):
    (tmp_path / "test_a.py").write_text("def f():\n    from test_b import x\n")
    (tmp_path / "test_b.py").write_text("import _helper\nimport test_a.sub\nx = 1\n")
    (tmp_path / "_helper.py").write_text("from test_a import f\n")
    assert imports_of_test_modules(tmp_path) == ["_helper.py:1 test_a", "test_a.py:2 test_b", "test_b.py:2 test_a.sub"]

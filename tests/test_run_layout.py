"""The run folder's layout has one home, generation.run_layout: no other module spells its names (checked on the
source tree), and it holds the one parse of the step folders; every reader of a run's newest checkpoint takes only
a complete one."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest

import sample
from generation import run_layout
from generation.run_layout import STEP_FILE, posthoc_export_folder, step_name, step_of

REPO = Path(__file__).resolve().parents[1]
HOME = REPO / "generation" / "run_layout.py"

# Every name of the layout: the home's string constants (file and folder names, the step and profile prefixes).
NAMES = {
    value
    for key, value in vars(run_layout).items()
    if key.isupper() and isinstance(value, str) and not key.endswith(("_SUFFIX", "_FILES"))
} | set(run_layout.TRACKER_FOLDERS)
PREFIXES = (run_layout.STEP_PREFIX, run_layout.PROFILE_PREFIX)  # step-XXXXXXX, sigma_rel-S...
# Names that are also plain words of other vocabularies (JSON keys of records, tracker names): a stray spelling
# only where the string is a path part, an operand of `/`.
WORDS = {"export", "exports", "samples", "tensorboard", "wandb"}

# (file, string): why that file may spell it.
EXCEPTIONS = {
    ("fid/weights.py", "checkpoints"): "torch.hub's own folder of downloaded weights (TORCH_HOME/hub/checkpoints)",
    ("generation/official.py", "checkpoints"): "torch.hub's own folder of downloaded weights, as fid/weights.py",
    ("scored_points.py", "samples"): "the scored points' own folder (sweep.py's OUT/samples/<point>.npz), not a run's",
}


def source_files() -> list[Path]:
    """The project's Python files: the tests spell the layout on purpose (as the expected values), and hidden
    folders hold environments and caches."""
    return sorted(
        path
        for path in REPO.rglob("*.py")
        if not any(part.startswith(".") for part in path.relative_to(REPO).parts)
        and path.relative_to(REPO).parts[0] != "tests"
        and path != HOME
    )


def docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def stray_spellings(source: str) -> list[tuple[int, str]]:
    """(line, string) of every string in `source` (f-strings' literal parts too; docstrings are prose) that spells
    a name of the run layout as a part of a path."""
    tree = ast.parse(source)
    prose = docstrings(tree)
    path_operands = {
        id(side)
        for node in ast.walk(tree)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)
        for side in (node.left, node.right)
    }
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Constant) or not isinstance(node.value, str) or id(node) in prose:
            continue
        for part in node.value.split("/"):
            bare = part.lstrip("^\\.?")  # a regular expression's r"^\.?step-" or a hidden ".step-"
            if part in WORDS and id(node) not in path_operands:
                continue
            if part in NAMES or bare.startswith(PREFIXES):
                found.append((node.lineno, node.value))
                break
    return found


def test_no_module_but_the_home_spells_the_run_layout():
    strays, used = [], set()
    for path in source_files():
        name = str(path.relative_to(REPO))
        for line, text in stray_spellings(path.read_text()):
            if (name, text) in EXCEPTIONS:
                used.add((name, text))
            else:
                strays.append(f"{name}:{line}: {text!r}")
    assert not strays, "names of the run layout outside generation.run_layout (import them from there):\n" + "\n".join(
        strays
    )
    assert used == set(EXCEPTIONS), f"exceptions that no longer apply: {sorted(set(EXCEPTIONS) - used)}"


@pytest.mark.parametrize(
    "source, expected",
    [
        ('x = run / "checkpoints" / name', True),
        ('x = f"{run}/checkpoints/{name}"', True),
        ('name = f"step-{step:07d}"', True),
        ('pattern = r"^\\.?step-\\d{7,}$"', True),
        ('folder = f"sigma_rel-{s:g}"', True),
        ('x = run / "samples"', True),
        ('record = {"samples": 3, "export": "e"}', False),  # JSON keys, not paths
        ('"""A docstring naming checkpoints/step-0000020/ as prose."""', False),
        ('flag = "--last-step-size"', False),
    ],
)
def test_the_scan_finds_path_spellings_only(source, expected):
    assert bool(stray_spellings(source)) is expected


def test_step_folders_have_one_parse():
    assert step_name(20) == "step-0000020" and step_of(step_name(20)) == 20 and step_of("step-12345678") == 12345678
    for other in ("step-20", ".step-0000020.tmp", "step-0000020.old", "step-0000020.png", "steps-0000020"):
        assert step_of(other) is None, other
    for written in ("step-0000020", ".step-0000020.tmp", "step-0000020.png", ".step-0000020.png.tmp-42"):
        assert STEP_FILE.match(written), written
    assert posthoc_export_folder("out", 0.05, 20) == Path("out/sigma_rel-0.05-step-0000020")


def write_checkpoint(run_dir: Path, step: int, export: Path, complete: bool) -> Path:
    """A checkpoint folder with `export`'s export in it; complete ones have their trainer_state.json."""
    folder = run_dir / "checkpoints" / f"step-{step:07d}"
    shutil.copytree(export, folder / "export")
    if complete:
        (folder / "trainer_state.json").write_text(json.dumps({"step": step, "examples_seen": 0, "num_processes": 1}))
    return folder


def test_every_reader_of_the_newest_checkpoint_takes_only_a_complete_one(export, tmp_path):
    # Before: sample.py --ckpt RUN (generation.find_export) took step 4, which --resume latest leaves out.
    from generation import ExportError, find_export
    from training.checkpoint_folders import resolve_resume

    run_dir = tmp_path / "run"
    complete = write_checkpoint(run_dir, 2, export, complete=True)
    write_checkpoint(run_dir, 4, export, complete=False)  # its export is whole, the folder is not
    assert find_export(run_dir) == complete / "export"
    assert resolve_resume("latest", run_dir / "checkpoints") == complete
    assert sample.resolved_export(run_dir) == (complete / "export").resolve()
    shutil.rmtree(complete)
    with pytest.raises(ExportError, match=r"step-0000004/export is in a checkpoint without trainer_state.json: pass"):
        find_export(run_dir)  # the way out, for a run whose exports alone were copied


def test_resume_latest_where_every_checkpoint_is_incomplete_is_refused_not_started_over(
    export, tmp_path, train_script, capsys
):
    """Issue 47: --resume latest in a run whose checkpoints all lack trainer_state.json (a crash during the first
    save) started from step 0 without a word and later saved over them. It is one line, exit 2, before anything
    is built (sample.py --ckpt on the same folder explains the situation too), and the folder stays."""
    from _tiny_runs import DIGITS, TINY
    from _user_errors import one_line_error

    run_dir = tmp_path / "run"
    incomplete = write_checkpoint(run_dir, 4, export, complete=False)
    before = sorted(path.relative_to(run_dir) for path in run_dir.rglob("*"))
    arguments = ["--config", str(DIGITS), *TINY, "train.max_steps=2", f"run.dir={run_dir}", "--resume", "latest"]
    error = one_line_error(train_script.main, arguments, capsys)
    assert f"--resume latest: {run_dir / 'checkpoints'} holds step-0000004 but no complete checkpoint" in error
    assert sorted(path.relative_to(run_dir) for path in run_dir.rglob("*")) == before
    assert not (incomplete / "trainer_state.json").exists()

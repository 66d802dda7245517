"""The committed results say what produced them: every JSON result (and every row of a JSONL one) names the commit it
was measured on, and every Markdown table ends with it (bench._harness.save_results writes both, bench.gpu stamps
its rows); superseded results live in bench/results/history/, each listed in its index."""

import json
import re
import subprocess
from pathlib import Path

import pytest

from bench._harness import (
    COMMIT_VARIABLE,
    STAMP_KEY,
    save_results,
    source_stamp,
    stamp_line,
    stamped_table,
    subplots,
)

REPO = Path(__file__).resolve().parents[1]
RESULT_FOLDERS = [REPO / "bench" / "results", REPO / "studies" / "results"]
HISTORY = REPO / "bench" / "results" / "history"
INDEX = HISTORY / "README.md"
SHA = re.compile(r"[0-9a-f]{40}")


def committed_results(suffix: str) -> list[Path]:
    """The result files of one kind in the result folders and their history, smoke runs (`*-quick.*`, ignored by git)
    and the history's index aside."""
    paths = [path for folder in RESULT_FOLDERS for path in folder.rglob(f"*{suffix}")]
    return sorted(path for path in paths if "-quick." not in path.name and path != INDEX)


def check_stamp(stamp: dict, where: str) -> None:
    """A stamp measured with the result (a full sha and whether the tree differed from it), or one recovered from git
    history afterwards, which says so and how (its commit None where none can be recovered)."""
    assert set(stamp) >= {"commit", "dirty"}, f"{where}: {stamp}"
    if "recovered_from_git_history" in stamp:
        assert stamp["dirty"] is None and stamp["recovered_from_git_history"].strip(), where
        assert stamp["commit"] is None or SHA.fullmatch(stamp["commit"]), where
    else:
        assert SHA.fullmatch(stamp["commit"] or ""), f"{where}: no commit in {stamp}"
        assert isinstance(stamp["dirty"], bool), where


@pytest.mark.parametrize("path", committed_results(".json"), ids=lambda path: str(path.relative_to(REPO)))
def test_every_committed_json_result_names_its_commit(path):
    results = json.loads(path.read_text())
    assert STAMP_KEY in results, f"{path.relative_to(REPO)} does not say which commit it was measured on"
    check_stamp(results[STAMP_KEY], str(path.relative_to(REPO)))


@pytest.mark.parametrize("path", committed_results(".jsonl"), ids=lambda path: str(path.relative_to(REPO)))
def test_every_row_of_a_committed_jsonl_result_names_its_commit(path):
    for number, line in enumerate(path.read_text().splitlines(), 1):
        row = json.loads(line)
        assert STAMP_KEY in row, f"{path.relative_to(REPO)}, row {number}: no commit"
        check_stamp(row[STAMP_KEY], f"{path.relative_to(REPO)}, row {number}")


@pytest.mark.parametrize("path", committed_results(".md"), ids=lambda path: str(path.relative_to(REPO)))
def test_every_committed_table_ends_with_its_commit(path):
    """A table ends with its JSON's stamp; a GPU summary (no JSON beside it) with those of the rows it names."""
    twin = path.with_suffix(".json")
    if twin.exists():
        stamps = [json.loads(twin.read_text())[STAMP_KEY]]
    else:
        names = re.findall(r"[\w.-]+\.jsonl", path.read_text().splitlines()[0])
        assert names, f"{path.relative_to(REPO)}: neither a JSON beside it nor the rows it summarises"
        rows = [json.loads(line) for name in names for line in (path.parent / name).read_text().splitlines()]
        stamps = list({json.dumps(row[STAMP_KEY]): row[STAMP_KEY] for row in rows}.values())
    lines = [stamp_line(stamp) for stamp in stamps]
    assert path.read_text().rstrip().splitlines()[-len(lines) :] == lines


def test_the_history_index_lists_every_superseded_result():
    listed = set()
    for span in re.findall(r"`([^`]+\.\{[^`]+\}|[^`]+\.(?:json|md))`", INDEX.read_text()):
        stem, _, suffixes = span.partition(".{")
        listed |= {f"{stem}.{suffix}" for suffix in suffixes.rstrip("}").split(",")} if suffixes else {span}
    held = {path.name for path in HISTORY.iterdir() if path != INDEX}
    assert listed == held


def git(folder: Path, *arguments: str) -> None:
    subprocess.run(["git", "-C", str(folder), *arguments], check=True, capture_output=True)


def test_the_stamp_is_the_checkouts_commit_and_whether_its_code_differs(tmp_path, monkeypatch):
    """Clean after a commit; a result written into a result folder leaves it clean (benchmarks run one after another
    rewrite those); a changed or new file elsewhere makes it dirty. Without git, $VCA_COMMIT says it; without either
    the stamp has no commit, which the tests above refuse in a committed result."""
    monkeypatch.delenv(COMMIT_VARIABLE, raising=False)
    tree = tmp_path / "tree"
    (tree / "bench" / "results").mkdir(parents=True)
    (tree / "code.py").write_text("x = 1\n")
    (tree / "bench" / "results" / "old.json").write_text("{}\n")
    git(tree, "init", "-q")
    git(tree, "add", ".")
    git(tree, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    head = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert source_stamp(tree) == {"commit": head, "dirty": False}
    (tree / "bench" / "results" / "old.json").write_text('{"rewritten": true}\n')
    (tree / "bench" / "results" / "new.json").write_text("{}\n")
    assert source_stamp(tree) == {"commit": head, "dirty": False}
    (tree / "code.py").write_text("x = 2\n")
    assert source_stamp(tree) == {"commit": head, "dirty": True}
    git(tree, "checkout", "-q", "code.py")
    (tree / "scratch.py").write_text("")
    assert source_stamp(tree) == {"commit": head, "dirty": True}

    copy = tmp_path / "copy"  # what the GPU machine receives: the files without .git
    copy.mkdir()
    assert source_stamp(copy) == {"commit": None, "dirty": None}
    monkeypatch.setenv(COMMIT_VARIABLE, f"{head}-dirty")
    assert source_stamp(copy) == {"commit": head, "dirty": True}
    monkeypatch.setenv(COMMIT_VARIABLE, head)
    assert source_stamp(copy) == {"commit": head, "dirty": False}


def test_results_written_through_the_harness_and_the_gpu_rows_carry_the_stamp(tmp_path):
    from bench.gpu import append_row, read_rows, write_summary

    stamp, table = source_stamp(), "| a |\n|---|\n| 1 |\n"
    save_results(tmp_path, "x-quick", {"rows": [1]}, table, lambda results: subplots(figsize=(2, 2))[0])
    assert json.loads((tmp_path / "x-quick.json").read_text()) == {"rows": [1], STAMP_KEY: stamp}
    assert (tmp_path / "x-quick.md").read_text() == stamped_table(table, stamp)
    assert (tmp_path / "x-quick.md").read_text().endswith(f"\n\n{stamp_line(stamp)}\n")
    append_row(tmp_path / "rows.jsonl", {"part": "check", "error": "RuntimeError: x"})
    assert read_rows(tmp_path / "rows.jsonl") == [{"part": "check", "error": "RuntimeError: x", STAMP_KEY: stamp}]
    summary = write_summary(tmp_path / "summary.md", "title", {}, read_rows(tmp_path / "rows.jsonl"))
    assert summary.rstrip().splitlines()[-1] == stamp_line(stamp)

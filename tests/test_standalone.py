"""The repository stands alone: no tracked file reads, links or cites material outside it, and every docs/ page
that a tracked file names is in the repository.

Nothing here names that material. A path that climbs out of the clone is caught by its shape, wherever it leads;
what lies beside the clone is found at run time (the folders next to it, and the Markdown pages in them that the
repository has no page of), so that a mention of it is caught on a machine where it is there. With nothing beside
the clone (a CI checkout), the shape checks remain."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THIS_FILE = Path(__file__).resolve().relative_to(ROOT).as_posix()
RELATIVE_PATH = re.compile(r"(?<![\w./-])((?:\.\./)+[\w./-]*)")  # "../x/y", "../../z"
FILE_PARENTS = re.compile(r"__file__\W.*?\.parents\[(\d+)\]")  # Path(__file__).resolve().parents[k]
# "docs/NAME.md" as a path of this repository: not the tail of a longer path such as ".../docs/NAME.md".
DOCS_PAGE = re.compile(r"(?<![\w./-])docs/[\w.-]+\.md")
BESIDE_DEPTH = 2  # how deep the pages of the folders beside the clone are looked for


def tracked_files(root: Path = ROOT) -> dict[str, str]:
    """Every file git tracks (this test excepted), path -> text (bytes decoded leniently: binaries included)."""
    listing = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, text=True, check=True)
    paths = [path for path in listing.stdout.split("\0") if path and path != THIS_FILE]
    assert paths, f"git ls-files listed nothing in {root}"
    return {
        path: (root / path).read_bytes().decode("utf-8", errors="replace") for path in paths if (root / path).is_file()
    }


def material_beside(root: Path, own_files: set[str]) -> list[str]:
    """What a line must not name of the folders next to `root`: "<folder>/<entry>" for each entry in them, their
    absolute paths, and the Markdown pages in them (BESIDE_DEPTH levels down) whose names `own_files` lacks. Other
    checkouts (a folder with a .git) are the project itself, not material it was written from."""
    markers = []
    for folder in sorted(path for path in root.parent.iterdir() if path.is_dir() and path != root):
        if folder.name.startswith(".") or (folder / ".git").exists():
            continue
        markers.append(str(folder))
        markers += [f"{folder.name}/{entry.name}" for entry in folder.iterdir() if not entry.name.startswith(".")]
        pages = [page for depth in range(1, BESIDE_DEPTH + 1) for page in folder.glob("/".join(["*"] * depth) + ".md")]
        markers += [page.name for page in pages if page.name not in own_files]
    return sorted(set(markers))


def leaves_the_clone(path: str, line: str, root: Path) -> str | None:
    """What in `line` of the tracked file `path` reaches outside `root` by its shape: a relative path that, from
    the file's folder, climbs above the clone, or the file's own location climbed above the clone (`parents[k]` of
    `__file__`); None for a line that does neither."""
    folder = (root / path).parent
    depth = len(Path(path).parts) - 1  # parents[depth] of the file is the clone
    for relative in RELATIVE_PATH.findall(line):
        target = (folder / relative.rstrip(".")).resolve()
        if not target.is_relative_to(root):
            return relative
    for steps in FILE_PARENTS.findall(line):
        if int(steps) > depth:
            return f"parents[{steps}] of {path}"
    return None


def outside_references(root: Path) -> list[str]:
    files = tracked_files(root)
    markers = material_beside(root, {Path(path).name for path in files})
    return [
        f"{path}:{number}: {line.strip()}"
        for path, text in files.items()
        for number, line in enumerate(text.splitlines(), start=1)
        if leaves_the_clone(path, line, root) or any(marker in line for marker in markers)
    ]


def test_no_tracked_file_points_outside_the_repository():
    offenders = outside_references(ROOT)
    assert not offenders, "references to material outside the repository:\n" + "\n".join(offenders)


def test_every_docs_page_mentioned_exists():
    missing = [
        f"{path}:{number}: {page}"
        for path, text in tracked_files().items()
        for number, line in enumerate(text.splitlines(), start=1)
        for page in DOCS_PAGE.findall(line)
        if not (ROOT / page).is_file()
    ]
    assert not missing, "docs pages named but not in the repository:\n" + "\n".join(missing)


def test_the_checks_see_what_they_look_for(tmp_path):
    """A clone with notes beside it, and every way a tracked file has pointed at such notes: each is caught, and
    what merely looks alike is not."""
    clone, notes = tmp_path / "clone", tmp_path / "notes"
    (clone / "docs").mkdir(parents=True)
    (clone / "docs" / "METHOD.md").write_text("# the method\n")
    (notes / "docs").mkdir(parents=True)
    (notes / "GUIDE.md").write_text("# a guide\n")
    (notes / "docs" / "METHOD.md").write_text("# the method, upstream\n")
    lines = {
        "README.md": [
            "See ../notes/docs/METHOD.md.",  # a relative path out of the clone
            "a figure (GUIDE.md: up to 2x)",  # a page beside the clone, cited by name
            "as notes/docs explains",  # a folder beside the clone
        ],
        "docs/page.md": ["[method](../../notes/docs/METHOD.md)"],
        "tools/paths.py": [
            'GUIDE = Path(__file__).resolve().parents[2] / "notes"',  # the file's location climbed out
            f'GUIDE = "{notes}/GUIDE.md"',  # the absolute location
        ],
    }
    fine = {
        "README.md": ["[method](docs/METHOD.md), notes shared by DiT and SiT, METHOD.md"],
        "docs/page.md": ["[readme](../README.md), [itself](../docs/page.md), a run moved to ../moved/run"],
        "tools/paths.py": ["ROOT = Path(__file__).resolve().parents[1]", "out = tmp_path / 'notes'"],
    }
    for path in {*lines, *fine}:  # each file: the fine lines, then the offending ones
        (clone / path).parent.mkdir(parents=True, exist_ok=True)
        (clone / path).write_text("\n".join(fine[path] + lines[path]) + "\n")
    subprocess.run(["git", "init", "-q"], cwd=clone, check=True)
    subprocess.run(["git", "add", "-A"], cwd=clone, check=True)
    expected = [
        f"{path}:{len(fine[path]) + number}: {line}"
        for path in lines
        for number, line in enumerate(lines[path], start=1)
    ]
    assert sorted(outside_references(clone)) == sorted(expected)
    assert DOCS_PAGE.findall("switches (see docs/VCA.md)") == ["docs/VCA.md"]
    assert DOCS_PAGE.findall('`docs/VCA.md`, "docs/OTHER.md"') == ["docs/VCA.md", "docs/OTHER.md"]
    assert DOCS_PAGE.findall("../elsewhere/docs/VCA.md and site/docs/x.md") == []

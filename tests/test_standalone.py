"""The repository stands alone: no tracked file reads, links or cites material outside it, and every docs/ page
that a tracked file names is in the repository."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THIS_FILE = Path(__file__).resolve().relative_to(ROOT).as_posix()
# Paths and pages of the material the project was written from, which a clone does not have.
OUTSIDE_MARKERS = ("../shared", "shared/docs", "shared/reference", "REFERENCE.md")
# The same folder reached by building a path: `parents[2] / "shared" / ...`, or the absolute location.
OUTSIDE_PATH = re.compile(r"""["']shared["']|/work/shared""")
# "docs/NAME.md" as a path of this repository: not the tail of a longer path such as ".../shared/docs/NAME.md".
DOCS_PAGE = re.compile(r"(?<![\w./-])docs/[\w.-]+\.md")


def tracked_files() -> dict[str, str]:
    """Every file git tracks (this test excepted), path -> text (bytes decoded leniently: binaries included)."""
    listing = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True)
    paths = [path for path in listing.stdout.split("\0") if path and path != THIS_FILE]
    assert paths, f"git ls-files listed nothing in {ROOT}"
    return {
        path: (ROOT / path).read_bytes().decode("utf-8", errors="replace") for path in paths if (ROOT / path).is_file()
    }


def test_no_tracked_file_points_outside_the_repository():
    offenders = [
        f"{path}:{number}: {line.strip()}"
        for path, text in tracked_files().items()
        for number, line in enumerate(text.splitlines(), start=1)
        if any(marker in line for marker in OUTSIDE_MARKERS) or OUTSIDE_PATH.search(line)
    ]
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
    # The two patterns catch the forms used in this repository's history and skip paths that merely end alike.
    assert any(marker in "VCA follows ../shared/docs/VCA.md" for marker in OUTSIDE_MARKERS)
    assert any(marker in "# (REFERENCE.md: up to 2x)" for marker in OUTSIDE_MARKERS)
    assert OUTSIDE_PATH.search('REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "reference"')
    assert not OUTSIDE_PATH.search("shared by DiT and SiT; shared_weights = 1")
    assert DOCS_PAGE.findall("switches (see docs/VCA.md)") == ["docs/VCA.md"]
    assert DOCS_PAGE.findall('`docs/VCA.md`, "docs/OTHER.md"') == ["docs/VCA.md", "docs/OTHER.md"]
    assert DOCS_PAGE.findall("../shared/docs/VCA.md and site/docs/x.md") == []
    assert "docs/VCA.md" not in tracked_files().get(THIS_FILE, "")  # this file is left out of its own scan

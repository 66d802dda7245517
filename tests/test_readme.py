"""The documentation's commands and code, held to the code: every command line in README.md and docs/*.md is
checked against the command's own argument parser, and the README's "From Python" snippet runs.

A command line is taken from a fenced shell block (continuation lines joined, comments dropped, `&&` and `;`
split, `srun … bash -c '…'` opened) or from an inline code span that gives options. It is checked as the
command itself would check it, without running it: `train.py`, `sample.py`, `sweep.py`, `demo.py` and `python -m …`
are run up to the moment their parser has parsed (the parser is stopped there), so unknown flags and invalid
choices fail as they would for a user (`--help` must print the help and exit 0); a `--config` and its
`section.key=value` overrides must load (`load_config`); `accelerate launch` and `torchrun` options go through
accelerate's and torch's own parsers; `make` targets must exist in the Makefile and `vca-*` commands in
pyproject.toml. Shell variables ($RANK) stand for a number.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import runpy
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tomllib

from _tiny_models import tiny_export
from generation.run_layout import EXPORT_FOLDER as EXPORT_DIR
from generation.run_layout import POSTHOC_EXPORTS_FOLDER as POSTHOC_OUT
from training.config import load_config

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
MAKE_TARGETS = set(re.findall(r"^([a-z][\w-]*):", (REPO / "Makefile").read_text(), re.M))
SHELL_LANGUAGES = {"bash", "sh", "shell", "console", ""}
PLACEHOLDER = re.compile(r"<[^>]*>|…|\.\.\.|\{[^}]*\}|\b[A-Z][A-Z_]+\b(?!=)")  # <run>, …, {64,128}, SAMPLES
PARSE_ARGS = argparse.ArgumentParser.parse_args  # unstopped, for the launchers' own options
COMMAND_START = re.compile(r"^(\w+=\S+\s+)*(python3?|accelerate|torchrun|srun|make|vca-[\w-]+)(\s|$)")


@dataclass(frozen=True)
class DocumentedCommand:
    page: str
    line: int
    text: str
    inline: bool  # from a code span in running text (often a bare command name)

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


def fenced_blocks(text: str) -> list[tuple[str, int, str]]:
    """(language, first line number, body) of every fenced code block."""
    blocks = []
    for match in re.finditer(r"^( *)```(\w*)\n(.*?)^\1```", text, re.S | re.M):
        blocks.append(
            (
                match.group(2),
                text.count("\n", 0, match.start()) + 2,
                re.sub(rf"^{match.group(1)}", "", match.group(3), flags=re.M),
            )
        )
    return blocks


def documented_commands() -> list[DocumentedCommand]:
    found = []
    for page in PAGES:
        text = page.read_text()
        name = str(page.relative_to(REPO))
        for language, first, body in fenced_blocks(text):
            if language not in SHELL_LANGUAGES:
                continue
            joined = body.replace("\\\n", " ")
            for offset, line in enumerate(joined.split("\n")):
                for part in re.split(r"&&|;|&$|& ", line.split(" #")[0] if not line.startswith("#") else ""):
                    if COMMAND_START.match(part.strip()):
                        found.append(DocumentedCommand(name, first + offset, part.strip(), inline=False))
        prose = re.sub(r"^( *)```.*?^\1```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S | re.M)
        for match in re.finditer(r"`([^`\n]+)`", prose):
            if COMMAND_START.match(match.group(1)):
                found.append(
                    DocumentedCommand(name, prose.count("\n", 0, match.start()) + 1, match.group(1), inline=True)
                )
    return found


class _Parsed(BaseException):
    """Raised by a stopped parser: the command got as far as a successful parse."""

    def __init__(self, namespace: argparse.Namespace) -> None:
        self.namespace = namespace


@pytest.fixture
def stopped_parsers(monkeypatch):
    """Every ArgumentParser stops the command right after a successful parse."""
    for method in ("parse_args", "parse_intermixed_args"):
        original = getattr(argparse.ArgumentParser, method)

        def stop(self, *args, _original=original, **kwargs):
            raise _Parsed(_original(self, *args, **kwargs))

        monkeypatch.setattr(argparse.ArgumentParser, method, stop)
    monkeypatch.chdir(REPO)


def parse_python(tokens: list[str], where: DocumentedCommand, monkeypatch) -> None:
    """`python script.py ARGS` or `python -m module ARGS`, run until its parser has parsed ARGS."""
    if tokens[0] == "-m":
        module, arguments = tokens[1], tokens[2:]
        assert importlib.util.find_spec(module) is not None, f"{where}: no module {module}"
        run = lambda: runpy.run_module(module, run_name="__main__", alter_sys=True)  # noqa: E731
        program = module
    else:
        script, arguments = REPO / tokens[0], tokens[1:]
        assert script.is_file(), f"{where}: no script {tokens[0]}"
        run = lambda: runpy.run_path(str(script), run_name="__main__")  # noqa: E731
        program = str(script)
    monkeypatch.setattr(sys, "argv", [program, *arguments])
    try:
        run()
    except _Parsed as parsed:
        namespace = parsed.namespace
    except SystemExit as exit_:
        if exit_.code == 0 and {"--help", "-h"} & set(arguments):  # argparse printed the help the page shows
            return
        raise AssertionError(f"{where}: the command's parser refused it ({exit_.code})") from None
    else:
        raise AssertionError(f"{where}: the command finished without parsing arguments")
    if isinstance(getattr(namespace, "config", None), str):
        load_config(namespace.config, list(getattr(namespace, "overrides", None) or []))


def check_run_paths(tokens: list[str], where: DocumentedCommand) -> None:
    """A path into a run directory that names an export follows the run layout (training.run.RunDirectory):
    results/<run>/checkpoints/step-XXXXXXX/export, results/<run>/exports/step-XXXXXXX, or a post-hoc EMA
    reconstruction results/<run>/posthoc_exports/sigma_rel-S-step-XXXXXXX."""
    from training.run import RunDirectory

    run = RunDirectory(Path("results/RUN"))
    layouts = [run.checkpoints / "step-0000000" / EXPORT_DIR, run.exports / "step-0000000"]
    pattern = "|".join(re.escape(str(layout.relative_to(run.root))).replace("0000000", r"\d{7,}") for layout in layouts)
    pattern += rf"|{POSTHOC_OUT}/sigma_rel-[\d.e-]+-step-\d{{7,}}"  # python -m training.posthoc_ema's exports
    for token in tokens:
        path = token.partition("=")[2] if "=" in token else token
        if path.startswith("results/") and "export" in path:
            assert re.fullmatch(rf"results/[^/]+/({pattern})/?", path), (
                f"{where}: {path} is not where a run keeps exports ({', '.join(map(str, layouts))})"
            )


def check_command(where: DocumentedCommand, monkeypatch) -> None:
    text = where.text.replace('"$@"', "train.py --help")  # a wrapper's "$@": the script and arguments it runs
    text = re.sub(r"\$\(\(.*?\)\)|\$\{?\w+\}?", "1", text)  # $RANK, $((N * 8)): a number stands in
    tokens = shlex.split(text)
    check_run_paths(tokens, where)
    while tokens and re.match(r"^\w+=", tokens[0]):  # VAR=value prefixes
        tokens.pop(0)
    head, rest = tokens[0], tokens[1:]
    if head == "srun":
        inner = rest.index("-c") + 1 if "-c" in rest else None
        assert inner is not None, f"{where}: expected srun … bash -c '…'"
        for part in re.split(r"&&|;", rest[inner]):
            check_command(DocumentedCommand(where.page, where.line, part.strip(), False), monkeypatch)
        return
    if head == "make":
        assert set(rest) <= MAKE_TARGETS, f"{where}: no make target {sorted(set(rest) - MAKE_TARGETS)}"
        return
    if head.startswith("vca-"):
        assert head in SCRIPTS, f"{where}: no installed command {head} in pyproject.toml"
        module = SCRIPTS[head].partition(":")[0]
        module = module.removesuffix(".__main__")
        tokens = ["-m", module, *rest] if module not in ("train", "sample") else [f"{module}.py", *rest]
        return parse_python(tokens, where, monkeypatch)
    if head == "accelerate":
        from accelerate.commands.launch import launch_command_parser

        assert rest[:1] == ["launch"], f"{where}: only `accelerate launch` is documented"
        if where.inline and not any(token.endswith(".py") or token == "-m" for token in rest):
            rest = [*rest, "script.py"]  # a span that shows launcher options only: check those
            PARSE_ARGS(launch_command_parser(), rest[1:])
            return
        launch = PARSE_ARGS(launch_command_parser(), rest[1:])  # its own options, then the script and its args
        tokens = (
            [("-m" if launch.module else ""), launch.training_script] if launch.module else [launch.training_script]
        )
        return parse_python([t for t in tokens if t] + launch.training_script_args, where, monkeypatch)
    if head == "torchrun":
        from torch.distributed.run import get_args_parser

        launch = PARSE_ARGS(get_args_parser(), rest)
        return parse_python(
            ["-m", launch.training_script] if launch.module else [launch.training_script, *launch.training_script_args],
            where,
            monkeypatch,
        )
    assert head in ("python", "python3"), f"{where}: unknown command {head}"
    parse_python(rest, where, monkeypatch)


def test_the_pages_document_commands():
    commands = documented_commands()
    assert len([c for c in commands if not c.inline]) >= 20, commands  # the extraction finds the code blocks
    assert any(c.text.startswith("accelerate launch") for c in commands)


def whole_command(command: DocumentedCommand) -> bool:
    """A command line to parse: from a code block (unless it elides a part with …), or a code span with options
    and no placeholders (a span like `python -m fid SAMPLES REF` or a bare command name only names a command, and
    so does a block line like `srun bash -c 'accelerate launch … train.py --config …'`: see the next test)."""
    if not command.inline:
        return "…" not in command.text
    return "--" in command.text and not PLACEHOLDER.search(command.text)


@pytest.mark.parametrize("where", [c for c in documented_commands() if whole_command(c)], ids=str)
def test_documented_command_fits_its_parser(where, stopped_parsers, monkeypatch):
    check_command(where, monkeypatch)


@pytest.mark.parametrize("where", [c for c in documented_commands() if not whole_command(c)], ids=str)
def test_documented_command_names_exist(where):
    tokens = [token for token in shlex.split(where.text.replace("…", "")) if not re.match(r"^\w+=", token)]
    if tokens[0] == "srun" and "-c" in tokens:  # srun bash -c '…': the command it runs
        tokens = tokens[tokens.index("-c") + 1].split()
    if tokens[:2] == ["accelerate", "launch"]:  # the script it launches, if the span names one
        tokens = [
            "python",
            *(
                [tokens[tokens.index("-m")], tokens[tokens.index("-m") + 1]]
                if "-m" in tokens
                else [token for token in tokens if token.endswith(".py")][:1]
            ),
        ]
    head = tokens[0]
    if head.startswith("vca-"):
        assert head in SCRIPTS or head == "vca-diffusion", f"{where}: no such installed command"
    elif head == "make":
        assert set(tokens[1:]) <= MAKE_TARGETS, f"{where}: no such make target"
    elif head in ("python", "python3") and len(tokens) > 1:
        if tokens[1] == "-m":
            module = tokens[2]
            if not PLACEHOLDER.search(module):
                assert importlib.util.find_spec(module) is not None, f"{where}: no module {module}"
        else:
            assert (REPO / tokens[1]).is_file(), f"{where}: no script {tokens[1]}"


def test_a_wrong_flag_or_config_is_caught(stopped_parsers, monkeypatch):
    """The check above can fail: a flag that does not exist, a bad choice and an unknown config key."""
    for text in (
        "python sample.py --ckpt x --num-samples 4 --out x.npz --sampler-steps 3",
        "python sample.py --ckpt x --num-samples 4 --out x.npz --precision fp8",
        "accelerate launch --num_processes two train.py --config digits",
        "python train.py --config dit-s2-vca train.lrate=1e-4",
        "python train.py --config dit-s9-vca",
        "python -m generation.diffusers_interop results/run/export out_dir",
        "make bench-everything",
    ):
        with pytest.raises((AssertionError, SystemExit, ValueError)):
            check_command(DocumentedCommand("test", 0, text, False), monkeypatch)


# ----------------------------------------------------------------------------------------------------------------
# The README's "From Python" snippet
# ----------------------------------------------------------------------------------------------------------------


def from_python_snippet() -> str:
    text = (REPO / "README.md").read_text()
    section = text.split("## From Python", 1)[1].split("\n## ", 1)[0]
    (snippet,) = [body for language, _, body in fenced_blocks(section) if language == "python"]
    return snippet


def test_the_from_python_snippet_gives_the_images_sample_py_writes(tmp_path, monkeypatch):
    """Run the snippet on a tiny export (its run folder named where the snippet names one) and compare with
    `sample.py` on the same export and the snippet's settings: the same labels, seeds and pixels."""
    import sample

    snippet = from_python_snippet()
    run_folder = re.search(r'"(results/[^"]+)"', snippet).group(1)
    export = tiny_export(tmp_path / run_folder / "checkpoints" / "step-0000010" / "export")
    (export.parent / "trainer_state.json").write_text("{}")  # a complete checkpoint, as training leaves it
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(snippet, "README.md (From Python)", "exec"), namespace)
    images, labels = namespace["images"], namespace["labels"]
    assert images.dtype == np.uint8 and images.shape == (len(labels), 8, 8, 3)

    settings = re.search(r"# = sample\.py (.*)$", snippet, re.M).group(1).split()
    out = tmp_path / "samples.npz"
    sample.main(["--ckpt", str(export.parents[2]), "--out", str(out), "--num-samples", str(len(labels)), *settings])
    with np.load(out) as data:
        np.testing.assert_array_equal(data["arr_1"], labels)
        np.testing.assert_array_equal(data["arr_0"], images)


# ----------------------------------------------------------------------------------------------------------------
# Links: every page reachable from the README, every relative link pointing at a file
# ----------------------------------------------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(REPO / target.split("#")[0]).resolve() for target in LINK.findall((REPO / "README.md").read_text())}
    pages = {page.resolve() for page in PAGES[1:]}
    assert pages and pages <= linked, f"pages the README does not link: {sorted(p.name for p in pages - linked)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_relative_links_point_at_files(page):
    broken = [
        target
        for target in LINK.findall(page.read_text())
        if not re.match(r"^(https?:|mailto:|#)", target) and not (page.parent / target.split("#")[0]).exists()
    ]
    assert broken == [], f"{page.name}: links to nothing: {broken}"

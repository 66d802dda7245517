"""Commands answer at once: `--help`, a bad argument and a bad config value are answered before the heavy libraries
are imported (diffusers, timm and torchvision take seconds each; bench/startup.py measures the start-up times), and
`python -m fid` reports a user error it can see without reading images before it imports torch. The rule and the
modules that keep it are written down in docs/architecture.md ("Light imports"); every module that page lists is
checked here to import without the heavy libraries.

Each case runs the real command line in a fresh interpreter (runpy, as `python train.py ...` runs it) and reads
which libraries it had imported when it exited."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import pkgutil
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "diffusers", "timm", "torchvision", "accelerate", "huggingface_hub", "torch_fidelity")

RUN_AND_REPORT = """
import json, runpy, sys
command, arguments = sys.argv[1], sys.argv[2:]
status = 0
try:
    if command.endswith(".py"):
        sys.argv = [command, *arguments]
        runpy.run_path(command, run_name="__main__")
    else:
        sys.argv = [command, *arguments]
        runpy.run_module(command, run_name="__main__", alter_sys=True)
except SystemExit as exit_:
    status = exit_.code if isinstance(exit_.code, int) else 1
print(json.dumps({"status": status, "imported": sorted(name for name in HEAVY if name in sys.modules)}))
"""


def imported_by(*command: str) -> tuple[int, set[str], str]:
    """(exit status, heavy libraries imported, stderr) of one command line, run from the repository root."""
    code = f"HEAVY = {HEAVY!r}\n{RUN_AND_REPORT}"
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", code, *command], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=300
    )
    report = json.loads(result.stdout.strip().splitlines()[-1])
    return report["status"], set(report["imported"]), result.stderr


@pytest.mark.parametrize(
    "command, expected_status",
    [
        (("train.py", "--help"), 0),
        (("train.py", "--config", "digits", "--no-such-option"), 2),
        (("sample.py", "--help"), 0),
        (("sample.py", "--ckpt", "x", "--num-samples", "0", "--out", "o.npz"), 2),
        (("fid", "--help"), 0),
        (("fid", "samples.npz", "--no-such-option"), 2),
        (("fid.reference", "--help"), 0),
        (("training.posthoc_ema", "--help"), 0),
        (("training.posthoc_ema", "run", "--sigma-rel", "0.1", "--no-such-option"), 2),
        (("sweep.py", "--help"), 0),
        (("demo.py", "--help"), 0),
        (("sweep.py", "--ckpt", "x", "--ref", "r.npz", "--out", "o", "--num-samples", "0"), 2),
        (("generation.likelihood", "--help"), 0),
        (("generation.likelihood", "--ckpt", "x", "--images", "i.npz", "--batch-size", "0"), 2),
    ],
)
def test_help_and_bad_arguments_import_not_even_torch(command, expected_status):
    status, imported, _ = imported_by(*command)
    assert status == expected_status
    assert imported == set(), f"{' '.join(command)} imported {sorted(imported)}"


@pytest.mark.parametrize(
    "arguments, named",
    [
        (("fid", "{tmp}/samples.npz", "{tmp}/ref.npz", "--metrics", "fid,kid"), "unknown metrics ['kid']"),
        (("fid", "{tmp}/samples.npz", "--batch-size", "0", "--save-stats", "{tmp}/s.npz"), "--batch-size must be"),
        (("fid", "{tmp}/nothing.npz", "{tmp}/ref.npz"), "nothing.npz: no such file or folder"),
        (("fid", "{tmp}/samples.npz", "{tmp}/ref.npz", "--json", "{tmp}/ref.npz"), "ref.npz is REF itself"),
        (("fid.reference", "imagenet100"), "ADM published ImageNet reference batches at 64, 128"),
    ],
)
def test_fid_user_errors_seen_without_images_come_before_torch(tmp_path, arguments, named):
    for name in ("samples.npz", "ref.npz"):
        np.savez(tmp_path / name, mu=np.zeros(2), sigma=np.eye(2))
    status, imported, stderr = imported_by(*(argument.format(tmp=tmp_path) for argument in arguments))
    assert status == 2 and named in stderr, stderr
    assert imported == set(), f"{' '.join(arguments)} imported {sorted(imported)}"


@pytest.fixture
def run_folder(tmp_path) -> Path:
    """A run folder as a launch leaves it before its first checkpoint: its config.yaml alone."""
    shutil.copy(ROOT / "configs" / "digits.yaml", tmp_path / "config.yaml")
    return tmp_path


@pytest.mark.parametrize("launch", ["--config digits", "--resume {run}"])
@pytest.mark.parametrize(
    "overrides, named",
    [
        (("no_such_section.key=1",), "'no_such_section'"),
        (("model.num_heads=5",), "'model.num_heads' is 5"),  # found by the config check, not the model build
        (("model.depth=0",), "'model.depth' is 0"),
    ],
)
def test_config_errors_come_before_diffusers_timm_and_accelerate(run_folder, launch, overrides, named):
    """Also a resume's: without --config it reads the run's own config.yaml, with the overrides on top."""
    status, imported, stderr = imported_by("train.py", *launch.format(run=run_folder).split(), *overrides)
    assert status == 2 and named in stderr, stderr
    assert imported <= {"torch"}, f"a config error imported {sorted(imported)}"


def test_a_good_config_is_checked_without_diffusers_or_timm():
    code = (
        "import sys\nfrom train import parse_arguments\nfrom training.config import load_config\n"
        "arguments = parse_arguments(['--config', 'dit-s2-vca', 'model.depth=2', 'train.repa.depth=2',\n"
        "                             'train.repa.encoder=vit_small_patch16_224'])\n"
        "load_config(arguments.config, arguments.overrides)\n"
        f"print(sorted(name for name in {HEAVY!r} if name in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert result.stdout.split() == ["['torch']"]


@pytest.mark.parametrize("package", ["fid", "generation", "dit_vca", "sit_vca", "samplers"])
def test_no_submodule_is_named_like_a_name_its_package_hands_on_lazily(package):
    """Importing a submodule makes it the package's attribute of its name, which would hide the function of that
    name that the package hands on from another module on first use."""
    face = importlib.import_module(package)
    submodules = {module.name for module in pkgutil.iter_modules(face.__path__)}
    assert not submodules & set(face.__all__)


def light_modules(page: Path) -> list[str]:
    """The modules docs/architecture.md says import without the heavy libraries: every dotted name in backticks in
    the list that follows "These modules import without torch" in its "Light imports" section (a script's file
    name, `train.py`, is a path there, not a module)."""
    section = page.read_text().split("## Light imports", 1)[1].split("\n## ", 1)[0]
    listing = section.split("These modules import without torch", 1)[1].split("\n\n", 2)[1]
    return [name for name in re.findall(r"`([\w.]+)`", listing) if not name.endswith(".py")]


def test_every_module_the_architecture_page_calls_light_imports_without_heavy_libraries():
    modules = light_modules(ROOT / "docs" / "architecture.md")
    assert len(modules) >= 40, modules  # the whole list was read, not one line of it
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"
    # One interpreter imports them all: a single heavy import by any of them shows in sys.modules at the end.
    code = (
        f"import importlib, sys\nfor name in {modules!r}:\n    importlib.import_module(name)\n"
        f"print(sorted(name for name in {HEAVY!r} if name in sys.modules))"
    )
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["[]"], f"a module docs/architecture.md calls light imported {result.stdout}"

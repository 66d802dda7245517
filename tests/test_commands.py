"""Installed commands: the `[project.scripts]` entry points and the configs shipped inside the package.

The wheel is built from a copy of the files that pyproject.toml names (offline: `pip wheel --no-build-isolation`
uses the venv's setuptools), installed into a temporary folder with pip, and used from a folder outside the
source tree, so that what is checked is what an installed user gets.
"""

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from _import_graph import project_modules
from commands import UserError, run_command
from configs import CONFIG_DIR, config_names, find_config
from training.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SCRIPTS = PYPROJECT["project"]["scripts"]


def test_a_bare_name_resolves_to_the_shipped_config():
    assert find_config("dit-s2-vca") == CONFIG_DIR / "dit-s2-vca.yaml"
    assert find_config("dit-s2-vca.yaml") == CONFIG_DIR / "dit-s2-vca.yaml"
    config = load_config("sit-b2-mhsa")
    assert (config.model.name, config.model.attention, config.train.lr) == ("SiT-B/2", "mhsa", 1e-4)  # base chain
    assert config.run.dir == str(Path("results") / "sit-b2-mhsa")


def test_a_path_still_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "digits.yaml").write_text(
        (CONFIG_DIR / "digits.yaml").read_text().replace("max_steps: 2000", "max_steps: 7")
    )
    assert load_config("digits.yaml").train.max_steps == 7  # the file in the working folder
    assert load_config("digits").train.max_steps == 2000  # no such file: the shipped config
    with pytest.raises(ConfigError, match=r"sub/digits\.yaml does not exist"):
        load_config("sub/digits.yaml")  # a path is never looked up among the shipped


def test_an_unknown_name_lists_the_shipped_configs_in_one_line():
    with pytest.raises(ConfigError) as error:
        load_config("dit-s3-vca")
    message = str(error.value)
    assert "\n" not in message and "'dit-s3-vca'" in message
    assert message.endswith(", ".join(config_names()))
    assert "dit-s2-vca" in config_names() and "imagenet256" in config_names()


def test_every_command_names_a_callable():
    assert set(SCRIPTS) == {
        "vca-train",
        "vca-sample",
        "vca-sweep",
        "vca-fid",
        "vca-fid-reference",
        "vca-latents",
        "vca-convert",
    }
    import importlib

    for name, target in SCRIPTS.items():
        module, _, attribute = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attribute)), name


def project_exception_classes() -> list[type[BaseException]]:
    """Every exception class defined in the project's packages and commands (imported, so found by type)."""
    import importlib
    import inspect

    found = []
    for name in sorted(project_modules()):
        if name.endswith("__main__") or name == "demo":
            continue
        module = importlib.import_module(name)
        found += [
            value
            for value in vars(module).values()
            if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == module.__name__
        ]
    return found


def test_every_error_of_the_project_is_a_user_error():
    """A user-facing error is recognised by its base class, so no list of error types has to be kept in step."""
    classes = project_exception_classes()
    assert len(classes) >= 10 and UserError in classes
    # A private class (leading underscore) is a signal inside one module that never reaches a user
    # (fid.inputs._UnreadableImage becomes an InputError or a warning that names the file).
    # A warning category (fid.evaluation.SmallSetWarning) is not an error: fid.cli.one_line_warnings prints it in
    # one line and the command goes on.
    public = [cls for cls in classes if not cls.__name__.startswith("_") and not issubclass(cls, Warning)]
    assert [cls.__qualname__ for cls in public if not issubclass(cls, UserError)] == []


def test_run_command_answers_any_user_error_in_one_line(capsys):
    class NewError(UserError):
        """An error type that no list names."""

    def main(argv):
        raise NewError("data.images: /nowhere does not exist")

    with pytest.raises(SystemExit) as exit_:
        run_command(main, [])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == "error: data.images: /nowhere does not exist\n"
    with pytest.raises(NewError):
        run_command(main, ["--debug"])


def is_text(node: ast.expr) -> bool:
    """Whether an expression of the source makes a string: a literal, an f-string, their sum or `.format`."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, ast.JoinedStr):
        return True
    if isinstance(node, ast.BinOp):
        return is_text(node.left) or is_text(node.right)
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_text(node.func.value)


def is_exit(function: ast.expr) -> bool:
    """`SystemExit`, `sys.exit` or `exit`: what ends a process with the message it is given."""
    if isinstance(function, ast.Name):
        return function.id in ("SystemExit", "exit")
    return isinstance(function, ast.Attribute) and function.attr == "exit" and ast.unparse(function.value) == "sys"


def exits_with_a_message(source: str) -> list[int]:
    """The lines where `source` ends the process with a message (`raise SystemExit("...")`, `sys.exit(f"...")`)."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and is_exit(node.func) and node.args and is_text(node.args[0])
    ]


def test_no_user_error_is_a_system_exit_with_a_message():
    """Issue 49: one idiom for a user error, a UserError subclass that run_command answers in one line with exit
    status 2. `raise SystemExit("...")` was a second (29 of them in sample.py, sample_arguments.py, demo.py,
    generation/official.py and studies/runner.py), which run_command no longer answers: such an exit prints its
    message with status 1."""
    found = [
        f"{path.relative_to(REPO)}:{line}"
        for path in sorted(project_modules().values())
        for line in exits_with_a_message(path.read_text())
    ]
    assert found == []
    # the check itself sees each spelling, and leaves exit statuses alone
    assert exits_with_a_message('raise SystemExit(f"--out {out}: exists")\nsys.exit("x" + y)') == [1, 2]
    assert exits_with_a_message('raise SystemExit(\n    "a {}".format(b)\n)\nexit(f"{x}")') == [1, 4]
    assert exits_with_a_message("raise SystemExit(2)\nraise SystemExit(status)\nsys.exit(USER_ERROR_STATUS)") == []


def test_run_command_keeps_the_traceback_of_a_bug():
    def main(argv):
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        run_command(main, [])


def test_an_error_of_a_module_run_with_dash_m_is_one_line(tmp_path):
    """Under `python -m generation.official` its error class is `__main__.OfficialCheckpointError`, still a
    UserError: one line, exit 2."""
    (tmp_path / "cut.pt").write_bytes(b"PK\x03\x04 not a whole zip")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "generation.official",
            str(tmp_path / "cut.pt"),
            "--out",
            str(tmp_path / "export"),
            "--model",
            "DiT-S/8",
            "--image-size",
            "256",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and "cut.pt" in line


def _package_files(destination: Path) -> None:
    """Copy what the build needs (the files pyproject.toml names) to `destination`."""
    setuptools = PYPROJECT["tool"]["setuptools"]
    for name in ("pyproject.toml", "README.md", *(module + ".py" for module in setuptools["py-modules"])):
        shutil.copy2(REPO / name, destination / name)
    for package in setuptools["packages"]:
        if "." not in package:
            shutil.copytree(REPO / package, destination / package, ignore=shutil.ignore_patterns("__pycache__"))


@pytest.mark.slow
def test_the_wheel_installs_commands_and_configs(tmp_path):
    source, wheels, target, elsewhere = (tmp_path / name for name in ("source", "wheels", "target", "elsewhere"))
    for folder in (source, elsewhere):
        folder.mkdir()
    _package_files(source)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "-q"]
    subprocess.run(
        [*pip, "wheel", str(source), "--no-deps", "--no-build-isolation", "--no-index", "-w", str(wheels)],
        check=True,
        timeout=300,
    )
    (wheel,) = wheels.glob("*.whl")
    subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)], check=True, timeout=300
    )

    # The installed packages come first on the path; the working folder holds no source.
    env = {**os.environ, "PYTHONPATH": str(target), "OMP_NUM_THREADS": "1"}
    probe = """
import importlib.metadata, json, sys
from training.config import load_config
(dist,) = importlib.metadata.distributions(name="vca-diffusion", path=[sys.argv[1]])
commands = {}
for entry in dist.entry_points.select(group="console_scripts"):
    function = entry.load()
    commands[entry.name] = [callable(function), sys.modules[function.__module__].__file__]
config = load_config("dit-s2-vca")
print(json.dumps({"commands": commands, "model": config.model.name, "vae": config.vae.name,
                  "shipped": [str(p) for p in dist.files if p.parts[0] == "configs" and p.suffix == ".yaml"],
                  "config_file": sys.modules["configs"].__file__}))
"""
    result = subprocess.run(
        [sys.executable, "-c", probe, str(target)],
        cwd=elsewhere,
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    seen = json.loads(result.stdout.splitlines()[-1])
    assert seen["commands"].keys() == SCRIPTS.keys()
    for name, (is_callable, file) in seen["commands"].items():
        assert is_callable and Path(file).is_relative_to(target), (name, file)
    assert Path(seen["config_file"]).is_relative_to(target)
    assert (seen["model"], seen["vae"]) == ("DiT-S/2", "stabilityai/sd-vae-ft-ema")  # imagenet256.yaml came along
    assert sorted(Path(p).stem for p in seen["shipped"]) == config_names()

    # The generated console script runs (pip writes it with this interpreter in its first line).
    help_text = subprocess.run(
        [str(target / "bin" / "vca-sample"), "--help"],
        cwd=elsewhere,
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    assert "--num-samples" in help_text


# A command process as run_command starts it, then one 64 MiB block: glibc's default serves it by mmap (a block
# that free hands back to the OS, to be faulted in again next time); with freed memory kept, from the heap.
MMAPPED_BLOCKS = """
import ctypes, sys
from commands import run_command
sys.argv = ["command"]
run_command(lambda argv: None)
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.mallinfo2.restype = ctypes.c_void_p, MallInfo2
before = libc.mallinfo2().hblks
block = libc.malloc(64 << 20)
print(libc.mallinfo2().hblks - before)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's allocator (mallinfo2 reads what it did)")
@pytest.mark.parametrize("environment, mmapped", [({}, "0"), ({"MALLOC_TRIM_THRESHOLD_": "131072"}, "1")])
def test_a_command_keeps_freed_memory_unless_the_environment_says(environment, mmapped):
    clean = {key: value for key, value in os.environ.items() if not key.startswith("MALLOC_")}
    done = subprocess.run(
        [sys.executable, "-c", MMAPPED_BLOCKS],
        cwd=REPO,
        env={**clean, "PYTHONPATH": str(REPO), **environment},
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.split() == [mmapped]

"""The experiment configs shipped with the package, so that `--config dit-s2-vca` works without the source tree.

A bare name (no folder, with or without `.yaml`) names one of the YAML files beside this module; anything else
is taken as a path. Base chains (`base: imagenet256.yaml`) resolve relative to the file, so the shipped files
find each other wherever the package is installed.
"""

from __future__ import annotations

from pathlib import Path

from commands import UserError

CONFIG_DIR = Path(__file__).resolve().parent
SUFFIX = ".yaml"


class UnknownConfigError(UserError):
    """A bare config name that is not one of the shipped configs."""


def config_names() -> list[str]:
    """The names of the shipped configs, sorted ("digits", "dit-b2-mhsa", ...)."""
    return sorted(path.stem for path in CONFIG_DIR.glob(f"*{SUFFIX}"))


def is_bare_name(name: str | Path) -> bool:
    """True for "dit-s2-vca" or "dit-s2-vca.yaml"; False for anything with a folder or another suffix."""
    path = Path(name)
    return path.name == str(name) and path.suffix in ("", SUFFIX)


def find_config(name: str | Path) -> Path:
    """The file `name` refers to: an existing path as given, else a shipped config by its bare name.

    Raises UnknownConfigError for a bare name that neither exists as a file nor is shipped; a path with a folder
    is returned unchanged (the config loader says that it does not exist)."""
    path = Path(name)
    if path.is_file() or not is_bare_name(name):
        return path
    shipped = CONFIG_DIR / (path.stem + SUFFIX)
    if shipped.is_file():
        return shipped
    raise UnknownConfigError(
        f"config {str(name)!r} is neither a file nor a shipped config; shipped configs: {', '.join(config_names())}"
    )

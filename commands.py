"""How this project's commands answer a user error: one line `error: ...` on stderr and exit status 2.

Every command (train.py, sample.py, demo.py, `python -m training.latents`) ends with

    if __name__ == "__main__":
        run_command(main)

A user error is a bad argument, a bad config value, or a missing or damaged file: `SystemExit("message")`
raised by a command, argparse's own complaints, or one of the project's error types listed in
`user_error_types` (each names the file, key or value; a non-finite loss names the step and the settings
to change). Anything else is a bug and keeps its traceback;
`--debug` keeps the traceback of a user error too.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, NoReturn, Optional, Sequence

USER_ERROR_STATUS = 2  # as argparse exits on a bad argument
DEBUG_FLAG = "--debug"


class UserError(ValueError):
    """A bad argument or input of a command, described in one line that names it."""


def user_error_types() -> tuple[type[BaseException], ...]:
    """The exceptions that describe a user's mistake (imported when needed: `--help` stays fast)."""
    from atomic_files.shards import ShardFolderError
    from generation.export import ExportError
    from generation.official import OfficialCheckpointError
    from generation.sample_file import DamagedShardError, SampleFilesError
    from generation.vae import VAEUnavailableError
    from training.checkpoint import CheckpointError
    from training.config import ConfigError
    from training.data import CorruptImageError
    from training.loop import NonFiniteLossError

    return (UserError, ConfigError, CheckpointError, ExportError, OfficialCheckpointError, ShardFolderError,
            DamagedShardError, SampleFilesError, VAEUnavailableError, CorruptImageError, NonFiniteLossError)


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage block) and which accepts `--debug`."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(**kwargs)
        self.add_argument(DEBUG_FLAG, action="store_true", help="show the traceback of a user error too")

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message} (see {self.prog} --help)")


def run_command(main: Callable[[Optional[Sequence[str]]], Any], argv: Optional[Sequence[str]] = None) -> None:
    """Run `main(argv)` (argv: sys.argv[1:] by default); a user error becomes one line on stderr and exit 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        main(argv)
    except SystemExit as exit_:
        if not isinstance(exit_.code, str):  # exit status (argparse's --help, a plain exit): left alone
            raise
        _fail(exit_.code, exit_, debug=DEBUG_FLAG in argv)
    except Exception as error:
        if not isinstance(error, user_error_types()):
            raise
        _fail(str(error), error, debug=DEBUG_FLAG in argv)


def _fail(message: str, error: BaseException, debug: bool) -> NoReturn:
    if debug:
        raise error
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(USER_ERROR_STATUS) from None

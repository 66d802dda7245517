"""Commands run in the test process and refused: the one line a user error prints, checked for what makes it one."""

import pytest

from commands import USER_ERROR_STATUS, run_command


def one_line_error(main, argv: list[str], capsys) -> str:
    """The error line of a command that refuses `argv` as a user error (exit status 2, one line on stderr)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        run_command(main, argv)
    error = capsys.readouterr().err
    assert exited.value.code == USER_ERROR_STATUS and len(error.strip().splitlines()) == 1, error
    return error.strip()

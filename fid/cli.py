"""How fid's commands talk to a terminal: a user error is one line and exit status 2, a warning one line."""

import contextlib
import sys
import warnings
from collections.abc import Iterator

from .errors import InputError

USER_ERROR_STATUS = 2  # as argparse exits on a bad argument


@contextlib.contextmanager
def command_line(debug: bool = False) -> Iterator[None]:
    """Inside: warnings print as `warning: ...`; an InputError ends the command with `error: ...` on stderr
    and exit status 2 (`debug` keeps its traceback). Other exceptions are bugs and keep their tracebacks."""

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        print(f"warning: {message}", file=sys.stderr)

    with warnings.catch_warnings():
        warnings.simplefilter("always", UserWarning)  # the same warning for SAMPLES and REF shows twice
        warnings.showwarning = show
        try:
            yield
        except InputError as error:
            if debug:
                raise
            print(f"error: {error}", file=sys.stderr)
            raise SystemExit(USER_ERROR_STATUS) from None

"""How fid's commands print a warning: one line `warning: ...` on stderr (errors: `commands.run_command`)."""

import contextlib
import sys
import warnings
from collections.abc import Iterator


@contextlib.contextmanager
def one_line_warnings() -> Iterator[None]:
    """Inside: every UserWarning prints as `warning: ...`, each time it is raised (the same warning for SAMPLES
    and REF shows twice)."""

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        print(f"warning: {message}", file=sys.stderr)

    with warnings.catch_warnings():
        warnings.simplefilter("always", UserWarning)
        warnings.showwarning = show
        yield

"""The one error type for problems with what the user gave: a file, an argument, a value.

`python -m fid` prints an InputError as one line `error: ...` and exits with status 2; any other
exception is a bug and keeps its traceback. It is a ValueError, so callers that catch those keep working.
"""


class InputError(ValueError):
    """A bad input file, argument or value, described in one line that names it."""

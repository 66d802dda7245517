"""fid's error type for problems with what the user gave: a file, an argument, a value.

It derives from the project's one user-error base (`commands.UserError`, the ground-floor module that imports
nothing of the project, so fid still knows nothing of models): `python -m fid` prints it as one line
`error: ...` and exits with status 2 through `commands.run_command`; any other exception is a bug and keeps
its traceback.
"""

from commands import UserError


class InputError(UserError):
    """A bad input file, argument or value, described in one line that names it."""

"""`python -m fid.reference imagenet256 ...`: download ADM reference batches into the cache, or check a file
put there by hand, and print where each one is.

    python -m fid.reference imagenet256            # download into the cache, or check a file put there
    python -m fid samples.npz imagenet256          # then name it by its short name
"""

from pathlib import Path

from commands import CommandParser, run_command

from ..cli import one_line_warnings
from ..errors import InputError
from . import batches
from .batches import RESOLUTIONS, reference_batch


def main(argv: list[str] | None = None) -> list[Path]:
    parser = CommandParser(prog="python -m fid.reference", description=__doc__ + batches.__doc__)
    parser.add_argument(
        "names",
        nargs="+",
        metavar="NAME",
        help=f"imagenet{{{','.join(map(str, RESOLUTIONS))}}} (also written adm:imagenet256)",
    )
    args = parser.parse_args(argv)
    paths = []
    with one_line_warnings():
        wanted = []
        for name in args.names:
            if (batch := reference_batch(name)) is None:
                raise InputError(f"{name}: expected a name like imagenet256 ({', '.join(map(str, RESOLUTIONS))})")
            wanted.append(batch)
        for batch in wanted:
            paths.append(batches.fetch(batch))
            print(f"{batch.name}: {batch.path} (sha256 in {batch.sha256_path.name})")
    return paths


def command() -> None:
    """The installed command's entry point: a user error is one line and exit status 2 (`main`'s list of paths
    is dropped, which a console script would otherwise hand to sys.exit as an error message)."""
    run_command(main)


if __name__ == "__main__":
    command()

"""`python -m fid.reference imagenet256 ...`: download ADM reference batches into the cache, or check a file
put there by hand, and print where each one is.

    python -m fid.reference imagenet256            # download into the cache, or check a file put there
    python -m fid samples.npz imagenet256          # then name it by its short name
"""

import argparse
from pathlib import Path

from ..cli import command_line
from ..errors import InputError
from . import batches
from .batches import RESOLUTIONS, reference_batch


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(prog="python -m fid.reference", description=__doc__ + batches.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="+", metavar="NAME",
                        help=f"imagenet{{{','.join(map(str, RESOLUTIONS))}}} (also written adm:imagenet256)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of input errors")
    args = parser.parse_args(argv)
    paths = []
    with command_line(args.debug):
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
    """The installed command's entry point: runs `main` and drops its return value (the paths), which a
    console script would otherwise hand to sys.exit as an error message."""
    main()


if __name__ == "__main__":
    main()

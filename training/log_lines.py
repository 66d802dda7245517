"""The run's JSON-lines logs read tolerantly: metrics.jsonl and fid.jsonl, one JSON object per line with its "step".

A resume (`training.metrics.JsonLines.drop_after`), the curves drawn at every checkpoint (`training.curves`) and the
demo's report read them back. A line that is not what the run writes (cut by a kill, bytes that are not UTF-8, a
step that is not a number, a line without the figure a reader needs, after a hand edit or a disk fault) is left
out and named in one warning line, `warning: <log> line N: <what is wrong>; left out`: it never stops a resume or
ends a training run at its curves. Nothing here imports torch.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def parse_log(path: Path, numbers: Sequence[str] = ()) -> tuple[list[tuple[str, dict[str, Any]]], list[str]]:
    """(kept, left out) of the log at `path` (none when it is missing): each good line's text and object, in file
    order, and a description of each line left out. A good line is a JSON object whose "step" is a whole number
    and whose keys `numbers` hold numbers (the figures a reader draws)."""
    if not path.exists():
        return [], []
    kept, left_out = [], []
    for number, raw in enumerate(path.read_bytes().splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
            value = json.loads(text)
        except UnicodeDecodeError:
            problem = "not UTF-8 text"
        except json.JSONDecodeError:
            problem = "not JSON (a line cut by a kill, or edited)"
        else:
            problem = _problem(value, numbers)
        if problem is None:
            kept.append((text, value))
        else:
            left_out.append(f"{path} line {number}: {problem}")
    return kept, left_out


def _problem(value: Any, numbers: Sequence[str]) -> str | None:
    if not isinstance(value, dict):
        return f"a JSON {type(value).__name__}, not an object"
    step = value.get("step")
    if not _is_number(step) or not math.isfinite(step) or step != int(step):
        return f'its "step" is {json.dumps(step)}, not a whole number' if "step" in value else 'no "step"'
    for key in numbers:
        if key not in value:
            return f"no {key!r}"
        if not _is_number(value[key]):
            return f"its {key!r} is {json.dumps(value[key])}, not a number"
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def warn_left_out(left_out: Sequence[str]) -> None:
    """One `warning:` line on stderr for each line of a log left out."""
    for line in left_out:
        print(f"warning: {line}; left out", file=sys.stderr, flush=True)


def read_log(path: Path, numbers: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The good lines of the log at `path` as objects (see `parse_log`), the others named in warnings."""
    kept, left_out = parse_log(path, numbers)
    warn_left_out(left_out)
    return [value for _, value in kept]

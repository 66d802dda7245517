"""Saving a benchmark's results: JSON, a Markdown table and a PNG plot, each replaced atomically."""

import json
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: benchmarks run on servers without a display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from fid.atomic import atomic_output  # noqa: E402


def save_results(out_dir: Path, stem: str, results: dict, table: str, plot: Callable[[dict], Figure]) -> None:
    """Write `<stem>.json`, `<stem>.md` (the table) and `<stem>.png` (the figure `plot` draws) into out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic_output(out_dir / f"{stem}.json") as path:
        path.write_text(json.dumps(results, indent=1) + "\n")
    with atomic_output(out_dir / f"{stem}.md") as path:
        path.write_text(table)
    figure = plot(results)
    with atomic_output(out_dir / f"{stem}.png") as path:
        figure.savefig(path, format="png", dpi=110)
    plt.close(figure)

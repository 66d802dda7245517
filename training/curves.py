"""The run's curves as a picture: `<run>/curves.png`, drawn again after every checkpoint (main process) and at
the end of the run. What it shows (the steps of the loss, of each FID) is written into the PNG's text too
(`Description`), so that a glance with any PNG reader, or a test, tells how far it goes.

The training loss of every metrics.jsonl line against the step (REPA's alignment loss beside it when logged), and
the FID of every fid.jsonl line when FID is measured during training, read from the files the run writes, so a
resumed run draws its whole history. TensorBoard shows the same figures live; the PNG needs nothing to look at.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from atomic_files import atomic_output
from training.log_lines import read_log


def draw_curves(metrics_file: Path, fid_file: Path, out: Path, title: str) -> Path | None:
    """Write the loss (and FID) curves of a run's logs to `out`, atomically; None when there is nothing to draw."""
    from matplotlib.figure import Figure  # no pyplot: no display backend is chosen or needed

    metrics, fids = read_log(metrics_file, ["loss"]), read_log(fid_file, ["fid"])  # a damaged line: named, left out
    if not metrics:
        return None
    figure = Figure(figsize=(10 if fids else 5.5, 4), layout="constrained")
    axes = figure.subplots(1, 2 if fids else 1, squeeze=False)[0]
    steps = [line["step"] for line in metrics]
    axes[0].plot(steps, [line["loss"] for line in metrics])
    axes[0].set(xlabel="step", ylabel="training loss (mean of each logging window)", yscale="log", title=title)
    if any("alignment_loss" in line for line in metrics):  # negative (a cosine similarity): an axis of its own
        alignment = axes[0].twinx()
        alignment.plot(steps, [line.get("alignment_loss") for line in metrics], color="tab:orange")
        alignment.set_ylabel("REPA alignment loss", color="tab:orange")
    if fids:
        weights = fids[-1].get("weights", "ema")
        axes[1].plot([line["step"] for line in fids], [line["fid"] for line in fids], marker="o")
        axes[1].set(
            xlabel="step", ylabel=f"FID of {fids[-1].get('samples', '?')} samples ({weights} weights)", title="FID"
        )
    for axis in axes:
        axis.grid(True, alpha=0.3)
    with atomic_output(out) as temporary:
        figure.savefig(temporary, format="png", dpi=100, metadata={"Title": title, "Description": shown(steps, fids)})
    return out


def shown(steps: list[int], fids: list[dict[str, Any]]) -> str:
    """What a drawing shows, in words: "loss at steps 1-40 (8 points); FID at steps 20, 40 (1000 samples)"."""
    text = f"loss at steps {steps[0]}-{steps[-1]} ({len(steps)} points)"
    if fids:
        text += f"; FID at steps {', '.join(str(line['step']) for line in fids)} ({fids[-1]['samples']} samples)"
    return text

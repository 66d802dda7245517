"""Training metrics: per-process sums on the device, reduced over processes only when a line is written.

Each line of metrics.jsonl (written by the main process alone) holds the loss averaged over the steps since
the previous line and over processes, each process's own mean, the gradient norm (null when the run does not clip
gradients, train.max_grad_norm null: the norm is then not computed), the learning rate and the throughput. The
first step whose loss is not finite is tracked without a host sync per step.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from atomic_files import write_text_atomic
from training.log_lines import parse_log, warn_left_out

NO_BAD_STEP = math.inf


class JsonLines:
    """An append-only log of one JSON object per line, keyed by "step" (written by the main process); every line
    holds the figures `numbers` ("loss" in metrics.jsonl, "fid" in fid.jsonl)."""

    def __init__(self, path: Path, numbers: Sequence[str] = ()) -> None:
        self.path = path
        self.numbers = numbers

    def append(self, line: dict[str, Any]) -> None:
        with self.path.open("a") as file:
            file.write(json.dumps(line) + "\n")

    def drop_after(self, step: int) -> None:
        """On resume, forget lines a killed run wrote after its last checkpoint (they are written again), and lines
        that are not the run's (training.log_lines: named in a warning each, never a stop)."""
        if not self.path.exists():
            return
        lines, left_out = parse_log(self.path, self.numbers)
        warn_left_out(left_out)
        write_text_atomic(self.path, "".join(text + "\n" for text, line in lines if line["step"] <= step))


class TrainingMetrics:
    """Accumulates loss and gradient norm between log lines; see the module docstring."""

    def __init__(
        self,
        accelerator: Accelerator,
        path: Path,
        images_per_step: int,
        start_step: int,
        window: dict[str, Any] | None = None,
        grad_norm: bool = True,
    ) -> None:
        """`window`: the sums a checkpoint stored (`window()`), restored when the process count is the same.
        `grad_norm`: whether steps come with a gradient norm (False: lines say null)."""
        self.accelerator = accelerator
        self.logs_grad_norm = grad_norm
        self.log = JsonLines(path, ["loss"])
        self.images_per_step = images_per_step
        device = accelerator.device
        self.loss_sum = torch.zeros((), device=device)
        self.grad_norm_sum = torch.zeros((), device=device)
        self.first_bad_step = torch.full((), NO_BAD_STEP, device=device)
        self.steps = 0
        self.skipped_images = 0
        self.term_sums: dict[str, torch.Tensor] = {}  # extra loss terms, e.g. REPA's alignment_loss
        self.clock, self.clock_step = time.perf_counter(), start_step
        if accelerator.is_main_process:
            self.log.drop_after(start_step)
        if window is not None and len(window["loss_sum"]) == accelerator.num_processes:
            self._restore(window)

    def record(
        self,
        step: int,
        loss: torch.Tensor,
        grad_norm: torch.Tensor | None,
        skipped_images: int,
        **terms: torch.Tensor,
    ) -> None:
        """Add one optimiser step (loss, grad_norm and the named loss `terms` are 0-d tensors on the device;
        grad_norm None when it was not computed)."""
        for name, value in terms.items():
            self.term_sums[name] = self.term_sums.get(name, torch.zeros_like(self.loss_sum)) + value
        self.loss_sum += loss
        if grad_norm is not None:
            self.grad_norm_sum += grad_norm
        bad = torch.full_like(self.first_bad_step, step)
        self.first_bad_step = torch.where(
            torch.isfinite(loss), self.first_bad_step, torch.minimum(self.first_bad_step, bad)
        )
        self.steps += 1
        self.skipped_images += skipped_images

    def window(self) -> dict[str, Any]:
        """Every process's sums over the steps since the last line (collective: every process calls it), for a
        checkpoint: a run resumed from it writes the lines an uninterrupted run writes."""
        names = sorted(self.term_sums)
        skipped = torch.tensor(float(self.skipped_images), device=self.loss_sum.device)
        local = torch.stack([self.loss_sum, self.grad_norm_sum, skipped, *(self.term_sums[name] for name in names)])
        gathered = self.accelerator.gather(local[None]).cpu()  # (processes, 3 + terms) float32
        return {
            "steps": self.steps,
            "loss_sum": gathered[:, 0].tolist(),  # float32 values: exact as JSON numbers
            "grad_norm_sum": gathered[:, 1].tolist(),
            "skipped_images": [int(value) for value in gathered[:, 2].tolist()],
            "terms": {name: gathered[:, 3 + k].tolist() for k, name in enumerate(names)},
        }

    def _restore(self, window: dict[str, Any]) -> None:
        rank = self.accelerator.process_index
        self.steps = window["steps"]
        self.loss_sum.fill_(window["loss_sum"][rank])
        self.grad_norm_sum.fill_(window["grad_norm_sum"][rank])
        self.skipped_images = window["skipped_images"][rank]
        self.term_sums = {
            name: torch.full_like(self.loss_sum, values[rank]) for name, values in window["terms"].items()
        }

    def first_non_finite_step(self) -> int | None:
        """The earliest step (on any process) whose loss was not finite, or None."""
        first = self.accelerator.gather(self.first_bad_step[None]).min()
        return None if first.item() == NO_BAD_STEP else int(first.item())

    def write(self, step: int, **extra: Any) -> dict[str, Any]:
        """Reduce over processes, append one line to metrics.jsonl and the trackers, start a new window."""
        names = sorted(self.term_sums)
        local = torch.stack(
            [
                self.loss_sum / self.steps,
                self.grad_norm_sum / self.steps,
                torch.tensor(float(self.skipped_images), device=self.loss_sum.device),
                *(self.term_sums[name] / self.steps for name in names),
            ]
        )
        gathered = self.accelerator.gather(local[None]).cpu()  # (processes, 3 + terms)
        now = time.perf_counter()
        steps_per_s = (step - self.clock_step) / (now - self.clock)
        per_process = gathered[:, 0].tolist()
        line = {
            "step": step,
            "loss": sum(per_process) / len(per_process),
            "loss_per_process": per_process,
            # identical on every process once gradients are all-reduced; None: not computed (no clipping)
            "grad_norm": gathered[0, 1].item() if self.logs_grad_norm else None,
            "steps_per_s": steps_per_s,
            "images_per_s": steps_per_s * self.images_per_step,
            "skipped_images": int(gathered[:, 2].sum().item()),  # corrupt files skipped in the window
            **{name: gathered[:, 3 + k].mean().item() for k, name in enumerate(names)},
            **extra,
        }
        if self.accelerator.is_main_process:
            self.log.append(line)
            self.accelerator.log(
                {
                    f"train/{key}": value
                    for key, value in line.items()
                    if isinstance(value, (int, float)) and key != "step"
                },
                step=step,
            )
        self.loss_sum.zero_()
        self.grad_norm_sum.zero_()
        self.steps = self.skipped_images = 0
        self.term_sums = {}
        self.clock, self.clock_step = now, step
        return line

"""The training loop: optimiser steps over sharded micro-batches, EMA, logs, checkpoints, sample grids, FID.

One optimiser step consumes `grad_accum_steps` micro-batches on every process. After the step the EMA is
updated; then, at their intervals, a metrics line is written, a checkpoint saved, a grid drawn and FID
measured; after a checkpoint (and after FID) the loss and FID curves are drawn to <run>/curves.png, at most once
every CURVES_INTERVAL_S, and once more at the end of the run (a resumed one too) where a checkpoint or FID came
since the last drawing, so the picture always shows the last of them.
A non-finite loss stops the run before anything is saved after it. A stop signal
(SIGTERM, SIGUSR1, SIGINT; see training.stop_signals) ends the run after the current optimiser step, with its
metrics line and a checkpoint of it. A process of the run that dies ends the others with one line
(PeerLostError) naming it and the checkpoint that stands.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from accelerate import Accelerator
from tqdm import tqdm

from atomic_files import OutputError
from commands import UserError, end_processes
from generation.cuda_graphs import CapturedCalls
from generation.run_layout import grid_name
from generation.vae import sample_latents
from training.build import TrainingParts
from training.checkpoint import checkpoint_bytes, save_checkpoint, save_milestone_export
from training.config import Config, config_to_yaml
from training.curves import draw_curves
from training.data import CorruptImageError
from training.metrics import JsonLines, TrainingMetrics
from training.power_ema import drop_snapshots_after
from training.preview import preview_fid, save_preview_grid
from training.run import RunDirectory
from training.stop_signals import PeerLostError, StopSignals, peer_lost
from training.trackers import log_grid, tracker_state


class NonFiniteLossError(UserError):
    """The loss became NaN or infinite."""


PROGRESS = ("step", "examples_seen", "metrics_window")  # what a resume takes from a saved state
# A drawing of the curves costs ~0.3 CPU-s (~0.7 s more for matplotlib's first import): nothing between checkpoints
# hours apart, but most of a test's or smoke run's time when they come every few seconds. Those are drawn once this
# much time has passed since the launch or the last drawing.
CURVES_INTERVAL_S = 60.0


def say(accelerator: Accelerator, message: str, end: str = "\n") -> None:
    """Print on the global main process only (Accelerate's print speaks once per node: a job's log on
    several nodes would hold each line once per node)."""
    if accelerator.is_main_process:
        print(message, end=end, flush=True)


@dataclass
class TrainerState:
    """Where a run stands: optimiser steps done and examples drawn, corrupt files included (the data
    position), the metrics of the steps since the last log line (training.metrics.TrainingMetrics.window), with
    the batch geometry that produced them."""

    step: int = 0
    examples_seen: int = 0
    num_processes: int = 1
    micro_batch_size: int = 1
    grad_accum_steps: int = 1
    metrics_window: dict[str, Any] | None = None

    def resumed(self, saved: dict[str, Any]) -> TrainerState:
        """This run's geometry with the progress of a saved state (a checkpoint's trainer_state.json)."""
        return TrainerState(**{**asdict(self), **{key: saved.get(key) for key in PROGRESS}})

    def same_geometry(self, saved: dict[str, Any]) -> bool:
        return all(saved[key] == value for key, value in asdict(self).items() if key not in PROGRESS)

    @property
    def stream_position(self) -> int:
        """Micro-batches each process has drawn; exact when the geometry is unchanged, nearest otherwise."""
        return self.examples_seen // (self.num_processes * self.micro_batch_size)


class Trainer:
    """Runs `config.train.max_steps` optimiser steps from `state` (see the module docstring)."""

    def __init__(
        self,
        accelerator: Accelerator,
        config: Config,
        run: RunDirectory,
        parts: TrainingParts,
        state: TrainerState,
        last_checkpoint: str | None = None,
    ) -> None:
        self.accelerator = accelerator
        self.config = config
        self.run = run
        self.parts = parts
        self.model, self.ema, self.objective = parts.model, parts.ema, parts.objective
        self.optimizer, self.scheduler, self.batches = parts.optimizer, parts.scheduler, parts.batches
        self.posthoc_ema = parts.posthoc_ema
        self.state = state
        self.last_checkpoint = last_checkpoint
        self.saving_step: int | None = None  # the step of a checkpoint being written
        self.fid_log = JsonLines(run.fid, ["fid"])
        self.step_terms: dict[str, torch.Tensor] = {}  # loss terms logged on their own (REPA's alignment loss)
        self.curves_drawn_at = time.monotonic()  # the launch: see CURVES_INTERVAL_S
        self.curves_behind = False  # a checkpoint or FID logged since curves.png was last drawn
        self.captured = CapturedCalls(self.captured_step, pure=False) if config.train.cuda_graph else None
        if self.captured is not None and accelerator.device.type == "cuda":
            # The graph reads the learning rate from a tensor that the scheduler fills at every step: a float would
            # be fixed at capture. Set here, after a resume's optimiser settings (training.checkpoint).
            for group in self.optimizer.param_groups:
                group["lr"] = torch.tensor(float(group["lr"]), device=accelerator.device)

    def fit(self) -> str | None:
        """Train to max_steps; returns None, or the name of the signal that stopped the run (checkpoint written)."""
        stop = StopSignals(standing=self.standing)
        progress = tqdm(
            total=self.config.train.max_steps,
            initial=self.state.step,
            desc="training",
            dynamic_ncols=True,
            disable=not self.accelerator.is_main_process,
        )
        try:
            return self._fit(stop, progress)
        except RuntimeError as error:  # a collective (gradients, the stop flag, a barrier) that lost its peer
            peer = peer_lost(error)
            if peer is None:
                raise
            # The groups go here, as at a normal end: left to the interpreter's exit, a gloo worker still dropping
            # the failed collective's tensors aborted the process (exit -6 instead of 2 in ~1 of 13 runs)
            end_processes(self.accelerator)
            raise PeerLostError(
                f"lost the connection to the process of this run at {peer} after step {self.state.step}: that "
                f"process or its node has ended (its own log says why); {self.kept()}: continue with --resume latest"
            ) from None
        finally:
            progress.close()  # before an error's line, which then starts a line of its own
            stop.restore()

    def _fit(self, stop: StopSignals, progress: tqdm) -> str | None:
        config, accelerator = self.config, self.accelerator
        log, max_steps = config.log, config.train.max_steps
        stream = self.batches.stream(self.state.stream_position)
        metrics = TrainingMetrics(
            accelerator,
            self.run.metrics,
            config.train.global_batch_size,
            self.state.step,
            self.state.metrics_window,
            grad_norm=config.train.max_grad_norm is not None,
        )
        if accelerator.is_main_process:
            self.fid_log.drop_after(self.state.step)
            drop_snapshots_after(self.run.root, self.state.step)  # post-hoc EMA snapshots of an abandoned timeline
        while self.state.step < max_steps:
            loss, grad_norm, skipped = self.train_step(stream)
            step = self.state.step
            metrics.record(step, loss, grad_norm, skipped, **self.step_terms)
            progress.update()
            last = step == max_steps
            if step % log.every == 0 or last:
                self.stop_if_non_finite(metrics)
                line = metrics.write(step, lr=float(self.scheduler.get_last_lr()[0]), epoch=self.epoch())
                norm = {"grad_norm": f"{line['grad_norm']:.3f}"} if line["grad_norm"] is not None else {}
                progress.set_postfix(loss=f"{line['loss']:.4f}", **norm)
            stopping = not last and stop.agreed()  # every rank, after the same step (the last one ends anyway)
            if self.posthoc_ema is not None and self.posthoc_ema.snapshot_due(step, last):  # also when stopping:
                self.stop_if_non_finite(metrics)  # a resume continues after this step
                self.save_posthoc_snapshot()
            if log.export_every and step % log.export_every == 0:
                self.stop_if_non_finite(metrics)
                self.save_milestone()
            checkpoint_due = step % log.checkpoint_every == 0 or last
            if stopping or checkpoint_due:
                self.stop_if_non_finite(metrics)
                self.save_checkpoint(metrics)
            if stopping:  # a grid, FID or curves due at this step are left out: the scheduler's grace time is short
                stop.hold_until_exit()  # the status is 75 from here, whatever signals come
                self.say_stopped(stop)
                end_processes(accelerator)
                return stop.name()
            if checkpoint_due:
                self.save_curves()
            if log.sample_every and (step % log.sample_every == 0 or last):
                self.save_grid()
            if log.fid_every and (step % log.fid_every == 0 or last):
                self.measure_fid()
        self.save_curves(final=True)  # the last checkpoint and FID, whatever the interval
        end_processes(accelerator)
        return None

    def say_stopped(self, stop: StopSignals) -> None:
        """Say which checkpoint the stop wrote, how long after the signal, and how to continue."""
        seconds = stop.seconds_since_signal()
        after = f" {seconds:.1f} s after the signal" if seconds is not None else ""
        self.say(
            f"stopped by {stop.name()} after step {self.state.step}: checkpoint "
            f"{self.last_checkpoint} written{after}; continue with --resume latest"
        )

    def say(self, message: str) -> None:
        say(self.accelerator, message)

    def train_step(self, stream: Iterator) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """One optimiser step and the EMA updates after it; returns (mean loss, grad norm or None, skipped
        files)."""
        loss, grad_norm, skipped = self.optimizer_step(stream)
        self.ema.update(self.accelerator.unwrap_model(self.model), step=self.state.step)
        if self.posthoc_ema is not None:
            self.posthoc_ema.update(self.accelerator.unwrap_model(self.model))
        return loss, grad_norm, skipped

    def optimizer_step(self, stream: Iterator) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """Accumulate gradients over micro-batches and step; returns (mean loss, grad norm, skipped files). The
        norm is that of the clipping (train.max_grad_norm); without clipping it is not computed (None): a norm
        over every gradient is one more pass over the model's parameters for a number nobody acts on."""
        accelerator, train = self.accelerator, self.config.train
        losses, alignments, skipped = [], [], 0
        grad_norm = None
        for _ in range(train.grad_accum_steps):
            x, y, batch_skipped, *paired = next(stream)  # paired: the latents' own images, for REPA
            self.state.examples_seen += self.batches.loader.batch_size * accelerator.num_processes
            if len(y) == 0:
                raise CorruptImageError(
                    f"every image of a micro-batch was corrupt (step {self.state.step + 1}); check data.images"
                )
            x, y = x.to(accelerator.device, non_blocking=True), y.to(accelerator.device, non_blocking=True)
            images = paired[0].to(accelerator.device, non_blocking=True) if paired else x  # before VAE encoding
            if self.parts.encoder is not None:
                with accelerator.autocast():
                    x = sample_latents(self.parts.encoder, x, self.parts.export.latent_normalization)  # (B, C, h, w)
            with accelerator.accumulate(*self.parts.trained_modules):
                if self.captured is None:
                    loss, alignment, norm = self.learn(x, y, images)
                    self.optimizer.zero_grad(set_to_none=True)
                else:  # train.cuda_graph: a replay of the captured step (no REPA: train.py refuses it)
                    (loss, norm), alignment = self.captured(x, y), None
                grad_norm = norm if norm is not None else grad_norm
                if accelerator.sync_gradients:
                    self.scheduler.step()
            losses.append(loss.detach())
            alignments += [alignment.detach()] if alignment is not None else []
            skipped += batch_skipped
        self.state.step += 1
        self.step_terms = {"alignment_loss": torch.stack(alignments).mean()} if alignments else {}
        return torch.stack(losses).mean(), grad_norm, skipped

    def learn(
        self, x: torch.Tensor, y: torch.Tensor, images: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One micro-batch's loss, its backward, the clipping (at the last micro-batch of a step) and the optimiser's
        step: (loss, REPA's alignment loss or None, the clipping's gradient norm or None)."""
        accelerator, train = self.accelerator, self.config.train
        loss, alignment = self.losses(x, y, images)
        accelerator.backward(loss)
        grad_norm = None
        if accelerator.sync_gradients and train.max_grad_norm is not None:
            parameters = [p for module in self.parts.trained_modules for p in module.parameters()]
            grad_norm = accelerator.clip_grad_norm_(parameters, train.max_grad_norm).detach().float()
        self.optimizer.step()
        return loss, alignment, grad_norm

    def captured_step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What train.cuda_graph captures (generation.cuda_graphs): `learn` on a batch, with the gradients dropped
        before it rather than after, so that the captured backward writes them anew and every replay finds them
        where the captured optimiser step reads them. Returns (loss, gradient norm or None)."""
        self.optimizer.zero_grad(set_to_none=True)
        loss, _, grad_norm = self.learn(x, y, x)
        return loss.detach(), grad_norm

    def losses(
        self, x: torch.Tensor, y: torch.Tensor, images: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(loss to minimise, REPA's alignment loss or None) of one micro-batch; `images` are the examples' own
        images, which REPA's encoder sees."""
        alignment = self.parts.alignment
        if alignment is None:
            return self.objective.training_losses(self.model, x, y)["loss"].mean(), None
        with self.accelerator.autocast():
            targets = alignment.targets(images)  # (B, N, D) float32, no_grad
        objective, aligned = alignment.losses(self.objective.training_losses, self.model, x, y, targets)
        return objective.mean() + alignment.coefficient * aligned.mean(), aligned.mean()

    def epoch(self) -> float:
        return self.state.stream_position / self.batches.batches_per_epoch

    def stop_if_non_finite(self, metrics: TrainingMetrics) -> None:
        bad_step = metrics.first_non_finite_step()
        if bad_step is not None:
            raise NonFiniteLossError(
                f"the loss is not finite at step {bad_step}; training stopped and {self.kept()} "
                f"(try a lower train.lr, train.max_grad_norm, or train.mixed_precision=fp32)"
            )

    def standing(self) -> str:
        """Which checkpoint stands when the process ends at once (a second SIGINT)."""
        if self.saving_step is not None:
            return f"the checkpoint of step {self.saving_step}, being written, is abandoned and {self.kept()}"
        return self.kept()

    def kept(self) -> str:
        """What a run stopped by an error leaves to resume from."""
        return (
            f"the last checkpoint, {self.last_checkpoint}, is intact"
            if self.last_checkpoint
            else "no checkpoint was written"
        )

    def save_checkpoint(self, metrics: TrainingMetrics) -> None:
        self.saving_step = self.state.step
        trainer_state = {
            **asdict(self.state),
            "metrics_window": metrics.window(),  # so that the resumed run logs what an uninterrupted one would
            **tracker_state(self.accelerator),  # tracker run ids for resume
        }
        posthoc = self.posthoc_ema
        needed = checkpoint_bytes(
            self.model.state_dict(),
            self.optimizer.state_dict(),
            self.ema.state_dict(),
            posthoc.state_tensors() if posthoc is not None else {},
        )
        try:
            path = save_checkpoint(
                self.accelerator,
                self.run.checkpoints,
                self.state.step,
                self.ema,
                trainer_state,
                self.parts.export,
                config_to_yaml(self.config),
                self.config.log.keep_checkpoints,
                needed,
                write_more=posthoc.write_state if posthoc is not None else None,
            )
        except OutputError as error:
            raise OutputError(f"{error} (training stopped after step {self.state.step}; {self.kept()})") from None
        self.last_checkpoint, self.saving_step = str(path), None
        self.say(f"saved checkpoint {path}")

    def save_curves(self, final: bool = False) -> None:
        """<run>/curves.png from the logs so far: after a checkpoint, and after FID, which comes later, unless it was
        drawn less than CURVES_INTERVAL_S ago; at the end of the run (`final`) whenever one of them came since the
        last drawing."""
        if not self.accelerator.is_main_process:
            return
        self.curves_behind |= not final
        if self.curves_behind and (final or time.monotonic() - self.curves_drawn_at >= CURVES_INTERVAL_S):
            draw_curves(self.run.metrics, self.run.fid, self.run.curves, self.run.root.name)
            self.curves_drawn_at, self.curves_behind = time.monotonic(), False

    def save_posthoc_snapshot(self) -> None:
        if self.accelerator.is_main_process:
            path = self.posthoc_ema.save_snapshot(self.run.root, self.state.step, self.parts.export)
            self.accelerator.print(f"saved post-hoc EMA snapshot {path}")
        self.accelerator.wait_for_everyone()

    def save_milestone(self) -> None:
        if self.accelerator.is_main_process:
            path = save_milestone_export(self.run.exports, self.state.step, self.ema, self.parts.export)
            self.say(f"saved export {path}")
        self.accelerator.wait_for_everyone()

    def save_grid(self) -> None:
        if self.accelerator.is_main_process:
            self.run.samples.mkdir(parents=True, exist_ok=True)
            grid = self.run.samples / grid_name(self.state.step)
            log = self.config.log
            title = f"step {self.state.step:,}, {self.parts.preview_weights.label}, guidance {log.sample_guidance:g}"
            self.parts.preview_weights.refresh(self.accelerator.unwrap_model(self.model))
            about = {"run": str(self.run.root), "step": self.state.step, "weights": self.parts.preview_weights.label}
            with self.accelerator.autocast():
                save_preview_grid(self.parts.preview, log, grid, title, about)
            log_grid(self.accelerator, grid, self.state.step)
        self.accelerator.wait_for_everyone()

    def measure_fid(self) -> None:
        self.parts.preview_weights.refresh(self.accelerator.unwrap_model(self.model))
        with self.accelerator.autocast():
            fid = preview_fid(
                self.parts.preview,
                self.config.log,
                self.parts.fid_extractor,
                self.accelerator.process_index,
                self.accelerator.num_processes,
                self.batches.loader.batch_size,
            )
        log = self.config.log
        if self.accelerator.is_main_process:
            self.fid_log.append(
                {"step": self.state.step, "fid": fid, "samples": log.fid_samples, "weights": log.fid_weights}
            )
            self.accelerator.log({"eval/fid": fid}, step=self.state.step)
        label = self.parts.preview_weights.label
        self.say(f"step {self.state.step}: FID of {log.fid_samples} samples of the {label} {fid:.3f}")
        self.save_curves()

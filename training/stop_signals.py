"""Stop a training run cleanly on a signal: finish the optimiser step, agree on the step, checkpoint, exit 75.

Clusters end jobs with signals: Slurm sends SIGTERM at preemption and at the time limit (and, with
`--signal=USR1@120`, SIGUSR1 two minutes ahead), a terminal sends SIGINT. On the first SIGTERM, SIGUSR1 or
SIGINT a process only notes the signal; after each optimiser step every process adds its flag to one
all-reduce, so a signal that reached one rank (or the launcher, which forwards it to all) stops every rank
after the same step. The loop then writes a checkpoint and the command exits with `STOPPED_STATUS`, which a
requeue script tests. The first signal puts the default actions back, so a second one ends the process at
once (also inside a blocking call), as an impatient user expects.

The all-reduce runs over a CPU (gloo) group of its own: with NCCL training it does not wait for the GPU's queue.
"""

from __future__ import annotations

import signal
from types import FrameType

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
STOPPED_STATUS = 75  # EX_TEMPFAIL of sysexits.h: "a temporary failure; the user is invited to retry"


class StopSignals:
    """Notes the first stop signal this process receives; `agreed()` tells every rank whether any rank has one.

    Create it on every process at the same point (it builds a process group when several processes run) and
    call `restore()` when training ends."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._group = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.new_group(backend="gloo")  # collective: every rank creates it here
        self._previous = {number: signal.signal(number, self._note) for number in STOP_SIGNALS}

    def _note(self, number: int, frame: FrameType | None) -> None:
        self.received = number
        for other in STOP_SIGNALS:
            signal.signal(other, signal.SIG_DFL)  # a second signal ends the process at once

    def agreed(self) -> bool:
        """True on every rank when any rank has received a stop signal (one all-reduce when several run)."""
        flag = torch.tensor([0 if self.received is None else 1], dtype=torch.int32)
        if self._group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())

    def name(self) -> str:
        """The signal this process received ("a signal to another process" when only another rank got one)."""
        return signal.Signals(self.received).name if self.received is not None else "a signal to another process"

    def restore(self) -> None:
        """Put back the handlers that were there before (tests run several trainings in one process)."""
        for number, previous in self._previous.items():
            signal.signal(number, previous)

"""Stop a training run cleanly on a signal: finish the optimiser step, agree on the step, checkpoint, exit 75.

Clusters end jobs with signals: Slurm sends SIGTERM at preemption, at `scancel` and at the time limit (and, with
`--signal=B:USR1@120`, SIGUSR1 to the batch script two minutes ahead), a terminal sends SIGINT. A scheduler
delivers one stop more than once: Slurm signals every process of a job step, and `srun` and `torchrun` forward the
signal they got to their children as well, so one worker sees SIGTERM two or three times within milliseconds
(torchrun: twice, 20 ms apart, at a time limit). Every stop signal, however often it arrives, therefore asks for the
same thing: after the current optimiser step every process adds its flag to one all-reduce, so a signal that
reached one rank (or the launcher, which forwards it to all) stops every rank after the same step; the loop
writes a checkpoint of that step and the command exits with `STOPPED_STATUS`, which a requeue script tests.

What ends a process at once, without a checkpoint of the current step:
- SIGINT again, `REPEAT_WINDOW_S` or more after the first stop signal (a user pressing Ctrl-C a second time; a
  launcher's forwarded copy comes within milliseconds and is the same stop). It also ends a checkpoint that has
  begun: the one being written is abandoned whole (its hidden folder is removed at the next resume) and the
  message says which checkpoint stands. The process then dies of SIGINT (status 130 in a shell).
- SIGKILL, which the scheduler sends once its grace time is over (Slurm's KillWait, 30 s by default after the
  SIGTERM; torchrun's TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s), and SIGQUIT (Ctrl-\\), which no handler catches.
SIGTERM and SIGUSR1 repeated never end the process early: they come from schedulers and launchers, whose repeats
do not mean "lose the work" (the scheduler's own deadline is SIGKILL). Once the stop's checkpoint is written, a
command process ignores every stop signal until it is gone (`StopSignals.hold_until_exit`): however many more come
while it shuts down, its status is 75.

A process of the run that dies (its node lost, killed, crashed) breaks the connections of the others, whose next
collective fails in gloo ("Connection reset by peer"): `peer_lost` recognises that error, and the training loop
turns it into one line (PeerLostError) naming the lost peer's address and the checkpoint that stands.

The all-reduce runs over a CPU (gloo) group of its own: with NCCL training it does not wait for the GPU's queue.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from types import FrameType

import torch
import torch.distributed as dist

from atomic_files import write_text_atomic
from commands import UserError, is_command_process

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
STOPPED_STATUS = 75  # EX_TEMPFAIL of sysexits.h: "a temporary failure; the user is invited to retry"
STATUS_FILE_VARIABLE = "STOPPED_STATUS_FILE"  # names the file a stopped run writes its status into (below)
PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent dies
REPEAT_WINDOW_S = 2.0  # a repeated SIGINT within this time is a forwarded copy of the first (measured: 20 ms)
CONNECT_TIMEOUT = timedelta(seconds=60)  # how long the stop-flag group waits for every process to connect
OPERATION_TIMEOUT = timedelta(minutes=30)  # then, how long one all-reduce may wait (gloo's default)


# gloo's errors when the other end of a connection has gone (gloo/transport/tcp/pair.cc: "Read error [ADDRESS]:PORT:
# Connection reset by peer", "Connection closed by peer [ADDRESS]:PORT"), and the peer's address in them
PEER_GONE = re.compile(r"(Connection reset by peer|Connection closed by peer|Broken pipe|Socket closed)")
PEER_ADDRESS = re.compile(r"\[([^\]]+)\]:(\d+)")


class GroupConnectError(UserError):
    """The processes of a multi-node run cannot reach each other over gloo."""


class PeerLostError(UserError):
    """Another process of the run has gone (its node lost, or the process killed or crashed) in mid-training."""


def peer_lost(error: BaseException) -> str | None:
    """The lost peer ("ADDRESS:PORT", or "another process" when gloo names none) when `error` is a collective that
    failed because the other end of a connection has gone; None for any other error."""
    message = str(error)
    if not isinstance(error, RuntimeError) or "gloo" not in message or not PEER_GONE.search(message):
        return None
    address = PEER_ADDRESS.search(message)
    return f"{address[1]}:{address[2]}" if address else "another process"


class StopSignals:
    """Notes the first stop signal this process receives; `agreed()` tells every rank whether any rank has one.

    Create it on every process at the same point (it builds a process group when several processes run) and
    call `restore()` when training ends. `standing()` says which checkpoint stands if the process ends at once."""

    def __init__(self, standing: Callable[[], str] = lambda: "no checkpoint of this launch was written") -> None:
        self.received: int | None = None
        self.received_at: float | None = None  # time.monotonic() of the first stop signal
        self.standing = standing
        self._group = None
        self._holding = False  # hold_until_exit: the stop signals stay ignored until the process ends
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._group = stop_flag_group()
        self._previous = {number: signal.signal(number, self._note) for number in STOP_SIGNALS}

    def _note(self, number: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self.received is None:
            self.received, self.received_at = number, now
        elif number == signal.SIGINT and now - self.received_at >= REPEAT_WINDOW_S:
            self.end_now(number)
        # else: the same stop delivered again (the scheduler, srun and torchrun each send it)

    def end_now(self, number: int) -> None:
        """End the process by `number` at once, saying which checkpoint stands."""
        print(
            f"{signal.Signals(number).name} again: ending at once, without a checkpoint of this step; "
            f"{self.standing()}",
            file=sys.stderr,
            flush=True,
        )
        signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)

    def seconds_since_signal(self) -> float | None:
        """Seconds since the first stop signal this process received (None: it received none)."""
        return None if self.received_at is None else time.monotonic() - self.received_at

    def agreed(self) -> bool:
        """True on every rank when any rank has received a stop signal (one all-reduce when several run)."""
        flag = torch.tensor([0 if self.received is None else 1], dtype=torch.int32)
        if self._group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())

    def name(self) -> str:
        """The signal this process received ("a signal to another process" when only another rank got one)."""
        return signal.Signals(self.received).name if self.received is not None else "a signal to another process"

    def hold_until_exit(self) -> None:
        """The stop's checkpoint is written and the process only ends from here on: in a command process every stop
        signal is ignored from now until the process is gone, so that its status stays 75. A handler put back by
        `restore()` would let a repeated SIGTERM end the process with 143 while it shuts down (seen 1 to 4 s after
        the "stopped" line), and so would Python's own handler, which CPython replaces by the default one at its
        shutdown; an ignored signal stays ignored to the end. Where a command's main runs in a test or a notebook,
        `restore()` puts the handlers back as usual."""
        if is_command_process():
            self._holding = True
            for number in STOP_SIGNALS:
                signal.signal(number, signal.SIG_IGN)

    def restore(self) -> None:
        """Put back the handlers that were there before (tests run several trainings in one process; not after
        `hold_until_exit`), and let the stop-flag group go: `destroy_process_group` has shut it down, and its gloo
        threads are joined when the last reference goes, here rather than at interpreter shutdown
        (commands.end_processes says why that matters)."""
        if not self._holding:
            for number, previous in self._previous.items():
                signal.signal(number, previous)
        self._group = None


def stop_with_the_launcher() -> None:
    """Under torchrun (whose workers have TORCHELASTIC_RUN_ID), ask Linux to send this process SIGTERM when its
    launcher dies (prctl PR_SET_PDEATHSIG), a stop like any other: a node's torchrun killed alone (kill -9, the
    out-of-memory killer) left its workers training on as orphans with the other nodes' to the end, while the
    other agents waited 300 s at torchrun's exit barrier for it (its timeout, which torchrun's command line does
    not set) and ended with 0. Now every rank stops after the next step, with a checkpoint, the other agents end
    at once (their workers' 75 is a failure: no exit barrier), and the requeue resumes it. Elsewhere: nothing."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes

    launcher = os.getppid()
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != launcher:  # it died before the request: the signal would never come
        os.kill(os.getpid(), signal.SIGTERM)


def record_stopped_status() -> None:
    """Write STOPPED_STATUS into the file that $STOPPED_STATUS_FILE names, when it is set. A launcher that does not
    pass its workers' status on (torchrun ends with 1 when they end with 75) is followed by a wrapper that reads it
    there: docs/slurm/torchrun.sh, whose 75 then requeues the job. Every process of the node writes it alike."""
    path = os.environ.get(STATUS_FILE_VARIABLE)
    if path:
        write_text_atomic(path, f"{STOPPED_STATUS}\n")


def stop_flag_group():
    """A gloo group of every process (collective: every rank creates it at the same point), checked to connect.

    gloo binds the address this host's name resolves to (127.0.1.1 on stock Debian and Ubuntu, which other nodes
    cannot reach), and a group that cannot connect would wait 30 minutes: it waits CONNECT_TIMEOUT, then one line."""
    try:
        group = dist.new_group(backend="gloo", timeout=CONNECT_TIMEOUT)
        dist.all_reduce(torch.zeros(1), group=group)  # every pair of processes has connected
    except (RuntimeError, dist.DistError) as error:
        detail = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        raise GroupConnectError(
            f"the processes of this run cannot connect over gloo within {CONNECT_TIMEOUT.seconds} s ({detail}); "
            f"on several nodes set GLOO_SOCKET_IFNAME to the network interface the nodes reach each other by "
            f"(e.g. GLOO_SOCKET_IFNAME=eth0; `ip -br addr` lists them)"
        ) from None
    group.set_timeout(OPERATION_TIMEOUT)  # a rank may reach the flag's all-reduce late (another one checkpoints)
    return group

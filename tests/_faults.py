"""Fault injection for the tests: signals at chosen training steps, and output files that fail like a full or
read-only disk.

In a test process:

    signal_at_step(monkeypatch, step=3, signals=("SIGTERM",))      # train.main(...) is signalled after step 3
    failing_writes(monkeypatch, errno.ENOSPC, after_bytes=1000)    # every write past the 1000th byte fails

Under torchrun (or any launcher) the same signals come from this file used as the script:

    FAULT_SIGNAL="7:1:SIGUSR1:self" torchrun ... tests/_faults.py --config ...   # rank 1 signals itself after step 7

FAULT_SIGNAL is "step:rank:SIGNAL[+SIGNAL...]:self|parent" (rank * for every rank; parent: the launcher); a number
among the signals is a pause in seconds ("SIGINT+2.5+SIGINT": a second Ctrl-C 2.5 s after the first).
FAULT_AT_EXIT="SIGNAL[+SIGNAL...]" makes the process send itself those signals as it exits, from its last atexit
handler: what a scheduler's repeated signals meet when they come while the process shuts down.
"""

from __future__ import annotations

import errno as errno_codes
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def signal_at_step(
    monkeypatch, step: int, signals: Sequence[str], rank: int | None = None, target: str = "self"
) -> None:
    """Make the trainer of `rank` (None: every rank) send `signals` (names, one after the other; a number is a
    pause of that many seconds) to itself or to its parent process as soon as optimiser step `step` is done."""
    import time

    import training.loop

    real_train_step = training.loop.Trainer.train_step

    def train_step(trainer, stream):
        result = real_train_step(trainer, stream)
        if trainer.state.step == step and rank in (None, trainer.accelerator.process_index):
            pid = os.getppid() if target == "parent" else os.getpid()
            for name in signals:
                if name[0].isdigit():
                    time.sleep(float(name))
                else:
                    os.kill(pid, getattr(signal, name))
        return result

    monkeypatch.setattr(training.loop.Trainer, "train_step", train_step)


class WriteBudget:
    """What `failing_writes` lets through: `after_bytes` bytes in all, then every write fails with `errno`."""

    def __init__(self, error: int, after_bytes: int) -> None:
        self.error, self.left = error, after_bytes
        self.failures: list[Path] = []
        self.charged: set[Path] = set()  # files of a folder already charged when they were renamed into it

    def spend(self, temporary: Path, target: Path) -> None:
        """Charge the files under `temporary` (a file or a folder tree); past the budget the file that crosses
        it is cut at the budget's last byte, as a full disk leaves it, and the write fails."""
        files = sorted(temporary.rglob("*")) if temporary.is_dir() else [temporary]
        for file in files:
            if not file.is_file() or file in self.charged:
                continue
            size = file.stat().st_size
            if self.error == errno_codes.EROFS or size > self.left:
                if self.error != errno_codes.EROFS:
                    os.truncate(file, self.left)
                self.left = 0
                self.failures.append(target)
                raise OSError(self.error, os.strerror(self.error), str(file))
            self.left -= size
            self.charged.add(target / file.relative_to(temporary) if temporary.is_dir() else target)


def failing_writes(monkeypatch, error: int, after_bytes: int = 0) -> WriteBudget:
    """Make every write through atomic_files (files, folders and the writability probe) count against a budget
    of `after_bytes` bytes, and fail with OSError(`error`) once it is spent (EROFS: at once). The bytes are
    counted when a temporary file or folder is complete, just before it would be renamed into place, so
    the failing write leaves what a real one would: a partial temporary file beside the target."""
    import atomic_files

    budget = WriteBudget(error, after_bytes)
    real_commit = atomic_files.commit

    def commit(temporary: Path, target: Path) -> None:
        budget.spend(Path(temporary), Path(target))
        real_commit(temporary, target)

    monkeypatch.setattr(atomic_files, "commit", commit)
    return budget


class _Patch:
    """The bit of pytest's monkeypatch that signal_at_step needs, for a script run without pytest."""

    @staticmethod
    def setattr(owner, name, value) -> None:
        setattr(owner, name, value)


def signal_at_exit(names: Sequence[str]) -> None:
    """Send this process `names` (signals, or pauses in seconds) from its last atexit handler."""
    import atexit
    import time

    def send() -> None:
        for name in names:
            if name[0].isdigit():
                time.sleep(float(name))
            else:
                os.kill(os.getpid(), getattr(signal, name))
        time.sleep(0.1)  # a signal is handled between two bytecodes: let it be, before the interpreter goes on

    atexit.register(send)  # registered first: runs last


def main() -> None:
    """Run train.py with the signals described by FAULT_SIGNAL and FAULT_AT_EXIT (see the module docstring)."""
    sys.path.insert(0, str(ROOT))
    if os.environ.get("FAULT_AT_EXIT"):
        signal_at_exit(os.environ["FAULT_AT_EXIT"].split("+"))
    step, rank, names, target = os.environ["FAULT_SIGNAL"].split(":")
    signal_at_step(_Patch, int(step), names.split("+"), None if rank == "*" else int(rank), target)
    import train

    train.command()


if __name__ == "__main__":
    main()

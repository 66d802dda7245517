"""How this project's commands answer a user error: one line `error: ...` on stderr and exit status 2.

This module is the ground floor of the project: it imports nothing of it, so every package (fid and
atomic_files included) may import it. Every command (train.py, sample.py, demo.py, `python -m fid`,
`python -m training.latents`, ...) ends with

    if __name__ == "__main__":
        run_command(main)

Run from a command line, `run_command` also sets the CPU allocator for the numerical work (`keep_freed_memory`)
and marks the process as a command process (`is_command_process`): one that ends with the command.
A user error is a bad argument, a bad config value, or a missing or damaged file: an exception derived from
`UserError` (the one idiom: never `SystemExit("message")`, which tests/test_commands.py refuses anywhere in the
project). Each package and command derives its own (ConfigError, ExportError, fid's InputError, sample.py's
SampleError, ...), whose message names the file, key or value, so a new error type is recognised by deriving from
the base, never by a list to keep in step; CommandParser's complaints are UserErrors too.
Anything else is a bug and keeps its traceback; `--debug` keeps the traceback of a user error too.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from accelerate import Accelerator

USER_ERROR_STATUS = 2  # as argparse exits on a bad argument
DEBUG_FLAG = "--debug"
_command_process = False  # set by run_command for the process's own command line


class UserError(ValueError):
    """A user's mistake (bad argument, config value or input file), described in one line that names it.

    The base of every user-facing error of the project. It is a ValueError, so callers that catch those keep
    working."""


class LaunchError(UserError):
    """A launch that cannot work, which every process of it finds alike (several processes where Accelerate sees
    one, or one where several were asked for): only rank 0 prints the line, the other processes exit with the
    same status silently, so that the launcher's merged output holds it once."""


def check_launched_processes(processes_seen: int, script: str, cpu_option: str) -> None:
    """Refuse a launch whose process count Accelerate does not see, where each process would do all the work alone
    or one would do what several were asked for:

    - several processes (WORLD_SIZE) of which Accelerate sees one, as on a machine without GPUs when the command
      was not told to use the CPU;
    - several tasks of one `srun` step (SLURM_STEP_NUM_TASKS) that were not told of each other (no WORLD_SIZE:
      started without docs/slurm/task.sh or a launcher), each of which would run alone;
    - `accelerate launch --cpu --num_processes N`, which runs Accelerate's single-process launcher: the one
      process it starts is told nothing of the N it was asked for, so its parent's command line is read.

    `script` and `cpu_option` ("train.py", "train.cpu=true"; "sample.py", "--cpu") make the line say what works."""
    if processes_seen > 1:
        return  # Accelerate sees several processes: the launch is what it looks like
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1:
        raise LaunchError(
            f"launched {launched} processes but Accelerate sees one: on a machine without GPUs add {cpu_option}"
        )
    tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS", "1"))  # set in srun's tasks (not in the batch script)
    if tasks > 1 and "WORLD_SIZE" not in os.environ:
        raise LaunchError(
            f"srun started {tasks} tasks that do not know of each other (each would do all the work alone): start "
            f"them through docs/slurm/task.sh (`srun docs/slurm/task.sh python {script} ...`), or start one task"
        )
    asked = accelerate_launch_processes()
    if asked > 1:
        raise LaunchError(
            f"accelerate launch --num_processes {asked} started one process (with --cpu, Accelerate uses its "
            f"single-process launcher); for {asked} CPU processes run `torchrun --nproc_per_node {asked} "
            f"{script} ... {cpu_option}`"
        )


def check_device(device: str, option: str = "--device") -> None:
    """Refuse a torch device that this machine does not have, in one line naming `option` (cuda without a GPU,
    cuda:3 with two, a name torch does not know), before a command loads anything onto it. Imports torch (only
    commands given a device call it)."""
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError) as error:
        raise UserError(f"{option} {device}: not a torch device ({str(error).splitlines()[0]})") from None
    if parsed.type == "cpu":
        return
    backend = getattr(torch, parsed.type, None)
    count = backend.device_count() if hasattr(backend, "device_count") else 0
    if count == 0:
        raise UserError(f"{option} {device}: this machine has no {parsed.type} device; use cpu, or leave {option} out")
    if parsed.index is not None and parsed.index >= count:
        raise UserError(f"{option} {device}: this machine has {count} {parsed.type} device(s), 0 to {count - 1}")


def accelerate_launch_processes() -> int:
    """The --num_processes of the `accelerate launch` command that started this process (its parent), else 1.
    Read from the parent's command line (Linux /proc) with Accelerate's own launch parser."""
    try:
        argv = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:  # not Linux, or the parent is gone
        return 1
    starts = [
        index for index, token in enumerate(argv) if token == "launch" or token.endswith("accelerate.commands.launch")
    ]
    if not starts or not any(Path(token).name.startswith("accelerate") for token in argv[: starts[0] + 1]):
        return 1
    from accelerate.commands.launch import launch_command_parser

    try:
        options, _ = launch_command_parser().parse_known_args(argv[starts[0] + 1 :])
    except SystemExit:  # a command line that is not accelerate's after all
        return 1
    return options.num_processes or 1


def is_command_process() -> bool:
    """True in a process that runs a command from its own command line (`run_command` without argv), which ends
    when the command ends: process-wide settings are then the command's to keep until the end (training.stop_signals:
    signals after a stop's checkpoint). False where a command's `main` runs inside a test or a notebook."""
    return _command_process


def end_processes(accelerator: Accelerator) -> None:
    """End this process's part of a launch: Accelerate's `end_training` (trackers, then every process group), with
    the groups freed here and their gloo worker threads joined here.

    `destroy_process_group` unregisters a group; its C++ object, and the worker threads it joins, go with the last
    reference. A group still held outlives the script, and a worker that drops the tensors of the last collective
    once the interpreter has begun to shut down cannot take the GIL: Python ends the thread inside a noexcept frame
    and std::terminate aborts the finished process ("terminate called without an active exception", exit 134).
    torch.distributed.nn.functional holds the default group when imported after it began (its `group=group.WORLD`
    defaults are evaluated at import; torchvision imports it through torch._dynamo): they become None, the default
    group, as when it is imported first. A DistributedDataParallel model holds its group too: callers drop theirs
    before the interpreter exits (a function's locals go when it returns)."""
    functional = sys.modules.get("torch.distributed.nn.functional")
    if functional is not None:
        from torch.distributed import ProcessGroup

        for function in vars(functional).values():  # group=<the group at import time> -> None, the default group
            defaults = getattr(function, "__defaults__", None)
            if defaults and any(isinstance(value, ProcessGroup) for value in defaults):
                function.__defaults__ = tuple(None if isinstance(value, ProcessGroup) else value for value in defaults)
    accelerator.end_training()


# glibc's malloc serves blocks of 128 KiB or more by mmap and unmaps them on free, so every Inception batch (and any
# CPU network step) faults its activations in again. The Makefile's MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1e11
# keep freed memory in the process (Inception 1.5x faster on an idle 2-core CPU, measured when it was added); a
# command sets the same from Python at start-up, unless the environment sets either (docs/evaluation.md).
ALLOCATOR_SETTINGS = {"MALLOC_MMAP_MAX_": (-4, 0), "MALLOC_TRIM_THRESHOLD_": (-1, 100_000_000_000)}  # mallopt


def keep_freed_memory() -> bool:
    """Set glibc's allocator to keep freed memory (mallopt M_MMAP_MAX=0, M_TRIM_THRESHOLD=1e11) unless the
    environment sets either variable; True when set here. Elsewhere (no glibc, another libc) nothing is done."""
    if platform.libc_ver()[0] != "glibc" or any(name in os.environ for name in ALLOCATOR_SETTINGS):
        return False
    import ctypes

    mallopt = ctypes.CDLL(None).mallopt
    return all(mallopt(parameter, value) == 1 for parameter, value in ALLOCATOR_SETTINGS.values())


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage block) and which accepts `--debug`."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(**kwargs)
        self.add_argument(DEBUG_FLAG, action="store_true", help="show the traceback of a user error too")

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message} (see {self.prog} --help)")


def run_command(main: Callable[[Sequence[str] | None], Any], argv: Sequence[str] | None = None) -> None:
    """Run `main(argv)` (argv: sys.argv[1:] by default); a user error becomes one line on stderr and exit 2."""
    if argv is None:  # the process's own command line: a command process, whose allocator is ours to set
        global _command_process
        _command_process = True
        keep_freed_memory()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        main(argv)
    except UserError as error:
        if isinstance(error, LaunchError) and launch_rank() != "0" and DEBUG_FLAG not in argv:
            raise SystemExit(USER_ERROR_STATUS) from None  # rank 0 says it
        _fail(str(error), error, debug=DEBUG_FLAG in argv)


def launch_rank() -> str:
    """This process's rank in its launch: torch's RANK, else (tasks of an srun step) Slurm's SLURM_PROCID."""
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))


def _fail(message: str, error: BaseException, debug: bool) -> NoReturn:
    if debug:
        raise error
    print(f"error: {_unwrapped(message)}", file=sys.stderr)
    raise SystemExit(USER_ERROR_STATUS) from None


LOADER_WORKER_PREFIX = "Caught "  # torch's DataLoader raises a worker's error again as "Caught E in DataLoader
LOADER_WORKER_TRACEBACK = "\nOriginal Traceback"  # worker process 0.\nOriginal Traceback ...\nmodule.E: message"


def _unwrapped(message: str) -> str:
    """The error's own line when torch's DataLoader wrapped a worker's user error (a corrupt image, a damaged
    latent shard) in the worker's traceback; any other message unchanged."""
    if not (message.startswith(LOADER_WORKER_PREFIX) and LOADER_WORKER_TRACEBACK in message):
        return message
    last = message.rstrip().splitlines()[-1]  # "training.data.LatentShardError: latent shard ..."
    return last.partition(": ")[2] or last

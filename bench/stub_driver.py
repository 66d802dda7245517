"""Triton's own launch path on a machine without a GPU: a stand-in for the CUDA driver that launches nothing.

`use_stub_driver()` builds bench/stub_libcuda.c into a libcuda.so.1 whose every call succeeds at once, loads it, and
makes Triton's active driver a CudaDriver that names an sm_90 device (132 multiprocessors), device 0 and stream 0.
A kernel launched on CPU tensors then goes the way it goes on a GPU: the JIT's binding and specialisation of the
arguments, its cache lookup (the first launch of a specialisation compiles it for sm_90 with Triton's own ptxas,
cached on disk by Triton), the autotuner's choice (its benchmarker times nothing: an autotuned kernel keeps its
first configuration) and Triton's C launcher, which reads every argument, tensor pointers included, and calls
cuLaunchKernelEx, which returns at once. So a launch's host time is all there but the driver's own share of it
(a few microseconds per launch on a GPU, which the GPU runbook's host-time rows include).

Needs a C compiler (Triton builds its own launcher with one too) and TRITON_INTERPRET unset when triton is imported
(its interpreter replaces the JIT at decoration time). The tensors stay on the CPU: nothing reads what a kernel was
to write. The stub stays the active driver for the rest of the process: Triton makes its real driver anew only
where one is active, which is why the stub is needed.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "stub_libcuda.c"
CAPABILITY = (9, 0)  # what the stub's device reports, as bench/stub_libcuda.c says
BUILD_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dit-vca" / "stub-libcuda"


def build_stub() -> Path:
    """The folder holding libcuda.so.1 built from SOURCE against Triton's cuda.h (built once per source)."""
    import triton

    include = Path(triton.__file__).parent / "backends" / "nvidia" / "include"
    digest = hashlib.sha256(SOURCE.read_bytes() + str(include).encode()).hexdigest()[:16]
    folder = BUILD_CACHE / digest
    library = folder / "libcuda.so.1"
    if not library.exists():
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            raise RuntimeError("the stub CUDA driver needs a C compiler (cc or gcc on PATH, or CC)")
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f"libcuda.so.1.{os.getpid()}"
        command = [compiler, "-shared", "-fPIC", "-O2", "-Wl,-soname,libcuda.so.1", f"-I{include}", "-o",
                   str(partial), str(SOURCE)]  # fmt: skip
        subprocess.run(command, check=True, capture_output=True)
        partial.replace(library)
    return folder


def use_stub_driver() -> None:
    """Make the stub Triton's active driver for the rest of the process (see the module docstring)."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("the stub CUDA driver runs Triton's compiled launch path: unset TRITON_INTERPRET")
    folder = build_stub()
    ctypes.CDLL(str(folder / "libcuda.so.1"), mode=ctypes.RTLD_GLOBAL)  # found by its soname from here on
    os.environ["TRITON_LIBCUDA_PATH"] = str(folder)  # where Triton links its launcher module against it
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaDriver

    class StubDriver(CudaDriver):
        """The CUDA driver of Triton with torch's view of the device replaced by the stub's: device 0, stream 0."""

        def __init__(self) -> None:
            super().__init__()
            self.get_current_device = lambda: 0
            self.set_current_device = lambda device: None
            self.get_current_stream = lambda device=None: 0
            self.get_device_capability = lambda device=None: CAPABILITY

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", 10 * CAPABILITY[0] + CAPABILITY[1], 32)

        def get_benchmarker(self):
            def same_time(kernel_call, quantiles=None, **_):  # times nothing: every configuration ties
                return [1.0] * len(quantiles) if quantiles else 1.0

            return same_time

    triton.runtime.driver.set_active(StubDriver())

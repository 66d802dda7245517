"""Runs first in every pytest process: Triton's interpreter for the Triton kernels' tests where there is no GPU.

TRITON_INTERPRET is read when triton is first imported (its @triton.jit then builds interpreted functions), and
pytest imports every test module in one process, so it is set here, before any test module imports the
project. It changes nothing else the suite runs: triton is imported only by dit_vca.vca_triton (torch imports
it lazily, and on the CPU inductor generates C++, not Triton); the variable is read only by triton and by
inductor's Triton code paths, which need a GPU. With a GPU the kernels' tests run compiled, on it.
"""

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

"""A guard that keeps CUDA fp32 convolutions and matmuls in full precision."""

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def full_fp32_precision() -> Iterator[None]:
    """Disable TF32 inside the block: cuDNN uses it for fp32 convolutions by default (and training
    scripts often enable it for matmuls), while the TF reference evaluator computes in fp32."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved

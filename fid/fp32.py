"""A guard that keeps Inception in full fp32 precision, whatever the caller has enabled."""

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def full_fp32_precision() -> Iterator[None]:
    """Disable autocast (on every device type that has it) and TF32 inside the block. A training loop evaluates
    FID inside its autocast context (bf16 convolutions change pool_3 features by ~1e-2 relative); cuDNN uses
    TF32 for fp32 convolutions by default (and training scripts often enable it for matmuls); the TF reference
    evaluator computes in fp32."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with contextlib.ExitStack() as stack:
            for device_type in ("cpu", "cuda"):
                if torch.amp.is_autocast_available(device_type):
                    stack.enter_context(torch.autocast(device_type, enabled=False))
            yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved

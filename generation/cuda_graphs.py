"""Calls of a function of tensors replayed from CUDA graphs (`CapturedCalls`): what sampling's model calls and
training's step (train.cuda_graph) run through.

A small model's step on a GPU is the host's time: Python, the dispatcher and one launch per kernel while the GPU
waits (issue 46: ~1.5 ms per VCA layer forward on an H200 whatever the shape). A CUDA graph records the kernels of
one call once and replays them with one launch, so a replay costs the host a copy of the inputs and that launch.
What a graph fixes at capture: the shapes, dtypes and devices of the inputs, the autocast state, the memory the
call reads and writes (inputs are copied into static buffers, outputs come back as copies, which the next replay
cannot overwrite), the Python control flow (a branch taken at capture is taken at every replay), and no host read of
a device value may happen inside (a sync). Random numbers drawn on the device are drawn anew at every replay.

Off CUDA nothing is captured: the function runs on the same static buffers, eagerly, and gives the numbers a plain
call gives, bit for bit (tests/test_cuda_graphs.py); that is how the suite exercises the plumbing without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

WARMUP_CALLS = 3  # eager calls on a side stream before a capture (cuBLAS workspaces, autotuning, lazy state)


class CapturedCalls:
    """`function(*tensors)` through CUDA graphs, one per signature of its arguments (shapes, dtypes, devices, and
    whether autocast is on and in which dtype).

    `pure` (no side effect: a model's forward under no_grad): the first call of a signature runs the function
    WARMUP_CALLS times eagerly on a side stream, captures one call and replays it. Not pure (a training step:
    each call must happen exactly once): the first WARMUP_CALLS calls of a signature run eagerly on a side stream,
    the next one is captured and replayed, every later one replayed. Off CUDA, or with `capture` False, every call
    runs eagerly on the signature's static buffers."""

    def __init__(self, function: Callable[..., Any], *, pure: bool, capture: bool = True) -> None:
        self.function = function
        self.pure = pure
        self.capture = capture
        self._signatures: dict[tuple, _Signature] = {}

    @property
    def graphs(self) -> int:
        """How many signatures have a captured graph."""
        return sum(s.graph is not None for s in self._signatures.values())

    def __call__(self, *tensors: Tensor) -> Any:
        device = tensors[0].device
        key = (*((t.shape, t.dtype, t.device) for t in tensors), _autocast_state(device.type))
        signature = self._signatures.get(key)
        if signature is None:
            signature = self._signatures[key] = _Signature([torch.empty_like(t) for t in tensors])
        for static, value in zip(signature.inputs, tensors):
            static.copy_(value, non_blocking=True)
        if not (self.capture and device.type == "cuda"):
            return self.function(*signature.inputs)
        if signature.graph is None:
            if self.pure:
                for _ in range(WARMUP_CALLS):
                    _on_side_stream(self.function, signature.inputs)
            elif signature.eager_calls < WARMUP_CALLS:
                signature.eager_calls += 1
                return _copies(_on_side_stream(self.function, signature.inputs))
            signature.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(signature.graph):
                signature.outputs = self.function(*signature.inputs)
        signature.graph.replay()
        return _copies(signature.outputs)


class _Signature:
    """The static input buffers of one signature, its graph once captured and that graph's outputs."""

    def __init__(self, inputs: list[Tensor]) -> None:
        self.inputs = inputs
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: Any = None
        self.eager_calls = 0


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype | None]:
    if not torch.amp.is_autocast_available(device_type) or not torch.is_autocast_enabled(device_type):
        return (False, None)
    return (True, torch.get_autocast_dtype(device_type))


def _on_side_stream(function: Callable[..., Any], inputs: list[Tensor]) -> Any:
    """One eager call on a side stream, as warm-up calls before a capture must run (torch.cuda.graphs' notes)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        outputs = function(*inputs)
    torch.cuda.current_stream().wait_stream(stream)
    return outputs


def _copies(outputs: Any) -> Any:
    return tree_map(lambda t: t.clone() if isinstance(t, Tensor) else t, outputs)

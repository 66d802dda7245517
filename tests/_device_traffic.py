"""A guard that fails on hidden host<->device traffic: a copy from the CPU to another device, or a read of a
device tensor's value on the host (`.item()`, `float(t)`, `int(t)`, `bool(t)`, data-dependent shapes).

Used with the model and data on the `meta` device, which stands in for a GPU on a machine without one: meta
tensors have shapes but no data, so every tensor that a loop copies from the CPU shows up as a CPU -> meta
`_to_copy`/`copy_`, and every value read back shows up as `_local_scalar_dense` (or `nonzero`, `equal`,
`is_nonzero`) on a meta tensor. Both would be a transfer and a synchronisation on CUDA. A TorchDispatchMode
sees every aten call below autograd, so a regression anywhere in the loop (a schedule indexed on the CPU, a
`float(t)`) raises at the call that makes it, with the operator's name.
"""

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten
HOST_READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.equal.default, aten.is_nonzero.default}


class HostDeviceTraffic(AssertionError):
    """A loop copied a tensor from the CPU to a device, or read a device tensor's value on the host."""


class HostDeviceTrafficGuard(TorchDispatchMode):
    """Raises HostDeviceTraffic on a CPU -> device copy or a host read of a device tensor (see the module)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func in HOST_READS and any(t.device.type != "cpu" for t in tensors):
            raise HostDeviceTraffic(f"{func}: reads a {tensors[0].device} tensor on the host (a sync on CUDA)")
        if func is aten._to_copy.default:
            source, target = args[0], kwargs.get("device")
            if source.device.type == "cpu" and target is not None and torch.device(target).type != "cpu":
                raise HostDeviceTraffic(f"{func}: copies a CPU tensor {tuple(source.shape)} to {target}")
        if func is aten.copy_.default:
            target, source = args[0], args[1]
            if source.device.type == "cpu" and target.device.type != "cpu":
                raise HostDeviceTraffic(f"{func}: copies a CPU tensor {tuple(source.shape)} to {target.device}")
        return func(*args, **kwargs)

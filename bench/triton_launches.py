"""What VCA's Triton kernels are compiled for: every launch a VCA layer makes, found by running it, not listed.

`discover()` runs a small VCA layer forward and backward on the CPU with the Triton core for every precision
(bf16, fp16, fp32 with TF32, fp32 IEEE), head dimension and switch combination, on each of the core's paths
(`GEOMETRIES`: per head, split with a head's contrast tokens in one block, split with several). The kernel module's
public functions (the core's entry points) run on fake CUDA tensors (torch's FakeTensorMode: shapes and dtypes, no data,
no GPU) and every kernel launch is recorded instead of run: the kernel, its arguments (tensor dtypes, integers,
constexprs) and its autotuning configurations. Launches with equal arguments are one compile spec, whichever case
made them. Nothing here names a kernel: a kernel added, renamed or launched differently shows up by itself.

It must run where Triton compiles (TRITON_INTERPRET unset: the launchers then pick the GPU's block sizes and
precisions) and where no GPU is visible (every declared configuration, none left out by the compile table):
bench.triton_compile runs it in such a subprocess (`python -m bench.triton_launches OUT.json`).

Triton's JIT specialises an integer argument only on whether it is 1, divisible by 16, or wider than 32 bits, so a
spec keeps that class, not the value (`INTEGER_CLASSES`); at the geometries' shapes (N = 256 tokens and n = 64
contrast tokens, or N = 1024 and n = 256; 2 heads) the sizes fall in the classes of a DiT at 256 and 512 px (N, n
and the rows of the streams divisible by 16, d = 72 not). A float argument compiles as fp32 whatever its value, so
its value is not part of a spec either.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import itertools
import json
import sys
import types
from pathlib import Path

import torch

KERNEL_MODULE = "dit_vca.vca_triton"
PLAN_MODULE = "dit_vca.vca_triton_plan"  # its per_head_fits is forced per geometry
PRECISIONS = {  # name: (dtype the core computes in, torch.backends.cuda.matmul.allow_tf32)
    "bf16": (torch.bfloat16, False),
    "fp16": (torch.float16, False),
    "tf32": (torch.float32, True),
    "ieee": (torch.float32, False),
}
HEAD_DIMS = (64, 72, 128)  # DiT-S/B/L and SiT's, DiT-XL's, and one larger
SWITCHES = ("joint_softmax", "stage1_differential", "stage2_differential", "pooled_content")
RELEASED = (True, True, True, True)  # VCAOptions' defaults: the released code, what the configs train
# The classes Triton's JIT tells integers apart by, each with the value that stands in for it at compilation.
INTEGER_CLASSES = {"one": 1, "multiple of 16": 16, "i32": 17, "i64": 2**40 + 1}
# The shapes the layer runs at, one per path of the core (dit_vca.vca_triton_plan), forced: the per-head kernels;
# the split kernels with a head's contrast tokens in one block (n = 64), and in several (n = 256).
GEOMETRIES = {
    "per-head": {"batch": 1, "heads": 2, "grid": 16, "contrast_grid": 8, "path": "per_head"},
    "split": {"batch": 1, "heads": 2, "grid": 16, "contrast_grid": 8, "path": "split"},
    "split-blocks": {"batch": 1, "heads": 2, "grid": 32, "contrast_grid": 16, "path": "split"},
}
# The exit status of a compile worker that found a kernel's source_hash changed since its launches were recorded
# (bench.triton_worker compiles nothing then); here, so that bench.triton_compile needs no compiler import to read it.
STALE_SOURCE = 3


def kernel_function(kernel) -> types.FunctionType:
    """The Python function under a Triton kernel object (an autotuner, a JIT or an interpreted function)."""
    while not isinstance(kernel, types.FunctionType):
        kernel = kernel.fn
    return kernel


def _is_triton_function(value) -> bool:
    from triton.runtime.jit import KernelInterface

    return isinstance(value, KernelInterface)


def _referenced_globals(function: types.FunctionType) -> dict[str, object]:
    """The module-level objects a function's code names (nested code objects included)."""
    names, codes = set(), [function.__code__]
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return {name: function.__globals__[name] for name in sorted(names) if name in function.__globals__}


def source_hash(kernel) -> str:
    """sha256 over a kernel's source, the sources of the @triton.jit functions it calls (transitively) and the
    plain values (numbers, strings) of the globals it reads: what decides how it compiles, besides its arguments."""
    digest, seen, pending = hashlib.sha256(), set(), [kernel_function(kernel)]
    while pending:
        function = pending.pop()
        if function.__qualname__ in seen:
            continue
        seen.add(function.__qualname__)
        digest.update(inspect.getsource(function).encode())
        for name, value in _referenced_globals(function).items():
            if _is_triton_function(value):
                pending.append(kernel_function(value))
            elif isinstance(value, (bool, int, float, str)):
                digest.update(f"{name}={value!r}".encode())
    return digest.hexdigest()[:16]


def integer_class(value: int) -> str:
    if value == 1:
        return "one"
    if not -(2**31) <= value < 2**31:
        return "i64"
    return "multiple of 16" if value % 16 == 0 else "i32"


def _describe_argument(value, constexpr: bool) -> list:
    """A launch argument as JSON: ["tensor", dtype], ["int", class] (INTEGER_CLASSES), ["float"] (any value compiles
    alike), or ["value", value] (constexprs; bools, None, strings)."""
    if isinstance(value, torch.Tensor):
        return ["tensor", str(value.dtype).removeprefix("torch.")]
    if constexpr or value is None or isinstance(value, (bool, str)):
        return ["value", value]
    if isinstance(value, int):
        return ["int", integer_class(value)]
    if isinstance(value, float):
        return ["float"]
    raise TypeError(f"a kernel argument of type {type(value).__name__} is not described: extend _describe_argument")


def _describe_launch(kernel, args: tuple, kwargs: dict) -> dict:
    """A launch as a compile spec: the kernel, its arguments by parameter name, and its configurations (each block
    sizes and launch options: an autotuner's list, or the launch's own options)."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    jit = kernel.fn if isinstance(kernel, Autotuner) else kernel
    if not isinstance(jit, JITFunction):
        raise TypeError(f"{type(kernel).__name__} around {kernel_function(kernel).__name__}: extend _describe_launch")
    parameters = [p.name for p in jit.params]
    constexprs = {p.name for p in jit.params if p.is_constexpr}
    options = {k: v for k, v in kwargs.items() if k not in parameters}
    bound = inspect.signature(jit.fn).bind_partial(*args, **{k: v for k, v in kwargs.items() if k in parameters})
    if isinstance(kernel, Autotuner):
        configs = [
            {"params": dict(c.kwargs), "num_warps": c.num_warps, "num_stages": c.num_stages} for c in kernel.configs
        ]
    else:
        configs = [{"params": {}, "num_warps": options.get("num_warps"), "num_stages": options.get("num_stages")}]
    name = jit.fn.__name__
    return {
        "kernel": f"{jit.fn.__module__}:{name}",
        "name": name,
        "source": source_hash(jit),
        "args": {k: _describe_argument(v, k in constexprs) for k, v in bound.arguments.items()},
        "configs": configs,
    }


def _on_fake_cuda(function):
    """`function` run on fake CUDA copies of its tensor arguments; tensors it returns come back as CPU zeros."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.utils._pytree import tree_leaves, tree_map

    @functools.wraps(function)
    def run(*args, **kwargs):
        if any(isinstance(t, FakeTensor) for t in tree_leaves((args, kwargs))):  # called by another entry point
            return function(*args, **kwargs)

        def to_fake(t):
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda") if torch.is_tensor(t) else t

        with FakeTensorMode():
            result = function(*tree_map(to_fake, args), **tree_map(to_fake, kwargs))
        return tree_map(lambda t: torch.zeros(t.shape, dtype=t.dtype) if torch.is_tensor(t) else t, result)

    return run


def cases(all_switches: bool) -> list[tuple[str, int, tuple[bool, ...], str]]:
    """(precision, head dim, switches, geometry) for discover() to run: the released switches, or every
    combination."""
    switch_sets = itertools.product((True, False), repeat=len(SWITCHES)) if all_switches else [RELEASED]
    return list(itertools.product(PRECISIONS, HEAD_DIMS, switch_sets, GEOMETRIES))


def discover(all_switches: bool = False) -> dict:
    """{"kernels": {name: source hash} of every kernel launched, "specs": [spec with "cases": [[precision, d,
    switches, geometry], ...]], "geometries", "switches"}. Runs the layer; must run with TRITON_INTERPRET unset and
    no GPU visible (see the module's docstring)."""
    from triton.runtime.jit import KernelInterface

    from dit_vca.attention import VCAOptions, VisualContrastAttention

    module = importlib.import_module(KERNEL_MODULE)
    plan = importlib.import_module(PLAN_MODULE)
    per_head_fits = plan.per_head_fits
    specs: dict[str, dict] = {}
    launched: list[dict] = []

    def record(kernel, grid):
        return lambda *args, **kwargs: launched.append(_describe_launch(kernel, args, kwargs))

    entry_points = {
        name: value
        for name, value in vars(module).items()
        if inspect.isfunction(value) and value.__module__ == module.__name__ and not name.startswith("_")
    }
    original_getitem = KernelInterface.__getitem__
    KernelInterface.__getitem__ = record
    for name, value in entry_points.items():
        setattr(module, name, _on_fake_cuda(value))
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        for precision, head_dim, switches, geometry in cases(all_switches):
            shape = GEOMETRIES[geometry]
            tokens = shape["grid"] ** 2
            plan.per_head_fits = lambda _, path=shape["path"]: path == "per_head"
            dtype, torch.backends.cuda.matmul.allow_tf32 = PRECISIONS[precision]
            torch.manual_seed(0)
            width = shape["heads"] * head_dim
            layer = VisualContrastAttention(
                width, shape["heads"], shape["grid"], 1, VCAOptions(shape["contrast_grid"], *switches)
            )
            layer.kernel = "triton"
            x = torch.randn(shape["batch"], tokens, width, requires_grad=True)
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                layer(x).float().sum().backward()
            for launch in launched:
                identity = {k: launch[k] for k in ("kernel", "source", "args")}  # what a compilation depends on
                key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
                spec = specs.setdefault(key, {"id": key, **launch, "cases": []})
                case = [precision, head_dim, list(switches), geometry]
                if case not in spec["cases"]:
                    spec["cases"].append(case)
            launched.clear()
    finally:
        KernelInterface.__getitem__ = original_getitem
        plan.per_head_fits = per_head_fits
        for name, value in entry_points.items():
            setattr(module, name, value)
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    kernels = {spec["name"]: spec["source"] for spec in specs.values()}
    switches = "all" if all_switches else "released"
    return {"kernels": kernels, "geometries": GEOMETRIES, "switches": switches, "specs": list(specs.values())}


if __name__ == "__main__":  # python -m bench.triton_launches OUT.json [--all-switches] (what bench.triton_compile runs)
    Path(sys.argv[1]).write_text(json.dumps(discover(all_switches="--all-switches" in sys.argv[2:])))

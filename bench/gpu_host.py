"""The third GPU runbook (issue 46): host time, CUDA graphs and the lean host path, in one command of at most 420 s.

    python3 -m bench.gpu_host --out "$OUT"             # on the GPU machine, from the repository root
    python3 -m bench.gpu_host --rehearse --out /tmp/g  # the same code on the CPU at tiny sizes (the suite runs it)

Rows and summary as bench.gpu writes them (<out>/gpu-host-<device>-<time>.jsonl, <out>/gpu-host-<device>.md), each
part in its own process under its budget, the slowest last:
1. `kernels`, `kernels-old`: the CUDA time of each kernel of one VCA layer at DiT-XL/2's width (C = 1152, 16 heads,
   n = 64), bf16, forward + backward, at N = 256 × 64 images and N = 16384 × 1 (torch.profiler), and their sum:
   the Triton kernels of issue 46, then those of issue 37, which `kernels-old` installs in its own process
   (bench.kernels_before_46; each row names the kernels it launched). The first compiles the kernels for d = 72 in
   bf16, which the next two parts take from Triton's cache.
2. `host`: one small layer (bench.host_time's: C = 144, d = 72, 64 tokens, n = 16, batch 2): thread CPU time per call
   of MHSA, VCA on ATen and VCA on Triton, forward and forward + backward, bf16 autocast (issue 46's goal: VCA ≤ 2x
   MHSA); and the CUDA launches (kernels, copies, fills) of one forward + backward, against MHSA's and issue 46's
   bound of 36.
3. `graphs`: the XL layer at N = 256 × 64 and the small layer, forward + backward, MHSA and VCA: wall time per step
   eagerly and as one CUDA graph replay (generation.cuda_graphs).
4. `conv`: the depthwise 3×3 convolution of v alone at the XL layer's shape (64, 1152, 16, 16), channels-last bf16:
   forward, backward (both gradients) and a copy of the same tensor, with the bandwidth each implies.
5. `sample`: DiT-S/2 DDIM-50, batch 32, bf16, MHSA and VCA, eager and graphed (ImageGenerator's cuda_graphs: one
   capture per model-evaluation shape).
6. `train-256`, `train-512`: DiT-XL/2's training step (bench.gpu_training) in bf16 at 256 px, batch 32, and 512 px,
   batch 8 (the same tokens per batch), MHSA and VCA: eager, graphed (train.cuda_graph's capture) and compiled per
   block (Inductor compiles one block for all 28; the whole model's compile, 80-110 s each on the H200 of
   2026-12-04, does not fit in this runbook: bench.gpu's compiled rows are those).
Budgets from the first run (bench/results/gpu-cuda.md, H200, 2026-12-04): a process start with torch and the
versions row ~20 s; the Triton core's compilations for one dtype and head dim ~30 s (every autotuning
configuration), then from Triton's cache; a DiT-XL/2 step 0.1 s (256 px, batch 32) and a DDIM-50 run of DiT-S/2
under 1.3 s; compiling a model is what the budgets leave room for.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bench._harness import synchronize
from bench.gpu import CONTRAST_GRID, XL_WIDTH, Runbook, main
from bench.gpu_training import LARGE_MODEL, TrainingCase, measure_training

HOST_RUNBOOK_SECONDS = 420  # the window: one call of the device tool, with time to spare for a rerun
LAUNCH_BOUND = 36  # issue 46: launches of one VCA layer's forward + backward under bf16 autocast


@dataclass(frozen=True)
class Sizes:
    """The sizes of this runbook: on the GPU, or in the rehearsal (tiny, on the CPU)."""

    host_seconds: float  # timed calls per host-time row, the slowest subject's
    host_rounds: int  # at least, per host-time row
    width: tuple[int, int]  # (C, heads) of the layer rows of parts 2 and 3
    contrast_grid: int
    kernel_shapes: tuple[tuple[int, int], ...]  # (batch, N) of part 2
    graph_shape: tuple[int, int]  # (batch, N) of part 3's large layer
    repeats: int  # timed steps per row of parts 2-4
    conv_shape: tuple[int, int, int]  # (batch, C, H) of part 4
    sample_model: str
    sample_batch: int
    sample_steps: int
    sample_latent_side: int
    sample_depth: int | None
    train_model: str
    train_sizes: dict[str, int] | None
    train_batches: dict[int, int]  # image size (px) -> batch
    train_image_sizes: dict[int, int]  # the part's image size (px) -> what is trained (the rehearsal's smaller)
    train_warmup: int
    train_steps: int
    compile_backend: str
    precision: str = "bf16"
    threads: int | None = None


# ----------------------------------------------------------------------------------------------------------------
# Part 1: the small layer's host time and launches
# ----------------------------------------------------------------------------------------------------------------


def host_rows(sizes: Sizes, device: torch.device) -> Iterator[dict]:
    from bench.host_time import LAYER, Settings, layer, layer_rows, subjects

    settings = Settings(sizes.host_seconds, sizes.host_rounds, 5000, False, model_precisions=(), compile_backend="")
    for row in layer_rows(device, settings, ("bf16",)):  # fp32 would check and compile the Triton core anew
        yield {**row, "case": "host-layer"}
    launches = {}
    for name, kernel in subjects(device).items():
        module = layer(kernel, device)
        x = torch.randn(LAYER["batch"], LAYER["grid"] ** 2, LAYER["width"], device=device, requires_grad=True)
        launches[name] = device_launches(lambda module=module, x=x: _forward_backward(module, x), device)
    launched = None if None in launches.values() else launches  # None off CUDA: there is no device work to count
    yield {"case": "launches", "precision": "bf16", "launches": launched, "bound": LAUNCH_BOUND}


def _forward_backward(module: torch.nn.Module, x: torch.Tensor) -> None:
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        out = module(x)
    out.float().sum().backward()


def device_launches(step: Callable[[], None], device: torch.device) -> dict[str, int] | None:
    """The device work of one call of `step` after two untimed ones: kernels, copies and fills launched on the GPU,
    by name (torch.profiler's CUDA activity); None off CUDA."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        step()
    synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        synchronize(device)
    return dict(Counter(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA))


# ----------------------------------------------------------------------------------------------------------------
# Part 2: per-kernel CUDA times, the kernels of issue 46 and of issue 37
# ----------------------------------------------------------------------------------------------------------------


def kernel_rows(sizes: Sizes, device: torch.device, old: bool = False) -> Iterator[dict]:
    if old:  # this part's process only: VCA's core runs the kernels before issue 46 from here on
        from bench import kernels_before_46

        kernels_before_46.install()
    from torch.profiler import ProfilerActivity, profile

    width, heads = sizes.width
    for batch, tokens in sizes.kernel_shapes:
        module = _vca_layer(width, heads, tokens, sizes.contrast_grid, "triton", device)
        x = torch.randn(batch, tokens, width, device=device, requires_grad=True)
        step = lambda module=module, x=x: _forward_backward(module, x)  # noqa: E731
        for _ in range(2):  # the first compiles and autotunes
            step()
        synchronize(device)
        activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
        with profile(activities=activities) as prof:
            for _ in range(sizes.repeats):
                step()
            synchronize(device)
        times, counts = Counter(), Counter()
        for event in prof.events():
            if device.type == "cuda" and event.device_type == torch.autograd.DeviceType.CUDA:
                times[event.name] += event.device_time / sizes.repeats
                counts[event.name] += 1
        yield {"case": "kernels", "kernels": "issue 37" if old else "issue 46", "tokens": tokens, "batch": batch,
               "width": width, "heads": heads, "per_kernel_us": dict(times),
               "launches": {name: count // sizes.repeats for name, count in counts.items()},
               "total_us": sum(times.values())}  # fmt: skip
        del module, x


def _vca_layer(width: int, heads: int, tokens: int, contrast_grid: int, kernel: str, device: torch.device):
    from dit_vca.attention import VCAOptions, VisualContrastAttention

    torch.manual_seed(0)
    module = VisualContrastAttention(width, heads, math.isqrt(tokens), 3, VCAOptions(contrast_grid=contrast_grid))
    module.kernel = kernel
    return module.to(device)


# ----------------------------------------------------------------------------------------------------------------
# Part 3: one layer eagerly and as a CUDA graph; part 4: the depthwise convolution alone
# ----------------------------------------------------------------------------------------------------------------


def graph_rows(sizes: Sizes, device: torch.device) -> Iterator[dict]:
    from bench.host_time import LAYER, layer
    from dit_vca.attention import MultiHeadSelfAttention

    width, heads = sizes.width
    batch, tokens = sizes.graph_shape
    small = (LAYER["width"], LAYER["heads"], LAYER["batch"], LAYER["grid"] ** 2)
    shapes = {"XL layer": (width, heads, batch, tokens), "small layer": small}
    for label, (width, heads, batch, tokens) in shapes.items():
        if label == "small layer":
            layers = {"mhsa": layer(None, device), "vca": layer("triton", device)}
        else:
            layers = {"mhsa": MultiHeadSelfAttention(width, heads).to(device),
                      "vca": _vca_layer(width, heads, tokens, sizes.contrast_grid, "triton", device)}  # fmt: skip
        x = torch.randn(batch, tokens, width, device=device)  # the parameters' gradients (a first layer's)
        ms = {name: _eager_and_graphed_ms(module, x, device, sizes.repeats) for name, module in layers.items()}
        yield {"case": "graphs", "layer": label, "width": width, "tokens": tokens, "batch": batch, "ms": ms}
        del layers, x


def _eager_and_graphed_ms(module: torch.nn.Module, x: torch.Tensor, device: torch.device, repeats: int) -> dict:
    """Wall ms per forward + backward of `module` on x: eagerly, and as a replay of its CUDA graph."""
    from generation.cuda_graphs import CapturedCalls

    def step(x: torch.Tensor) -> None:
        module.zero_grad(set_to_none=True)  # a captured backward writes the gradients anew
        _forward_backward(module, x)

    graphed = CapturedCalls(step, pure=True)
    return {"eager": 1e3 * _seconds(lambda: step(x), device, repeats),
            "graphed": 1e3 * _seconds(lambda: graphed(x), device, repeats)}  # fmt: skip


def _seconds(call: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median wall seconds of one call (synchronised), after up to three untimed calls (as many as timed ones)."""
    for _ in range(min(3, repeats)):
        call()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        call()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def conv_rows(sizes: Sizes, device: torch.device) -> Iterator[dict]:
    batch, channels, side = sizes.conv_shape
    dtype = torch.bfloat16 if sizes.precision == "bf16" else torch.float32
    image = torch.randn(batch, channels, side, side, device=device, dtype=dtype).contiguous(
        memory_format=torch.channels_last
    )  # (B, C, H, W)
    weight = torch.randn(channels, 1, 3, 3, device=device, dtype=dtype)
    bias = torch.randn(channels, device=device, dtype=dtype)
    grad = torch.randn_like(image)
    calls = {
        "forward": lambda: F.conv2d(image, weight, bias, padding=1, groups=channels),
        "backward": lambda: torch.ops.aten.convolution_backward(
            grad, image, weight, None, [1, 1], [1, 1], [1, 1], False, [0, 0], channels, [True, True, False]
        ),
        "copy": lambda: image.clone(memory_format=torch.channels_last),
    }
    moved = {"forward": 2, "backward": 3, "copy": 2}  # tensors of the image's size read and written, at least
    for name, call in calls.items():
        seconds = _seconds(call, device, sizes.repeats)
        gigabytes = moved[name] * image.numel() * image.element_size() / 1e9
        yield {"case": "conv", "pass": name, "shape": [batch, channels, side, side], "dtype": sizes.precision,
               "us": 1e6 * seconds, "gb_per_s": gigabytes / seconds}  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# Parts 5 and 6: sampling and training, eager and graphed
# ----------------------------------------------------------------------------------------------------------------


def sample_rows(sizes: Sizes, device: torch.device) -> Iterator[dict]:
    from bench.samplers import build

    settings = {"input_size": sizes.sample_latent_side, "depth": sizes.sample_depth}
    for attention in ("mhsa", "vca"):
        model, objective = build(sizes.sample_model, attention, settings, device)
        for graphed in (False, True):
            seconds, nfe = _sampling_seconds(model, objective, graphed, sizes, device)
            yield {"case": "sampler", "model": f"{sizes.sample_model}-{attention.upper()}" + " graphed" * graphed,
                   "name": sizes.sample_model, "attention": attention, "graphed": graphed,
                   "sampler": f"ddim-{sizes.sample_steps}", "precision": sizes.precision, "nfe": nfe,
                   "seconds": seconds, "images_per_s": sizes.sample_batch / seconds,
                   "ms_per_nfe": 1e3 * seconds / nfe}  # fmt: skip
        del model


def _sampling_seconds(model, objective, graphed: bool, sizes: Sizes, device: torch.device) -> tuple[float, int]:
    """(seconds, model evaluations) of one DDIM run of a batch, after a 2-step run (graphed: which captures the one
    model-call shape)."""
    from generation.cuda_graphs import CapturedCalls

    dtype = torch.bfloat16 if sizes.precision == "bf16" else torch.float32
    network = CapturedCalls(model, pure=True) if graphed else model
    generator = torch.Generator(device).manual_seed(0)
    side = sizes.sample_latent_side
    x_T = torch.randn(sizes.sample_batch, model.in_channels, side, side, generator=generator, device=device)
    labels = torch.randint(0, 1000, (sizes.sample_batch,), generator=generator, device=device)
    with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        objective.sample(network, x_T, labels, sampler="ddim", steps=2)
        synchronize(device)
        start = time.perf_counter()
        result = objective.sample(network, x_T, labels, sampler="ddim", steps=sizes.sample_steps)
        synchronize(device)
    return time.perf_counter() - start, result.nfe


def train_rows(sizes: Sizes, device: torch.device, image_size: int) -> Iterator[dict]:
    for attention in ("mhsa", "vca"):
        for compiled, graphed in ((False, False), (False, True), (True, False)):
            case = TrainingCase(sizes.train_model, sizes.train_image_sizes[image_size], attention, sizes.precision,
                                compiled, graphed=graphed, per_block=compiled)  # fmt: skip
            row = measure_training(
                case,
                sizes.train_batches[image_size],
                sizes.train_warmup,
                sizes.train_steps,
                sizes.train_sizes,
                sizes.compile_backend,
            )
            yield {"case": "train", **row}


HOST_RUNBOOK = Runbook(
    module="bench.gpu_host",
    doc=__doc__,
    stem="gpu-host",
    parts={
        "kernels": kernel_rows,
        "kernels-old": lambda sizes, device: kernel_rows(sizes, device, old=True),
        "host": host_rows,
        "graphs": graph_rows,
        "conv": conv_rows,
        "sample": sample_rows,
        "train-256": lambda sizes, device: train_rows(sizes, device, 256),
        "train-512": lambda sizes, device: train_rows(sizes, device, 512),
    },
    budgets={  # the Triton core's first-use check compiles every configuration for its dtype and head dim: ~30-70 s
        "kernels": 70,  # the check at d = 72 in bf16 (68 s for issue 37's kernels, 2026-12-04), two profiled shapes
        "kernels-old": 65,  # issue 37's kernels: the same compilations for their source
        "host": 30,  # d = 72 in bf16, sizes of the XL layer's integer classes: compiled by `kernels`, from the cache
        "graphs": 25,  # the same; a capture takes a second
        "conv": 10,
        "sample": 80,  # DiT-S/2's d = 64: its own check and compilations; four DDIM-50 runs, ~1.3 s each
        "train-256": 60,  # six DiT-XL/2 cases: building each ~3 s, compiling one block per attention ~20 s
        "train-512": 60,
    },
    rehearsal_budgets={part: 150 for part in ("kernels", "kernels-old", "host", "graphs", "conv", "sample")}
    | {"train-256": 200, "train-512": 200},  # a loaded CI machine: Triton's interpreter, aot_eager compiles
    settings=Sizes(
        host_seconds=1.0,
        host_rounds=5,
        width=XL_WIDTH,
        contrast_grid=CONTRAST_GRID,
        kernel_shapes=((64, 256), (1, 16384)),
        graph_shape=(64, 256),
        repeats=10,
        conv_shape=(64, XL_WIDTH[0], 16),
        sample_model="DiT-S/2",
        sample_batch=32,
        sample_steps=50,
        sample_latent_side=32,
        sample_depth=None,
        train_model=LARGE_MODEL,
        train_sizes=None,
        train_batches={256: 32, 512: 8},
        train_image_sizes={256: 256, 512: 512},
        train_warmup=2,
        train_steps=5,
        compile_backend="inductor",
    ),
    rehearsal=Sizes(
        host_seconds=0.0,
        host_rounds=1,
        width=(64, 2),
        contrast_grid=2,  # 4×4 tokens, n = 4: the interpreter runs Python per program
        kernel_shapes=((1, 16),),
        graph_shape=(1, 16),
        repeats=1,
        conv_shape=(1, 8, 4),
        sample_model="DiT-S/2",
        sample_batch=2,
        sample_steps=3,
        sample_latent_side=8,
        sample_depth=1,
        train_model="DiT-S/2",
        train_sizes={"depth": 1, "hidden_size": 64, "num_heads": 2},
        train_batches={256: 1, 512: 1},
        train_image_sizes={256: 64, 512: 128},  # token grids 4 and 8
        train_warmup=1,
        train_steps=1,
        compile_backend="aot_eager",
        precision="fp32",
        threads=1,
    ),
)
# By construction: the parts and the main process fit the window.
assert HOST_RUNBOOK.budget_seconds(rehearse=False) <= HOST_RUNBOOK_SECONDS

if __name__ == "__main__":
    main(runbook=HOST_RUNBOOK)

"""Host time of VCA against MHSA: thread CPU time per call of a small layer and of a small DiT, interleaved in one run.

    python -m bench.host_time                   # CPU: MHSA, VCA's ATen core and its Triton core (stub driver)
    python -m bench.host_time --models          # ... and a small DiT's training and sampling steps, eager and compiled
    python -m bench.host_time --quick           # smoke run (the suite runs it)
    python -m bench.host_time --device cuda     # on a GPU: the same rows with the real driver

On a GPU a small layer's time is the host's: the Python code, the dispatcher and one launch per kernel, while the
GPU waits (issue 46: ~1.5 ms per VCA forward on an H200 whatever the shape). What the host spends per call is
measured here as CPU time of the calling thread (time.thread_time), which other jobs on a shared machine do not
inflate, of one call at a time, every layer in turn (interleaved rounds), the median per layer; VCA / MHSA in the
same mode and precision is the figure (issue 46's goal: ≤ 2).

Rows, each in fp32 and under bf16 autocast:
- layer: one layer, C = 144, 2 heads (d = 72, DiT-XL/2's), 8×8 tokens, n = 16, batch 2: `forward+backward` (a
  training step's share, backward of the output's sum) and `forward` (under no_grad: sampling's share). On CPU
  tensors the small operations also compute, which on a GPU they leave to it: the depthwise convolution's oneDNN
  calls most of all (the meta device is no cleaner a stand-in: many of its operations run Python decompositions,
  ten times the CPU's cost). Subjects: MHSA (SDPA), VCA on its ATen core, and VCA on its Triton core; on a CPU with
  the CUDA driver stubbed out (bench.stub_driver): Triton's own launch path, the JIT's binding, cache lookup and C
  launcher, runs in full; the kernels compile once for sm_90 and then launch nothing, so the ATen operations
  around them compute on whatever their outputs held (flush-to-zero keeps denormals from slowing them); the
  per-call look-up of the first-use check, which runs on CUDA devices only, is not in them. On a GPU the Triton
  core is the real one. On a CPU the convolution alone is timed beside them (subject "conv", as nn.Conv2d runs it)
  and the table gives VCA's time without it over MHSA's too.
- model (--models): a small DiT (DiT-S/2's family, 2 blocks, C = 64, 2 heads, 8×8 latents: 16 tokens), batch 2:
  `train step` (the objective's loss, backward, AdamW) and `sample step` (one model call under no_grad on the
  CFG pair as one batch of 4), eager and compiled (`model.compile(fullgraph=True)`, inductor; the first calls,
  which compile, are not timed); the same three subjects.
On the CPU the ATen operations compute for real, at sizes where that costs little next to the host's own work.

Writes bench/results/host-time-<device>.json, .md and .png (--quick: host-time-<device>-quick).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from bench._harness import (
    allow_recompilations,
    benchmark_parser,
    cpu_vector_flags,
    describe_device,
    save_results,
    subplots,
    synchronize,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# The small layer: DiT-XL/2's head dimension (d = 72) and sizes in the integer classes Triton specialises on (N, n
# multiples of 16), so that on a GPU its kernels are the XL layer's compilations, from Triton's cache.
LAYER = {"width": 144, "heads": 2, "grid": 8, "contrast_grid": 4, "batch": 2}
MODEL = {"name": "DiT-S/2", "depth": 2, "hidden_size": 64, "num_heads": 2, "latent": 8, "batch": 2}
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}
GOAL = 2.0  # issue 46: a small VCA layer's host time ≤ 2x MHSA's


@dataclass(frozen=True)
class Settings:
    min_seconds: float  # of timed calls per row, the slowest subject's
    min_rounds: int
    max_rounds: int
    models: bool
    model_precisions: tuple[str, ...]
    compile_backend: str  # torch.compile's, for the compiled model rows


def interleaved_thread_seconds(steps: dict[str, Callable[[], object]], device: torch.device, settings: Settings):
    """Median thread CPU seconds of one call of each step, timed one call at a time, every step in turn, after two
    untimed calls of each (compilation, autotuning, caches); the GPU's queue is drained after each call, untimed, so
    that no call waits for an earlier one's kernels."""
    for step in steps.values():
        for _ in range(2):
            step()
        synchronize(device)
    times: dict[str, list[float]] = {name: [] for name in steps}
    while (rounds := len(times[next(iter(times))])) < settings.min_rounds or (
        max(sum(t) for t in times.values()) < settings.min_seconds and rounds < settings.max_rounds
    ):
        for name, step in steps.items():
            start = time.thread_time()
            step()
            times[name].append(time.thread_time() - start)
            synchronize(device)
    return {name: statistics.median(t) for name, t in times.items()}


# ----------------------------------------------------------------------------------------------------------------
# The subjects: MHSA, VCA on ATen, VCA on Triton (the stub driver on the CPU)
# ----------------------------------------------------------------------------------------------------------------


def subjects(device: torch.device) -> dict[str, str | None]:
    """Subject name -> VisualContrastAttention.kernel (None for MHSA): the Triton core where it can run here (a GPU,
    or the stub driver on a CPU with triton installed)."""
    from dit_vca.attention import TRITON_INSTALLED

    names: dict[str, str | None] = {"mhsa": None, "vca-aten": "aten"}
    if TRITON_INSTALLED:
        names["vca-triton"] = "triton"
    return names


def use_triton_launch_path(device: torch.device) -> None:
    """On the CPU, for the rest of the process: Triton's launch path over the stub driver, and VCA's Triton core
    allowed CPU tensors (it refuses them unless Triton's interpreter runs them: here nothing runs them). On a GPU,
    or under the interpreter (the GPU runbook's rehearsal), nothing to do."""
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return
    from bench.stub_driver import use_stub_driver
    from dit_vca import vca_triton

    use_stub_driver()
    vca_triton._check_device = lambda tensor: None


def layer(kernel: str | None, device: torch.device) -> torch.nn.Module:
    """The benchmark's layer: MHSA (kernel None) or VCA on `kernel`."""
    from dit_vca.attention import MultiHeadSelfAttention, VCAOptions, VisualContrastAttention

    torch.manual_seed(0)
    width, heads, grid = LAYER["width"], LAYER["heads"], LAYER["grid"]
    if kernel is None:
        return MultiHeadSelfAttention(width, heads).to(device)
    module = VisualContrastAttention(width, heads, grid, 1, VCAOptions(contrast_grid=LAYER["contrast_grid"]))
    module.kernel = kernel
    return module.to(device)


class ValueConvolution(torch.nn.Module):
    """VCA's depthwise 3×3 convolution of v alone, on tokens (B, N, C) as a channels-last image: on CPU tensors, the
    share of VCA's time that is the CPU computing (oneDNN), which on a GPU the host leaves to the GPU."""

    def __init__(self, width: int, grid: int) -> None:
        super().__init__()
        self.grid = grid
        self.conv = torch.nn.Conv2d(width, width, kernel_size=3, padding=1, groups=width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        image = x.view(B, self.grid, self.grid, C).permute(0, 3, 1, 2)  # (B, C, H, W), channels-last
        return self.conv(image).permute(0, 2, 3, 1).reshape(B, N, C)  # (B, N, C)


def layer_rows(
    device: torch.device, settings: Settings, precisions: tuple[str, ...] = tuple(PRECISIONS)
) -> Iterator[dict]:
    """The layer rows in `precisions`, with the convolution alone beside them on a CPU (subject "conv")."""
    from bench.attention import layer_step

    names = subjects(device)
    layers = {name: layer(kernel, device) for name, kernel in names.items()}
    if device.type == "cpu":
        layers["conv"] = ValueConvolution(LAYER["width"], LAYER["grid"]).to(device)
    tokens = LAYER["grid"] ** 2
    for precision in precisions:
        dtype = PRECISIONS[precision]
        for backward in (True, False):
            x = torch.randn(LAYER["batch"], tokens, LAYER["width"], device=device, requires_grad=backward)
            steps = {name: layer_step(module, x, dtype, backward) for name, module in layers.items()}
            seconds = interleaved_thread_seconds(steps, device, settings)
            yield {"case": "layer", "tensors": device.type, "precision": precision,
                   "mode": "forward+backward" if backward else "forward",
                   "us": {name: 1e6 * s for name, s in seconds.items()}}  # fmt: skip


def model_rows(device: torch.device, settings: Settings) -> Iterator[dict]:
    from dit_vca.attention import VCAOptions, VisualContrastAttention
    from dit_vca.model_spec import ModelSpec, model_family
    from dit_vca.models import create_backbone
    from generation.objective_builder import create_objective, default_objective

    family = model_family(MODEL["name"])
    objective = create_objective(default_objective(family))
    allow_recompilations(64)  # every compiled model is another instance of one forward
    batch, latent = MODEL["batch"], MODEL["latent"]
    sizes = {key: MODEL[key] for key in ("depth", "hidden_size", "num_heads")}
    x = torch.randn(batch, 4, latent, latent, device=device)
    y = torch.randint(0, 1000, (batch,), device=device)
    pair = (torch.cat([x, x]), torch.full((2 * batch,), 500.0, device=device), torch.cat([y, torch.full_like(y, 1000)]))
    for precision in settings.model_precisions:
        dtype = PRECISIONS[precision]
        autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
        for compiled in (False, True):
            trains, samples = {}, {}
            for name, kernel in subjects(device).items():
                torch.manual_seed(0)
                with torch.device(device):
                    spec = ModelSpec(MODEL["name"], attention="mhsa" if kernel is None else "vca",
                                     input_size=latent, vca=VCAOptions(), **sizes)  # fmt: skip
                    model = create_backbone(family, spec)
                for module in model.modules():  # set_vca_kernel refuses triton on a CPU: the stub runs it here
                    if isinstance(module, VisualContrastAttention):
                        module.kernel = kernel
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
                if compiled:
                    model.compile(fullgraph=True, backend=settings.compile_backend)
                trains[name] = _train_step(model, objective, optimizer, x, y, autocast)
                samples[name] = _sample_step(model, pair, autocast)
            for mode, steps in (("train step", trains), ("sample step", samples)):
                seconds = interleaved_thread_seconds(steps, device, settings)
                yield {"case": "model", "tensors": device.type, "precision": precision, "mode": mode,
                       "compiled": compiled, "us": {name: 1e6 * s for name, s in seconds.items()}}  # fmt: skip


def _train_step(model, objective, optimizer, x, y, autocast) -> Callable[[], None]:
    def step() -> None:
        with autocast:
            loss = objective.training_losses(model, x, y)["loss"].mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _sample_step(model, pair, autocast) -> Callable[[], None]:
    def step() -> None:
        with torch.no_grad(), autocast:
            model(*pair)

    return step


# ----------------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------------


def markdown(results: dict) -> str:
    lines = [
        f"Host time per call on {results['device']} ({' '.join(results['cpu_flags']) or 'no AVX'}; torch "
        f"{results['torch']}, triton {results['triton']}; {results['date']}): thread CPU time, µs, the median of "
        "interleaved rounds; VCA / MHSA in the same row (issue 46's goal for the layer: ≤ 2)."
        + (
            " VCA Triton: Triton's launch path over a stub CUDA driver that launches nothing (bench.stub_driver)."
            if results["stub_driver"]
            else ""
        ),  # fmt: skip
        "",
    ]
    layers = [r for r in results["rows"] if r["case"] == "layer"]
    models = [r for r in results["rows"] if r["case"] == "model"]
    if layers:
        lines += [
            f"One layer (C = {LAYER['width']}, {LAYER['heads']} heads, {LAYER['grid'] ** 2} tokens, n = "
            f"{LAYER['contrast_grid'] ** 2}, batch {LAYER['batch']}):",
            "",
            *_table(
                ["tensors", "precision", "pass"], [([r["tensors"], r["precision"], r["mode"]], r["us"]) for r in layers]
            ),
        ]
    if models:
        lines += [
            "",
            f"A small DiT ({MODEL['name']}'s family, {MODEL['depth']} blocks, C = {MODEL['hidden_size']}, "
            f"{(MODEL['latent'] // 2) ** 2} tokens, batch {MODEL['batch']}; sampling: the CFG pair as one batch):",
            "",
            *_table(["precision", "step", "compiled"],
                    [([r["precision"], r["mode"], "yes" if r["compiled"] else "no"], r["us"]) for r in models]),
        ]  # fmt: skip
    return "\n".join(lines) + "\n"


def _table(head: list[str], rows: list[tuple[list[str], dict[str, float]]]) -> list[str]:
    """A Markdown table: the `head` columns, µs per subject, each VCA subject over MHSA, and where the convolution
    was timed alone, each VCA subject without it over MHSA."""
    names = list(rows[0][1])
    vca = [n for n in names if n.startswith("vca")]
    header = [*head, *(f"{n} µs" for n in names), *(f"{n} / mhsa" for n in vca)]
    header += [f"({n} − conv) / mhsa" for n in vca] if "conv" in names else []
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(head) + "---:|" * (len(header) - len(head))]
    for cells, us in rows:
        ratios = [f"**{us[n] / us['mhsa']:.2f}**" for n in vca]
        ratios += [f"{(us[n] - us['conv']) / us['mhsa']:.2f}" for n in vca] if "conv" in us else []
        lines.append("| " + " | ".join([*cells, *(f"{us[n]:.0f}" for n in names), *ratios]) + " |")
    return lines


def plot(results: dict) -> Figure:
    rows = results["rows"]
    figure, ax = subplots(figsize=(max(6.0, 0.9 * len(rows) + 2), 4.5))
    names = [name for name in rows[0]["us"] if name != "conv"]
    labels = [f"{r['case']} {r['tensors']} {r['precision']}\n{r['mode']}{' compiled' if r.get('compiled') else ''}"
              for r in rows]  # fmt: skip
    width = 0.8 / len(names)
    for offset, name in enumerate(names):
        positions = [i + (offset - (len(names) - 1) / 2) * width for i in range(len(rows))]
        ax.bar(positions, [r["us"][name] / r["us"]["mhsa"] for r in rows], width=width, label=name)
    ax.axhline(GOAL, color="gray", linestyle="--", linewidth=1, label=f"goal ≤ {GOAL:g}x (layer)")
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("host time / MHSA's")
    ax.set_title(f"host time per call, {results['device']}")
    ax.legend(fontsize=8)
    figure.tight_layout()
    return figure


def main() -> None:
    parser = benchmark_parser(
        __doc__, quick="a few rounds per row, the models in fp32, compiled by aot_eager (no inductor): a smoke run"
    )
    parser.add_argument("--models", action="store_true", help="also a small DiT's training and sampling steps")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") == "1":
        parser.error("TRITON_INTERPRET=1: this benchmark times Triton's compiled launch path; unset it")
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    settings = Settings(
        min_seconds=0.0 if args.quick else 3.0,
        min_rounds=5,
        max_rounds=5 if args.quick else 20000,
        models=args.models or args.quick,
        model_precisions=("fp32",) if args.quick else tuple(PRECISIONS),
        compile_backend="aot_eager" if args.quick else "inductor",
    )
    from importlib.metadata import version

    if "vca-triton" in subjects(device):
        use_triton_launch_path(device)
    rows = []
    for row in layer_rows(device, settings):
        rows.append(row)
        print(row, flush=True)
    if settings.models:
        for row in model_rows(device, settings):
            rows.append(row)
            print(row, flush=True)
    results = {
        "device": describe_device(device),
        "cpu_flags": cpu_vector_flags() if device.type == "cpu" else [],
        "torch": torch.__version__,
        "triton": version("triton") if "vca-triton" in subjects(device) else None,
        "date": time.strftime("%Y-%m-%d"),
        "stub_driver": device.type != "cuda" and "vca-triton" in subjects(device),
        "threads": args.threads,
        "rows": rows,
    }
    stem = f"host-time-{device.type}{'-quick' if args.quick else ''}"
    table = markdown(results)
    save_results(Path(args.out), stem, results, table, plot)
    print(table)


if __name__ == "__main__":
    main()

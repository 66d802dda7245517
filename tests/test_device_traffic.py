"""No hidden host<->device traffic: a training step and every sampler's loop, run with the model and data on the
`meta` device under a guard that raises on a CPU -> device copy or a host read of a device value
(tests/_device_traffic.py says why that catches what a GPU would pay for), also with LightningDiT's block options
(VCA's QK-norm and RoPE inside its core, their tables buffers that move with the model); AdamW fused on CUDA."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

from _device_traffic import HostDeviceTraffic, HostDeviceTrafficGuard
from dit_vca.diffusion import create_diffusion
from dit_vca.models import create_model
from sit_vca.models import create_model as create_sit_model
from sit_vca.transport import create_transport
from training.build import create_optimizer
from training.config import load_config
from training.ema import create_ema
from training.loop import Trainer, TrainerState
from training.run import RunDirectory

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "configs" / "digits.yaml"
META = torch.device("meta")
TINY = dict(input_size=8, in_channels=1, num_classes=10, depth=1, hidden_size=32, num_heads=2)
BATCH = 4


RECIPE = dict(blocks="lightning-qknorm")  # RMSNorm, SwiGLU, QK-norm, RoPE


def meta_model(family: str, **block_options) -> torch.nn.Module:
    with torch.device(META):
        create = create_model if family == "DiT" else create_sit_model
        return create(f"{family}-S/2", attention="vca", **TINY, **block_options)


def test_the_guard_catches_a_copy_and_a_host_read():
    x = torch.zeros(3, device=META)
    with HostDeviceTrafficGuard(), pytest.raises(HostDeviceTraffic, match="copies a CPU tensor"):
        x + torch.arange(3).to(META)
    with HostDeviceTrafficGuard(), pytest.raises(HostDeviceTraffic, match="reads a meta tensor"):
        float(x[0])


@pytest.fixture
def meta_accelerator(monkeypatch):
    accelerator = Accelerator(cpu=True)
    monkeypatch.setattr(Accelerator, "device", property(lambda self: META))  # the step's .to(device) is a no-op
    yield accelerator
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.mark.parametrize(
    "family,objective,block_options",
    [("DiT", create_diffusion, {}), ("SiT", create_transport, {}), ("SiT", create_transport, RECIPE)],
    ids=["DiT", "SiT", "SiT-lightning-qknorm"],
)
def test_a_training_step_moves_nothing_between_host_and_device(
    family, objective, block_options, meta_accelerator, tmp_path
):
    """Trainer.train_step (forward, backward, clipping, AdamW, LR schedule, EMA) on batches already on the
    device. The first step moves the schedule to the device (once per device); the second must move nothing."""
    model_name = f"{family}-S/2"
    config = load_config(
        DIGITS,
        [
            f"model.name={model_name}",
            "model.depth=1",
            "model.hidden_size=32",
            "model.num_heads=2",
            f"train.global_batch_size={BATCH}",
            "log.trackers=[]",
            *(["log.sample_sampler=euler"] if family == "SiT" else []),  # the preview sampler of SiT's objective
        ],
    )
    model = (create_model if family == "DiT" else create_sit_model)(
        model_name, attention="vca", **TINY, **block_options
    )
    ema = create_ema(model, config.train).to(META)  # built on the CPU: timm seeds a generator on its device
    model.to(META)
    optimizer, scheduler = create_optimizer(model, config, META)
    batches = SimpleNamespace(loader=SimpleNamespace(batch_size=BATCH))
    parts = SimpleNamespace(
        model=model,
        ema=ema,
        objective=objective(),
        optimizer=optimizer,
        scheduler=scheduler,
        batches=batches,
        encoder=None,
        alignment=None,
        posthoc_ema=None,
        trained_modules=[model],
    )
    trainer = Trainer(meta_accelerator, config, RunDirectory(tmp_path), parts, TrainerState())
    images = torch.zeros(BATCH, 1, 8, 8, device=META)
    labels = torch.zeros(BATCH, dtype=torch.long, device=META)
    stream = iter([(images, labels, 0)] * 2)
    trainer.train_step(stream)
    with HostDeviceTrafficGuard():
        trainer.train_step(stream)
    assert trainer.state.step == 2


# Samplers whose loops are ours. Not here: the adaptive torchdiffeq solvers (dopri5, ...), whose step-size
# control reads the error norm on the host after every step (inherent to adaptive stepping), and diffusers'
# multistep schedulers (dpm++2m, unipc), which look their step index up with .item() and, for UniPC, build
# coefficient tensors on the host at every step.
DIFFUSION_SAMPLERS = ("ddpm", "ddim")
TRANSPORT_SAMPLERS = ("euler", "heun", "sde-euler", "sde-heun")


@pytest.mark.parametrize(
    "family,sampler,block_options",
    [("DiT", s, {}) for s in DIFFUSION_SAMPLERS]
    + [("SiT", s, {}) for s in TRANSPORT_SAMPLERS]
    + [("SiT", "euler", RECIPE)],
    ids=lambda value: ("lightning-qknorm" if value else "plain") if isinstance(value, dict) else None,
)
def test_sampler_loops_move_nothing_between_host_and_device(family, sampler, block_options):
    model = meta_model(family, **block_options).eval()
    objective = create_diffusion(learn_sigma=True) if family == "DiT" else create_transport()
    options = {"eta": 0.5} if sampler == "ddim" else {}  # with noise: every branch of the DDIM step
    x = torch.zeros(BATCH, 1, 8, 8, device=META)
    labels = torch.zeros(BATCH, dtype=torch.long, device=META)
    objective.sample(model, x, labels, sampler=sampler, steps=3, **options)  # the schedule moves to the device
    with HostDeviceTrafficGuard():
        result = objective.sample(model, x, labels, sampler=sampler, steps=3, **options)
    assert result.samples.device == META


def test_adamw_is_fused_on_cuda_only():
    config = load_config(DIGITS, ["model.depth=1", "model.hidden_size=32", "model.num_heads=2"])
    model = create_model("DiT-S/2", attention="vca", **TINY)  # CPU parameters: fused AdamW accepts them too
    assert create_optimizer(model, config, torch.device("cuda"))[0].defaults["fused"] is True
    assert not create_optimizer(model, config, torch.device("cpu"))[0].defaults["fused"]

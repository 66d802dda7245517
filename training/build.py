"""The parts a config names, built in one place: data, VAE, model, EMA, objective, optimiser, previews, export.

`build_training(config, accelerator)` is what train.py calls. DiT models ("DiT-...") train with the DDPM objective
of `dit_vca`, SiT models ("SiT-...") with the transport objective of `sit_vca` (the family table
`objectives.MODEL_FAMILIES` decides), so model and objective cannot be mismatched.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from timm.utils import ModelEmaV3
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import Dataset

from dit_vca.attention import set_vca_kernel
from dit_vca.model_spec import model_family, name_size
from dit_vca.models import DiT
from generation.export import ExportDescription
from generation.generator import ImageGenerator, pixel_decoder
from generation.objective_builder import Objective, create_objective
from generation.vae import latent_downsampling, load_vae
from objectives import DIFFUSION, MODEL_FAMILIES, ObjectiveSpec
from training.accelerator import micro_batch_size
from training.config import Config, ConfigError
from training.data import LatentShardDataset, ShardedBatches, build_dataset
from training.ema import create_ema
from training.power_ema import PowerEMA, create_posthoc_ema
from training.repa import RepresentationAlignment, build_projector, check_encoder, load_encoder

if TYPE_CHECKING:  # diffusers is imported only where a VAE is loaded (generation.vae): pixel-space runs never need it
    from diffusers import AutoencoderKL

    from training.preview import PreviewWeights


@dataclass
class TrainingParts:
    """Everything the training loop needs, prepared for `accelerator` (model, optimiser and scheduler wrapped)."""

    model: torch.nn.Module
    ema: ModelEmaV3
    objective: Objective
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    batches: ShardedBatches
    encoder: AutoencoderKL | None  # encodes images online (data.source=images); None otherwise
    preview: ImageGenerator | None  # log.fid_weights' model, objective and decoder: grids and FID (None: neither)
    export: ExportDescription  # written with every checkpoint
    fid_extractor: Any  # Inception features for FID monitoring, or None
    alignment: RepresentationAlignment | None = None  # REPA (train.repa.encoder set); its projector is prepared
    posthoc_ema: PowerEMA | None = None  # power-function EMA profiles (train.posthoc_ema.sigma_rel set)
    preview_weights: PreviewWeights | None = None  # what `preview` draws from (log.fid_weights), with `preview`

    @property
    def trained_modules(self) -> list[torch.nn.Module]:
        """The prepared modules the optimiser trains: the model, and REPA's projector when on."""
        return [self.model] + ([self.alignment.projector] if self.alignment is not None else [])


def draws_previews(config: Config) -> bool:
    """Sample grids or FID monitoring are on (both draw images from the EMA model)."""
    return bool(config.log.sample_every or config.log.fid_every)


def needs_vae(config: Config) -> bool:
    """Images are encoded online; latents are decoded for grids and FID; pixel-space data needs none."""
    return config.data.source == "images" or (not config.data.in_pixel_space and draws_previews(config))


def model_input_shape(config: Config, dataset: Dataset, vae: AutoencoderKL | None) -> tuple[int, int]:
    """(channels, side) of what the model sees: the images of a pixel-space dataset, latents otherwise."""
    if config.data.in_pixel_space:
        channels, _, side = dataset.images.shape[1:]  # training.builtin_data.InMemoryImages: (N, C, S, S)
        return channels, side
    if isinstance(dataset, LatentShardDataset):
        return dataset.manifest["latent_channels"], dataset.manifest["latent_size"]
    return vae.config.latent_channels, config.data.image_size // latent_downsampling(vae.config)


def build_model(config: Config, in_channels: int, input_size: int) -> DiT:
    """The network of `config` for inputs (B, in_channels, input_size, input_size): its model section, with what
    the data and the objective decide."""
    objective = MODEL_FAMILIES[model_family(config.model.name)]  # diffusion.learn_sigma is DDPM's; SiT's the family's
    spec = replace(
        config.model,
        input_size=input_size,
        in_channels=in_channels,
        num_classes=config.data.num_classes,
        learn_sigma=config.diffusion.learn_sigma if objective is DIFFUSION else objective.learn_sigma,
    )
    try:
        return DiT(spec)
    except ValueError as error:  # the backbone names the sizes that do not fit together
        raise ConfigError(
            f"model settings that build no model for {in_channels}x{input_size}x{input_size} inputs: {error}"
        ) from None


def objective_spec(config: Config) -> ObjectiveSpec:
    """The objective of the model's family: the config's diffusion section (DiT names) or transport section (SiT)."""
    objective = MODEL_FAMILIES[model_family(config.model.name)]
    return config.diffusion if objective is DIFFUSION else config.transport


def class_names(dataset: Dataset) -> list[str] | None:
    """The names of the classes where the data has them: an image folder's sub-folders (also through the manifest
    of latents extracted from one); None for the built-in data."""
    if isinstance(dataset, LatentShardDataset):
        return list(dataset.manifest["classes"])
    names = getattr(dataset, "classes", None)  # ImageFolderDataset
    return list(names) if names is not None else None


def export_description(config: Config, model: DiT, dataset: Dataset | None = None) -> ExportDescription:
    """What sampling needs to rebuild the model and turn its outputs into images; the classes' names and the
    latents' per-channel statistics (where vae.normalize=channels) come from `dataset`."""
    pixels = config.data.in_pixel_space
    normalization = dataset.normalization if isinstance(dataset, LatentShardDataset) else None
    mean, std = (normalization.mean, normalization.std) if normalization is not None else (None, None)
    return ExportDescription(
        model=model.spec,
        objective=objective_spec(config),
        space="pixels" if pixels else "latents",
        image_size=config.data.image_size,
        num_classes=config.data.num_classes,
        vae=None if pixels else config.vae.name,
        vae_path=None if pixels else config.vae.path,
        latent_scale=None if pixels else config.vae.scale,
        latent_mean=None if mean is None else list(mean),
        latent_std=None if std is None else list(std),
        class_names=None if dataset is None else class_names(dataset),
    )


def create_optimizer(
    model: torch.nn.Module, config: Config, device: torch.device, extra: torch.nn.Module | None = None
) -> tuple[torch.optim.Optimizer, LambdaLR]:
    """AdamW over the trainable parameters of `model` (and `extra`, REPA's projector), with a linear warm-up to a
    constant learning rate. On CUDA (`device`, where training runs) AdamW is fused: one kernel for all parameters
    instead of several per tensor, with its step counts on the GPU, and with train.cuda_graph capturable (the
    Trainer gives it its learning rate as a tensor). Elsewhere torch's default (bit-identical to earlier runs)."""
    train = config.train
    parameters = [*model.parameters(), *(extra.parameters() if extra is not None else ())]
    cuda = device.type == "cuda"
    optimizer = torch.optim.AdamW(
        [p for p in parameters if p.requires_grad],
        lr=train.lr,
        betas=tuple(train.betas),
        weight_decay=train.weight_decay,
        fused=True if cuda else None,
        capturable=cuda and train.cuda_graph,
    )
    warmup = train.warmup_steps
    scheduler = LambdaLR(optimizer, lambda done: min(1.0, (done + 1) / warmup) if warmup else 1.0)
    return optimizer, scheduler


CUDA_GRAPH_TORCH = (2, 6)  # the first torch whose LR schedulers fill a tensor learning rate in place, no host sync


def check_cuda_graph_launch(accelerator: Accelerator) -> None:
    """What train.cuda_graph needs of the launch, which the config alone does not say (training.config checks the
    rest): one process (no all-reduce inside the graph), no fp16 from `accelerate launch` (its loss scaling reads
    the GPU from the host), a recent torch. Without CUDA, a one-line note: the step runs eagerly on the static
    buffers (generation.cuda_graphs)."""
    if accelerator.num_processes > 1:
        raise ConfigError(
            f"'train.cuda_graph' is true, but this launch has {accelerator.num_processes} processes: a captured step "
            "runs on one (launch one process, or set train.cuda_graph=false)"
        )
    if accelerator.mixed_precision == "fp16":
        raise ConfigError("'train.cuda_graph' is true, but the launch's mixed precision is fp16: use fp32 or bf16")
    version = tuple(int(part) for part in torch.__version__.split(".")[:2])
    if accelerator.device.type == "cuda" and version < CUDA_GRAPH_TORCH:
        raise ConfigError(
            f"'train.cuda_graph' needs torch >= {'.'.join(map(str, CUDA_GRAPH_TORCH))}, this is {torch.__version__}"
        )
    if accelerator.device.type != "cuda" and accelerator.is_main_process:
        print(
            f"note: train.cuda_graph=true on {accelerator.device.type}: no CUDA graph there; the step runs eagerly "
            "on the same static buffers",
            flush=True,
        )


def build_training(config: Config, accelerator: Accelerator) -> TrainingParts:
    """Build and prepare every part. Data, VAE and FID reference come first, so that a missing file or an
    unavailable VAE or REPA encoder fails before the model is built; every process starts from identical weights."""
    from training.preview import PreviewWeights, load_fid_extractor

    if config.train.repa.enabled:
        check_encoder(config.train.repa)  # before the data is read
    if config.train.cuda_graph:
        check_cuda_graph_launch(accelerator)
    dataset = build_dataset(config)
    vae = load_vae(config.vae.name, accelerator.device, hint=config.vae.path) if needs_vae(config) else None
    fid_extractor = load_fid_extractor(config.log, accelerator.device)
    in_channels, input_size = model_input_shape(config, dataset, vae)
    model_grid = input_size // name_size(config.model.name)[1]
    image_channels = in_channels if config.data.in_pixel_space else 3  # what REPA's encoder sees: the images
    encoder = (
        load_encoder(config.train.repa, image_channels, model_grid, accelerator.device)
        if config.train.repa.enabled
        else None
    )  # checked against the data and the model's grid here
    batches = ShardedBatches(
        dataset,
        micro_batch_size(config, accelerator.num_processes),
        accelerator.process_index,
        accelerator.num_processes,
        config.train.seed,
        config.data.num_workers,
        pin_memory=accelerator.device.type == "cuda",
    )

    set_seed(config.train.seed)  # identical initial weights on every process ...
    model = build_model(config, in_channels, input_size)
    compute_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision, torch.float32)
    # The EMA copies the choice; the Triton core is checked now, before compiling (dit_vca.triton_check).
    set_vca_kernel(model, config.train.vca_kernel, accelerator.device, "train.vca_kernel", compute_dtype)
    ema = create_ema(model, config.train).to(accelerator.device)
    posthoc_ema = create_posthoc_ema(
        model, config.train.posthoc_ema, config.train.global_batch_size, accelerator.device
    )
    objective = create_objective(objective_spec(config))
    export = export_description(config, model, dataset)
    projector = (
        build_projector(model.spec.hidden_size, config.train.repa.projector_dim, encoder.width)
        if encoder is not None
        else None
    )
    if config.train.compile:
        model.compile(fullgraph=True)  # a graph break is an error, never a silent fall-back to eager pieces
    optimizer, scheduler = create_optimizer(model, config, accelerator.device, projector)
    if projector is None:
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    else:  # the projector is saved as model_1.safetensors in checkpoints, never in exports
        model, projector, optimizer, scheduler = accelerator.prepare(model, projector, optimizer, scheduler)
    set_seed(config.train.seed * accelerator.num_processes + accelerator.process_index)  # ... then one stream each

    preview_weights = PreviewWeights(config.log.fid_weights, ema, posthoc_ema) if draws_previews(config) else None
    preview = (
        ImageGenerator(
            preview_weights.module,
            objective,
            pixel_decoder(export, vae),
            config.data.num_classes,
            class_names=export.class_names,
        )
        if preview_weights is not None
        else None
    )
    alignment = (
        RepresentationAlignment(encoder, projector, config.train.repa, model_grid) if encoder is not None else None
    )
    return TrainingParts(
        model,
        ema,
        objective,
        optimizer,
        scheduler,
        batches,
        vae if config.data.source == "images" else None,
        preview,
        export,
        fid_extractor,
        alignment,
        posthoc_ema,
        preview_weights,
    )

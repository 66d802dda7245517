"""Typed experiment configuration: YAML files with a `base:` chain plus dotted command-line overrides.

A config file may name one or more files it extends (`base: imagenet256.yaml`, paths relative to the file);
the chain is merged base first, then the file itself, then the command line (`train.lr=2e-4`). Every key and
value is checked against the dataclass schema below before anything is built, so a typo or a wrong type
fails at once with the key, the file it came from and the valid choices or range. A count that may be 0
says what 0 means (log.sample_every, log.fid_every, log.export_every: 0 switches it off).

The schema holds types and neutral defaults; recipe values (model, data, batch size, learning rate, EMA
decay, steps, VAE) have no default and come from the YAML files, so each is written down in one place. The
sections model, diffusion and transport are the specs the network and the objectives are built from
(dit_vca.model_spec.ModelSpec, objectives.DiffusionSpec and TransportSpec): their settings are written there once.
A key that earlier code named otherwise (RENAMED_KEYS) loads under its new name, with one line saying it.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from commands import UserError
from configs import UnknownConfigError, find_config
from dit_vca.model_options import VCA_KERNEL_SETTINGS
from dit_vca.model_spec import ModelSpec, all_model_names, name_size
from objectives import MODEL_FAMILIES, SAMPLERS, DiffusionSpec, TransportSpec
from settings import choice as _choice
from settings import value_range as _range
from training.encoder_source import encoder_source

BASE_KEY = "base"
DEFAULT_RESULTS_DIR = "results"


class ConfigError(UserError):
    """A config file or override that does not fit the schema."""


# --------------------------------------------------------------------------------------------------
#                                              Schema
# --------------------------------------------------------------------------------------------------


@dataclass
class DataConfig:
    """Where training examples come from; `source` decides which of the paths is used."""

    source: str = _choice(MISSING, "latents", "images", "digits", "shapes")  # latent shards, an image folder
    # encoded online, or the built-in 8x8 digits / 16x16 shapes (pixel space)
    images: str | None = None  # ImageNet-style folder: one sub-folder per class
    latents: str | None = None  # shards written by `python -m training.latents`
    image_size: int = _range(MISSING, 1)  # pixels (digits: 8, shapes: 16)
    num_classes: int = _range(MISSING, 1)  # label count (the null class for CFG is added on top)
    random_flip: bool = True  # horizontal flips, drawn per example from train.seed
    on_corrupt: str = _choice("error", "error", "skip")  # an image that cannot be decoded: stop, or skip it
    num_workers: int = _range(4, 0)  # 0: load in the training process

    @property
    def in_pixel_space(self) -> bool:
        """The model works on the images themselves (the built-in digits and shapes); every other source is
        encoded to latents."""
        return self.source in ("digits", "shapes")


@dataclass
class VAEConfig:
    """The autoencoder that maps images to latents (required unless data.source is pixel-space)."""

    name: str | None = None  # hub id or a local folder written by save_pretrained (recorded by its hub id)
    path: str | None = None  # the local folder's absolute path, tried first where it exists; set from vae.name
    scale: float | None = _range(None, 0.0, above=True)  # latents are multiplied by this for the model
    normalize: str = _choice("scale", "scale", "channels")  # channels: (z - mean) / std per channel first, with the
    # statistics `python -m training.latents` measured (LightningDiT's latent norm; data.source=latents only)


@dataclass
class ExtractConfig:
    """`python -m training.latents`: how the image folder is encoded into shards."""

    batch_size: int = _range(64, 1)  # images per VAE encoder call
    shard_size: int = _range(4096, 1)  # latents per shard file
    dtype: str = _choice("float16", "float16", "float32")  # of the stored latents


@dataclass
class RepaConfig:
    """Representation alignment (REPA, Yu et al. 2025): the tokens after block `depth` go through a projector
    MLP and are pulled towards the patch features of a frozen encoder (training.repa; docs/training.md,
    "Representation alignment")."""

    encoder: str | None = None  # timm name, or a folder written by timm's save_for_hf (recorded by the timm name it
    # is a copy of, else its absolute path: training.encoder_source); None: off
    path: str | None = None  # the folder's absolute path, tried first where it exists; set from encoder
    depth: int = _range(8, 1)  # align the output of this block (1-based; 8 of SiT-XL/2's 28)
    coefficient: float = _range(0.5, 0.0, above=True)  # weight of the alignment loss added to the objective's
    projector_dim: int = _range(2048, 1)  # hidden width of the 3-layer SiLU projector
    input_size: int | None = _range(None, 1)  # the encoder's input side in pixels; None: the size it was built for
    # (its config's img_size: 518 for DINOv2, whose REPA setting is 224 at 256 px and 448 at 512 px)
    mean: list[float] | None = None  # input normalisation; None: the encoder's own (timm pretrained cfg)
    std: list[float] | None = _range(None, 0.0, above=True)  # input normalisation; None: the encoder's own

    @property
    def enabled(self) -> bool:
        return self.encoder is not None


@dataclass
class PosthocEMAConfig:
    """Power-function EMA profiles tracked for post-hoc EMA (EDM2; training.power_ema tracks them, training.posthoc_ema
    reconstructs from them; docs/training.md)."""

    sigma_rel: list[float] = field(default_factory=list, metadata={"range": (0.0, 0.2886, True)})  # []: off
    snapshot_every: int = _range(5000, 1)  # steps between stored snapshots (the last step is stored too)
    dtype: str = _choice("float32", "float32", "bfloat16", "float16")  # of the stored snapshots


@dataclass
class TrainConfig:
    """Optimisation: AdamW with an optional linear warm-up, gradient clipping, EMA."""

    global_batch_size: int = _range(MISSING, 1)  # over all processes and accumulation steps
    grad_accum_steps: int = _range(1, 1)  # micro-batches per optimiser step
    max_steps: int = _range(MISSING, 1)  # optimiser steps of the whole run
    lr: float = _range(MISSING, 0.0)  # AdamW learning rate after warm-up
    weight_decay: float = _range(0.0, 0.0)  # AdamW's decoupled weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999], metadata={"range": (0.0, 1.0, False)})  # AdamW
    warmup_steps: int = _range(0, 0)  # linear learning-rate warm-up, then constant; 0: none
    max_grad_norm: float | None = _range(None, 0.0, above=True)  # None: no clipping, the norm is not computed
    ema_decay: float = _range(MISSING, 0.0, 1.0)  # of the EMA weights that exports and samples use
    ema_warmup: bool = False  # decay 1 - (1 + step)^-power, capped at ema_decay
    ema_warmup_power: float = _range(0.75, 0.0, above=True)  # the power of train.ema_warmup
    seed: int = _range(0, 0)  # initial weights, data order, flips and noise
    mixed_precision: str | None = _choice(None, None, "fp32", "fp16", "bf16")  # None: as `accelerate launch` says
    tf32: bool = True  # TF32 matmuls and convolutions on CUDA
    compile: bool = False  # torch.compile the model
    cuda_graph: bool = False  # the step (loss, backward, clipping, AdamW) as one CUDA graph, replayed: one process,
    # grad_accum_steps 1, fp32 or bf16, no REPA; off CUDA it runs eagerly on the same static buffers
    vca_kernel: str = _choice("auto", *VCA_KERNEL_SETTINGS)  # VCA's core in ATen or Triton; auto: Triton on CUDA
    cpu: bool = False  # force CPU processes (gloo), e.g. under torchrun for tests
    repa: RepaConfig = field(default_factory=RepaConfig)
    posthoc_ema: PosthocEMAConfig = field(default_factory=PosthocEMAConfig)


@dataclass
class LogConfig:
    """What is written to the run directory and how often (in optimiser steps)."""

    every: int = _range(100, 1)  # steps between lines of metrics.jsonl and the trackers (loss, grad norm, lr)
    checkpoint_every: int = _range(50_000, 1)  # resume checkpoints (the last one is always written)
    keep_checkpoints: int = _range(2, 1)  # newest resume checkpoints kept (never the one just written)
    export_every: int = _range(0, 0)  # milestone exports in <run>/exports/, never deleted; 0 disables
    sample_every: int = _range(10_000, 0)  # EMA sample grid; 0 disables
    sample_count: int = _range(16, 1)  # images in each sample grid
    sample_sampler: str | None = None  # None: the objective's default sampler
    sample_steps: int | None = _range(None, 1)  # None: the sampler's default
    sample_guidance: float = _range(1.0, 0.0)  # classifier-free guidance scale of the grids; 1: none
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])  # Accelerate's: tensorboard, wandb, ...
    project: str = "vca-diffusion"  # the trackers' project (wandb, comet_ml, mlflow, ...)
    run_name: str | None = None  # wandb's run name; None: the run directory's name
    fid_every: int = _range(0, 0)  # FID of EMA samples against fid_reference; 0 disables
    fid_samples: int = _range(5000, 2)  # a covariance needs 2 samples (2048+ for a comparable FID)
    fid_reference: str | None = None  # .npz with mu and sigma, e.g. VIRTUAL_imagenet256_labeled.npz
    fid_inception: str | None = None  # Inception weights file or "bundled"; None: fid's default lookup
    fid_weights: str = "ema"  # what grids and FID draw from: ema, raw (the trained weights), or sigma_rel=S (a
    # profile of train.posthoc_ema.sigma_rel, its running average)


@dataclass
class RunConfig:
    """Where the run lives; `dir` defaults to results/<config file name>."""

    dir: str | None = None  # None: results/<config file name>


@dataclass
class Config:
    """One experiment."""

    model: ModelSpec = field(default_factory=lambda: ModelSpec(MISSING))  # dit_vca.model_spec
    diffusion: DiffusionSpec = field(default_factory=DiffusionSpec)  # objectives
    transport: TransportSpec = field(default_factory=TransportSpec)  # objectives
    data: DataConfig = field(default_factory=DataConfig)
    vae: VAEConfig = field(default_factory=VAEConfig)
    extract: ExtractConfig = field(default_factory=ExtractConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)
    run: RunConfig = field(default_factory=RunConfig)


# --------------------------------------------------------------------------------------------------
#                                             Loading
# --------------------------------------------------------------------------------------------------


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """Read `path` (a file, or the bare name of a shipped config such as "dit-s2-vca") with its `base:` chain,
    apply `key=value` overrides and validate the result."""
    try:
        path = find_config(path)
    except UnknownConfigError as error:
        raise ConfigError(str(error)) from None
    merged = OmegaConf.structured(Config)
    for source, values in [*_read_chain(path, ()), ("the command line", _parse_overrides(overrides))]:
        _rename_legacy_keys(values, source)
        _check_keys(values, Config, source, prefix="")
        try:
            merged = OmegaConf.merge(merged, values)
        except OmegaConfBaseException as error:
            raise ConfigError(_describe_merge_error(error, source)) from None
    missing = sorted(OmegaConf.missing_keys(merged))
    if missing:
        raise ConfigError(
            f"{path}: no value for {', '.join(missing)} (set them in the file, its base, or on the command line)"
        )
    config: Config = OmegaConf.to_object(merged)
    _check_values(config, prefix="")
    _check_model_name(config.model.name)
    _check_model_heads(config.model)
    _check_block_options(config.model)
    _check_transport(config)
    _check_preview_sampler(config)
    _check_cuda_graph(config)
    if not config.data.in_pixel_space and (config.vae.name is None or config.vae.scale is None):
        raise ConfigError(
            f"{path}: data.source={config.data.source} works in latent space and needs vae.name and vae.scale"
        )
    if config.vae.normalize == "channels" and config.data.source != "latents":
        raise ConfigError(
            f"'vae.normalize' is channels, but data.source={config.data.source}: the per-channel statistics come "
            f"from the extracted latents (data.source=latents, python -m training.latents)"
        )
    if config.vae.name is not None:  # named so that config.yaml works from another folder (generation.vae)
        from generation.vae import vae_source  # imports torch: not needed to read the schema (train.py --help)

        source = vae_source(config.vae.name, config.vae.path)
        config.vae.name, config.vae.path = source.name, source.path
    _check_fid_weights(config)
    if config.train.repa.enabled:
        _check_repa(config)
        repa = config.train.repa  # named so that config.yaml works from another folder (training.encoder_source)
        source = encoder_source(repa.encoder, repa.path)
        repa.encoder, repa.path = source.name, source.path
    if config.run.dir is None:
        config.run.dir = str(Path(DEFAULT_RESULTS_DIR) / path.stem)
    return config


# Keys of configs that earlier code wrote, and their names today: a file or override with the old name loads, with
# one line saying the new name (once per process).
RENAMED_KEYS = {"model.recipe": ("model.blocks", "the block options' preset; the modern recipe is configs/modern.yaml")}
_told_renamed: set[str] = set()


def _rename_legacy_keys(values: DictConfig | dict[str, Any], source: str, tell: bool = True) -> None:
    """Move each key of RENAMED_KEYS in `values` (one source's) to its new name, in place."""
    for old, (new, meaning) in RENAMED_KEYS.items():
        section, old_key = old.split(".")
        new_key = new.split(".")[1]
        node = values.get(section)
        if not isinstance(node, (DictConfig, dict)) or old_key not in node:
            continue
        if new_key in node:
            raise ConfigError(f"{source}: '{old}' and '{new}' are one key (its old and new name): keep '{new}'")
        node[new_key] = node.pop(old_key)
        if tell and old not in _told_renamed:
            _told_renamed.add(old)
            print(f"warning: {source}: '{old}' is now '{new}' ({meaning}): write '{new}'", file=sys.stderr)


# What a resumed run keeps from its checkpoint: the network and its objective, what the data are and the seed that
# orders them. A change of any of these is refused (the weights or the data stream would not fit); everything else
# (optimiser settings, steps, schedules, logging, precision, paths) applies from the resume step on (RESUME_FREE:
# the keys of the sections above that do not change the weights).
RESUME_FIXED = (
    "model",
    "diffusion",
    "transport",
    "data.source",
    "data.image_size",
    "data.num_classes",
    "vae.scale",
    "vae.normalize",
    "train.seed",
)
RESUME_FREE = ("model.gradient_checkpointing",)  # recomputes in backward what the weights give


def resume_conflict(config: Config, saved_yaml: str) -> tuple[str, Any, Any] | None:
    """The first RESUME_FIXED key whose value differs between `config` and a checkpoint's config.yaml, as
    (key, checkpoint's value, this config's value), or None. A key the checkpoint's config does not have (written
    before the key existed) counts with the schema's default, which is what that run used."""
    saved, ours, defaults = yaml.safe_load(saved_yaml), config_to_dict(config), config_to_dict(Config())
    _rename_legacy_keys(saved, "the checkpoint's config.yaml", tell=False)  # the run's own, told when it loaded
    absent = object()

    def at(values: Any, key: str) -> Any:
        for part in key.split("."):
            values = values.get(part, absent) if isinstance(values, dict) else absent
        return values

    def saved_at(key: str) -> Any:
        value = at(saved, key)
        return at(defaults, key) if value is absent else value

    for group in RESUME_FIXED:
        for key in _leaf_keys(at(ours, group), group):
            if key not in RESUME_FREE and saved_at(key) != at(ours, key):
                return key, saved_at(key), at(ours, key)
    return None


def _leaf_keys(value: Any, key: str) -> list[str]:
    if isinstance(value, dict):
        return [leaf for name, item in value.items() for leaf in _leaf_keys(item, f"{key}.{name}")]
    return [key]


def config_to_yaml(config: Config) -> str:
    """The resolved config as YAML (what is stored in the run directory and in each checkpoint)."""
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def config_to_dict(config: Config) -> dict[str, Any]:
    """The resolved config as nested plain dicts (for trackers and JSON)."""
    return dataclasses.asdict(config)


def _read_chain(path: Path, seen: tuple[Path, ...]) -> list[tuple[str, DictConfig]]:
    """(source name, values) for each file of the base chain of `path`, most basic first."""
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"{path}: circular `base:` chain through {' -> '.join(map(str, seen))}")
    if not path.is_file():
        referrer = f" (named as base by {seen[-1]})" if seen else ""
        what = "is a folder, not a file" if path.is_dir() else "does not exist"
        raise ConfigError(f"config file {path} {what}{referrer}")
    try:
        values = OmegaConf.load(path)  # with OmegaConf's limit on YAML alias expansion (a "billion laughs" file)
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML ({_yaml_problem(error)})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (expected a YAML config)") from None
    except OSError as error:
        if error.errno is not None:
            raise ConfigError(f"config file {path} cannot be read ({error.strerror})") from None
        # OmegaConf's answer to a bare number or boolean: "Invalid loaded object type: int"
        raise ConfigError(f"{path}: a bare value ({error}), not a mapping of sections at the top level") from None
    if not isinstance(values, DictConfig):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    bases = values.pop(BASE_KEY, None)
    if isinstance(bases, str):
        bases = [bases]
    if bases is not None and not (isinstance(bases, ListConfig) or isinstance(bases, list)):
        raise ConfigError(f"{path}: `{BASE_KEY}:` must be a file name or a list of file names")
    chain = []
    for base in bases or []:
        chain += _read_chain(path.parent / str(base), seen + (path,))
    return chain + [(str(path), values)]


def _yaml_problem(error: yaml.YAMLError) -> str:
    """`<problem> at line L, column C` of a YAML parse error, in one line."""
    mark = getattr(error, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{getattr(error, 'problem', None) or type(error).__name__}{where}"


def _parse_overrides(overrides: Sequence[str]) -> DictConfig:
    for item in overrides:
        key, sep, _ = item.partition("=")
        if not sep or not key or key.startswith("-"):
            raise ConfigError(f"command-line override {item!r} is not of the form section.key=value")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as error:
        raise ConfigError(f"the command line: cannot parse overrides {list(overrides)}: {error}") from None


def _check_keys(values: DictConfig, schema: type, source: str, prefix: str) -> None:
    """Reject keys that the schema does not have, naming the valid ones."""
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for key in values.keys():
        full_key = f"{prefix}{key}"
        if key not in fields:
            where = f"under '{prefix[:-1]}'" if prefix else "at the top level"
            raise ConfigError(f"{source}: unknown key '{full_key}'; valid keys {where}: {', '.join(fields)}")
        field_type = _field_type(schema, key)
        if dataclasses.is_dataclass(field_type):
            section = values[key]
            if not isinstance(section, DictConfig):
                raise ConfigError(
                    f"{source}: '{full_key}' must be a section of keys "
                    f"({', '.join(f.name for f in dataclasses.fields(field_type))}), got {section!r}"
                )
            _check_keys(section, field_type, source, prefix=f"{full_key}.")


def _describe_merge_error(error: OmegaConfBaseException, source: str) -> str:
    full_key = getattr(error, "full_key", None) or "?"
    expected = _expected_type(full_key)
    value = getattr(error, "msg", str(error)).splitlines()[0]
    return f"{source}: bad value for '{full_key}' (expected {expected}): {value}"


def _expected_type(full_key: str) -> str:
    schema: Any = Config
    for part in full_key.split("."):
        if not dataclasses.is_dataclass(schema) or part not in {f.name for f in dataclasses.fields(schema)}:
            return "a value of the schema's type"
        schema = _field_type(schema, part)
    if typing.get_origin(schema) is None and hasattr(schema, "__name__"):
        return schema.__name__
    return str(schema).replace("typing.", "")


def _field_type(schema: type, name: str) -> Any:
    return typing.get_type_hints(schema)[name]


def _check_values(node: Any, prefix: str) -> None:
    """Check every field against its choices or range, and that those decided by other keys are left null
    (`settings`)."""
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            _check_values(value, prefix=f"{prefix}{f.name}.")
        elif "decided_by" in f.metadata and value is not None:
            raise ConfigError(
                f"'{prefix}{f.name}' is {value!r}, but training sets it from {f.metadata['decided_by']}: leave it null"
            )
        elif "choices" in f.metadata and value not in f.metadata["choices"]:
            choices = ", ".join("null" if c is None else str(c) for c in f.metadata["choices"])
            raise ConfigError(f"'{prefix}{f.name}' is {value!r}; valid choices: {choices}")
        elif "range" in f.metadata and value is not None:
            bounds = f.metadata["range"]
            if not all(_in_range(number, *bounds) for number in (value if isinstance(value, list) else [value])):
                raise ConfigError(f"'{prefix}{f.name}' is {value!r}; expected {describe_range(*bounds)}")


def _in_range(number: float, minimum: float, maximum: float, above: bool) -> bool:
    low_ok = number > minimum if above else number >= minimum
    return math.isfinite(number) and low_ok and number <= maximum


def describe_range(minimum: float, maximum: float, above: bool) -> str:
    low = f"> {minimum:g}" if above else f">= {minimum:g}"
    return f"a finite value {low}" + ("" if maximum == math.inf else f" and <= {maximum:g}")


def _check_repa(config: Config) -> None:
    """The aligned block exists; mean and std agree (the encoder itself is checked by training.repa)."""
    repa = config.train.repa
    depth = config.model.depth or name_size(config.model.name)[0][0]
    if repa.depth > depth:
        raise ConfigError(
            f"'train.repa.depth' is {repa.depth}, but {config.model.name} with model.depth={depth} "
            f"has {depth} blocks; expected 1..{depth}"
        )
    if repa.mean is not None and repa.std is not None and len(repa.mean) != len(repa.std):
        raise ConfigError(f"'train.repa.mean' {repa.mean} and 'train.repa.std' {repa.std} differ in length")


FID_WEIGHTS = ("ema", "raw")  # or "sigma_rel=S"


def fid_weights_profile(setting: str) -> float | None:
    """The sigma_rel that `log.fid_weights` names ("sigma_rel=0.05" -> 0.05), None for ema and raw."""
    if setting in FID_WEIGHTS:
        return None
    return float(setting.removeprefix("sigma_rel="))


def _check_fid_weights(config: Config) -> None:
    """log.fid_weights is ema, raw, or sigma_rel=S with S a tracked post-hoc EMA profile."""
    setting, tracked = config.log.fid_weights, config.train.posthoc_ema.sigma_rel
    expected = f"expected ema, raw or sigma_rel=S with S one of train.posthoc_ema.sigma_rel={tracked}"
    if setting in FID_WEIGHTS:
        return
    try:
        sigma_rel = fid_weights_profile(setting) if setting.startswith("sigma_rel=") else None
    except ValueError:
        sigma_rel = None
    if sigma_rel is None:
        raise ConfigError(f"'log.fid_weights' is {setting!r}; {expected}")
    if not any(math.isclose(sigma_rel, profile, rel_tol=1e-9) for profile in tracked):
        raise ConfigError(f"'log.fid_weights' is {setting!r}, a profile this run does not track; {expected}")


def _check_model_heads(model: ModelSpec) -> None:
    """The width splits into the heads (the backbone checks this too, but only once the data are loaded)."""
    _, preset_width, preset_heads = name_size(model.name)[0]
    width, heads = model.hidden_size or preset_width, model.num_heads or preset_heads
    if width % heads:
        raise ConfigError(
            f"'model.num_heads' is {heads}, but {model.name} with model.hidden_size={width} cannot be split into "
            f"{heads} heads; expected a divisor of {width}"
        )


def _check_block_options(model: ModelSpec) -> None:
    """RoPE needs a head dimension that splits into two axes of channel pairs, whether set or switched on by the
    preset model.blocks."""
    options = model.block_options
    _, width, heads = name_size(model.name)[0]
    head_dim = (model.hidden_size or width) // (model.num_heads or heads)
    if options["rope"] and head_dim % 4:
        raise ConfigError(
            f"'model.rope' needs a head dimension divisible by 4 (rows and columns of channel pairs); "
            f"{model.name} has {head_dim}: change model.hidden_size or model.num_heads, or set model.rope=false"
        )


def _check_transport(config: Config) -> None:
    """The velocity-direction loss compares a predicted velocity with the target's direction."""
    transport = config.transport
    if transport.cosine_loss_weight and transport.prediction != "velocity":
        raise ConfigError(
            f"'transport.cosine_loss_weight' is {transport.cosine_loss_weight:g}, but transport.prediction="
            f"{transport.prediction}: the velocity-direction loss needs transport.prediction=velocity"
        )


def _check_preview_sampler(config: Config) -> None:
    """Where grids or FID are drawn, their sampler is one the model's objective offers, and given steps only where
    it takes them (else the first grid, after the first checkpoint, would fail)."""
    table = SAMPLERS[MODEL_FAMILIES[config.model.name.split("-", 1)[0]].kind]
    log = config.log
    if not (log.sample_every or log.fid_every):
        return
    sampler = log.sample_sampler or table.default
    if sampler not in table.names:
        raise ConfigError(
            f"'log.sample_sampler' is {sampler!r}; {config.model.name}'s objective offers {', '.join(table.names)}"
        )
    if log.sample_steps is not None and table.steps[sampler] is None:
        fixed = ", ".join(name for name in table.names if table.steps[name] is not None)
        raise ConfigError(
            f"'log.sample_steps' is {log.sample_steps}, but log.sample_sampler={sampler}"
            + (" (the default)" if log.sample_sampler is None else "")
            + f" chooses its own steps: set log.sample_steps=null, or a fixed-step sampler ({fixed})"
        )


def _check_cuda_graph(config: Config) -> None:
    """What a captured training step cannot do (training.loop, generation.cuda_graphs): change shape inside a
    step, read the GPU from the host (fp16's loss scaling checks for overflow there), or run more than the step
    (REPA's encoder; one process: the gradients' all-reduce is checked by train.py, which knows the launch)."""
    train = config.train
    if not train.cuda_graph:
        return
    refused = [
        (train.grad_accum_steps != 1, f"train.grad_accum_steps={train.grad_accum_steps}", "1"),
        (train.mixed_precision == "fp16", "train.mixed_precision=fp16", "fp32 or bf16"),
        (train.repa.enabled, f"train.repa.encoder={train.repa.encoder}", "no REPA"),
    ]
    for refuse, setting, expected in refused:
        if refuse:
            raise ConfigError(f"'train.cuda_graph' is true, but {setting}: a captured step needs {expected}")


def _check_model_name(name: str) -> None:
    if name not in all_model_names():
        raise ConfigError(f"'model.name' is {name!r}; valid choices: {', '.join(all_model_names())}")

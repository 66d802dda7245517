"""Representation alignment (REPA; Yu et al., ICLR 2025): the tokens after block `train.repa.depth` of the
model pass through a projector MLP and are pulled towards the patch features of a frozen vision encoder.

    loss = objective loss + coefficient * alignment loss
    alignment loss = mean over patches n of -cos(projector(h_n), f_n)          (per example, then batch mean)

h: the model's tokens after block `depth` for the noisy input; f: the encoder's patch features of the example's
own clean image (the same flip), computed online under no_grad with the encoder frozen in eval mode.

The encoder is a timm Vision Transformer: a timm model name (weights from the Hugging Face cache, or the hub
when online) or a folder written by timm's `save_for_hf(..., safe_serialization=True)` (config.json +
model.safetensors, loaded without unpickling), named in configs so that the name travels (training.encoder_source:
the timm name it is a copy of, or its absolute path, with the folder as a hint tried first). Images in [-1, 1] are
mapped to [0, 1], resized (bicubic) to `input_size` (unset: the size the encoder was built for) and normalised with
the encoder's mean and std (unset: its own), as REPA does for DINOv2 (256 px -> 224).

Grid rule: the encoder's patch grid (Ge x Ge) and the model's token grid (Gm x Gm) must divide one another.
Each model token is matched with the area-weighted mean of the encoder features over the same image region:
for Ge = k Gm the mean of the k x k patches it covers, for Gm = k Ge the feature of the patch that covers it
(`match_grid`). Other ratios would mix patches by fractional overlaps and are refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml
from omegaconf import OmegaConf
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor, nn

from training.config import ConfigError, RepaConfig
from training.encoder_source import ENCODER_CONFIG, ENCODER_WEIGHTS, encoder_copy, encoder_source, folder_spec

PROJECTOR_WEIGHTS = "model_1.safetensors"  # Accelerate's name for the second prepared model (training.build)
STRUCTURAL_KEYS = ("encoder", "depth", "projector_dim")  # what the projector's weights and optimiser state depend on


class EncoderUnavailableError(ConfigError):
    """The alignment encoder cannot be loaded (bad name, missing folder or file, offline without a copy)."""


# --------------------------------------------------------------------------------------------------
#                                     Checks before anything is built
# --------------------------------------------------------------------------------------------------


def check_encoder(repa: RepaConfig) -> None:
    """What `repa` loads (its folder hint where that holds the encoder, else `train.repa.encoder`) is a timm model
    name or a folder in timm's save_for_hf layout (no weights read)."""
    _encoder_folder(encoder_copy(repa.encoder, repa.path))


def check_grids(encoder_grid: int, model_grid: int) -> None:
    """The grid rule of the module docstring: one side must be a whole multiple of the other."""
    if encoder_grid % model_grid and model_grid % encoder_grid:
        raise ConfigError(
            f"the encoder's {encoder_grid}x{encoder_grid} patch grid cannot be matched with the "
            f"model's {model_grid}x{model_grid} token grid (one must divide the other); change "
            f"train.repa.input_size (a multiple of the encoder's patch size)"
        )


def check_repa_resume(saved_config: Path, repa: RepaConfig) -> None:
    """Refuse, in one line, a resume whose REPA settings change what the checkpoint holds (the projector and
    its optimiser state); the coefficient and the encoder's input settings may change and apply at once.

    Encoders are compared by their portable names (`repa` comes from load_config, which names its encoder so): the
    same encoder given by another path, from another folder or through the recorded hint is the same. A run
    written before names travelled recorded the folder as it was given; it is named from the working directory.
    A folder named by its absolute path (one that copies no timm model) is that path: moved, it is another name."""
    try:
        saved = OmegaConf.to_container(OmegaConf.load(saved_config)).get("train", {}).get("repa") or {}
    except (OSError, ValueError, yaml.YAMLError) as error:
        raise ConfigError(f"cannot read {saved_config} to compare REPA settings ({type(error).__name__})") from None
    current = {key: getattr(repa, key) for key in STRUCTURAL_KEYS}
    before = {key: saved.get(key) for key in STRUCTURAL_KEYS}
    if before["encoder"] is not None:
        before["encoder"] = encoder_source(before["encoder"], saved.get("path")).name
    if before["encoder"] is None and current["encoder"] is None:
        return
    changed = [key for key in STRUCTURAL_KEYS if before[key] != current[key]]
    if changed:
        key = changed[0]
        raise ConfigError(
            f"{saved_config.parent} was trained with train.repa.{key}={before[key]!r}, this launch "
            f"has {current[key]!r}: REPA's encoder, depth and projector_dim cannot change on resume "
            f"({_how_to_resume(key, before[key])})"
        )
    if not (saved_config.parent / PROJECTOR_WEIGHTS).is_file():
        raise ConfigError(f"cannot resume from {saved_config.parent}: REPA's projector {PROJECTOR_WEIGHTS} is missing")


def _how_to_resume(key: str, before: object) -> str:
    """What continues a run refused by check_repa_resume: its encoder folder back where it was, when that is what
    changed (an encoder named by a path that is not here), else a new run."""
    if key == "encoder" and isinstance(before, str) and Path(before).is_absolute() and not Path(before).exists():
        return f"its encoder folder {before} is not on this machine: put it back there, or a link to it, to resume"
    return "start a new run.dir"


# --------------------------------------------------------------------------------------------------
#                                              Encoder
# --------------------------------------------------------------------------------------------------


class AlignmentEncoder(nn.Module):
    """A frozen timm ViT that maps images in [-1, 1] (B, c, S, S) to patch features (B, Ge*Ge, D) in float32.

    It stays in eval mode whatever `train()` is called with and holds no trainable parameter.
    """

    def __init__(self, vit: nn.Module, mean: list[float], std: list[float], input_size: int) -> None:
        super().__init__()
        self.vit = vit.eval().requires_grad_(False)
        self.input_size = input_size
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1), persistent=False)

    @property
    def grid(self) -> int:
        return self.vit.patch_embed.grid_size[0]

    @property
    def width(self) -> int:
        return self.vit.embed_dim

    @property
    def in_channels(self) -> int:
        return self.vit.patch_embed.proj.in_channels

    def train(self, mode: bool = True) -> AlignmentEncoder:
        return super().train(False)

    @torch.no_grad()
    def forward(self, images: Tensor) -> Tensor:
        x = (images.float() + 1) / 2  # (B, c, S, S) in [0, 1]
        if x.shape[1] == 1 and self.in_channels == 3:
            x = x.expand(-1, 3, -1, -1)  # grey -> RGB
        if x.shape[-1] != self.input_size:
            x = F.interpolate(x, size=(self.input_size, self.input_size), mode="bicubic", align_corners=False)
        x = (x - self.mean) / self.std  # (B, C, s, s)
        tokens = self.vit.forward_features(x)  # (B, prefix + Ge*Ge, D)
        return tokens[:, self.vit.num_prefix_tokens :].float()  # (B, Ge*Ge, D)


def load_encoder(
    repa: RepaConfig, image_channels: int, model_grid: int, device: torch.device | str | None = None
) -> AlignmentEncoder:
    """The encoder of `repa` (its folder hint where that holds the encoder, else `train.repa.encoder`: a folder or a
    timm name), checked against the images it will see and the model's token grid."""
    spec = encoder_copy(repa.encoder, repa.path)
    folder = _encoder_folder(spec)
    vit = _load_local(folder) if folder is not None else _load_named(spec, repa.path)
    if not all(hasattr(vit, name) for name in ("patch_embed", "num_prefix_tokens", "set_input_size")):
        raise EncoderUnavailableError(
            f"train.repa.encoder={repa.encoder} is a {type(vit).__name__}, not a timm "
            f"Vision Transformer with patch tokens"
        )
    patch = vit.patch_embed.patch_size[0]
    input_size = repa.input_size or vit.patch_embed.img_size[0]  # unset: the size the encoder was built for
    if input_size % patch:
        raise ConfigError(
            f"'train.repa.input_size' is {input_size}; expected a multiple of the encoder's patch size {patch}"
        )
    vit.set_input_size(img_size=(input_size, input_size))  # resamples the position embeddings
    channels = vit.patch_embed.proj.in_channels
    if image_channels != channels and not (image_channels == 1 and channels == 3):
        raise ConfigError(
            f"train.repa.encoder={repa.encoder} takes {channels}-channel images, the data has {image_channels}"
        )
    check_grids(vit.patch_embed.grid_size[0], model_grid)
    mean = repa.mean if repa.mean is not None else _channels(vit.pretrained_cfg.get("mean"), channels, "mean")
    std = repa.std if repa.std is not None else _channels(vit.pretrained_cfg.get("std"), channels, "std")
    if len(mean) != channels or len(std) != channels:
        raise ConfigError(
            f"'train.repa.mean'/'train.repa.std' have {len(mean)}/{len(std)} values, the encoder "
            f"takes {channels} channels"
        )
    return AlignmentEncoder(vit, list(mean), list(std), input_size).to(device)


def _channels(values, channels: int, name: str) -> list[float]:
    if values is None:
        raise ConfigError(f"the encoder's config names no input {name}; set train.repa.{name}=[...]")
    values = list(values)
    return values * channels if len(values) == 1 else values


def _encoder_folder(spec: str) -> Path | None:
    """The local folder `spec` names (a folder, or the model.safetensors in it), or None for a timm name."""
    import timm

    path, folder = Path(spec).expanduser(), Path(folder_spec(spec)).expanduser()
    if folder.is_dir():
        for name in (ENCODER_CONFIG, ENCODER_WEIGHTS):
            if not (folder / name).is_file():
                raise EncoderUnavailableError(
                    f"encoder folder {folder} has no {name}; expected a folder written by "
                    f"timm.models.save_for_hf(model, folder, safe_serialization=True)"
                )
        return folder
    if spec.startswith((".", "/", "~")) or "/" in spec or path.suffix == ".safetensors":
        raise EncoderUnavailableError(
            f"train.repa.encoder={spec}: no such folder or file (set train.repa.encoder=FOLDER to where the "
            f"encoder is on this machine)"
        )
    if not timm.is_model(spec):
        raise EncoderUnavailableError(
            f"train.repa.encoder={spec} is neither a folder nor a timm model name "
            f"(such as vit_base_patch14_dinov2.lvd142m)"
        )
    return None


def _load_local(folder: Path) -> nn.Module:
    import timm

    try:
        description = json.loads((folder / ENCODER_CONFIG).read_text())
        architecture, arguments = description["architecture"], description.get("model_args", {})
        vit = timm.create_model(
            architecture, pretrained=False, **arguments, pretrained_cfg_overlay=description.get("pretrained_cfg", {})
        )
        vit.load_state_dict(load_file(folder / ENCODER_WEIGHTS), strict=True)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError) as error:
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise EncoderUnavailableError(f"cannot load the encoder in {folder} ({first_line})") from None
    return vit


def _load_named(name: str, hint: str | None) -> nn.Module:
    """The timm model `name` with its pretrained weights (the Hugging Face cache, else the hub); `hint`, a recorded
    local copy that is not here, is named in the error."""
    import timm

    folder = f"encoders/{name}"
    how_to = (
        f'To provide it, on a machine with internet run  python -c "import timm; from timm.models import '
        f"save_for_hf; save_for_hf(timm.create_model('{name}', pretrained=True), '{folder}', "
        f'safe_serialization=True)"  copy the folder here and set train.repa.encoder={folder}'
    )
    try:
        return timm.create_model(name, pretrained=True)
    except (OSError, RuntimeError, ValueError) as error:  # offline without a cached copy: LocalEntryNotFoundError
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        missing_copy = f" (its local copy {hint} is not on this machine)" if hint is not None else ""
        raise EncoderUnavailableError(
            f"encoder '{name}'{missing_copy} is not available ({reason[:200]}). {how_to}"
        ) from None


# --------------------------------------------------------------------------------------------------
#                                    Grid, projector, loss, training step
# --------------------------------------------------------------------------------------------------


def match_grid(features: Tensor, model_grid: int) -> Tensor:
    """Encoder features (B, Ge*Ge, D) on the model's grid (B, Gm*Gm, D) by the rule of the module docstring.

    With whole ratios, adaptive average pooling is exactly that rule: its bins are the k x k patches under a
    token (Ge = k Gm) or the one patch over it (Gm = k Ge)."""
    batch, count, width = features.shape
    encoder_grid = int(round(count**0.5))
    check_grids(encoder_grid, model_grid)
    if encoder_grid == model_grid:
        return features
    maps = features.transpose(1, 2).reshape(batch, width, encoder_grid, encoder_grid)  # (B, D, Ge, Ge)
    return F.adaptive_avg_pool2d(maps, model_grid).flatten(2).transpose(1, 2)  # (B, Gm*Gm, D)


def build_projector(hidden_size: int, projector_dim: int, feature_width: int) -> nn.Sequential:
    """REPA's projector: Linear, SiLU, Linear, SiLU, Linear (xavier-uniform weights, zero biases, as the model's
    own linears), from the model's width to the encoder's."""
    projector = nn.Sequential(
        nn.Linear(hidden_size, projector_dim),
        nn.SiLU(),
        nn.Linear(projector_dim, projector_dim),
        nn.SiLU(),
        nn.Linear(projector_dim, feature_width),
    )
    for layer in projector:
        if isinstance(layer, nn.Linear):
            nn.init.xavier_uniform_(layer.weight)
            nn.init.zeros_(layer.bias)
    return projector


def alignment_loss(projected: Tensor, features: Tensor) -> Tensor:
    """Per-example negative cosine similarity averaged over patches: (B, N, D) x 2 -> (B,).

    Both sides are normalised in float32: in float16 the squared norms of wide features overflow (REPA #46)."""
    cosine = (F.normalize(projected.float(), dim=-1) * F.normalize(features.float(), dim=-1)).sum(-1)  # (B, N)
    return -cosine.mean(-1)


class RepresentationAlignment:
    """The REPA part of a training step: the encoder's targets and the two losses of one micro-batch."""

    def __init__(self, encoder: AlignmentEncoder, projector: nn.Module, repa: RepaConfig, model_grid: int) -> None:
        self.encoder = encoder
        self.projector = projector  # trained (prepared by Accelerate with the model)
        self.depth = repa.depth
        self.coefficient = repa.coefficient
        self.model_grid = model_grid

    def targets(self, images: Tensor) -> Tensor:
        """Encoder features of the clean images on the model's grid: (B, c, S, S) -> (B, Gm*Gm, D)."""
        return match_grid(self.encoder(images), self.model_grid)

    def losses(
        self,
        objective_losses: Callable[..., dict[str, Tensor]],
        model: nn.Module,
        x: Tensor,
        y: Tensor,
        targets: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """(objective loss (B,), alignment loss (B,)) of one forward pass of `model`.

        `objective_losses` is the objective's `training_losses`; the model is called through a function that
        also keeps the tokens after block `depth`, so DiT's and SiT's objectives work unchanged."""
        kept = []

        def model_fn(x_t: Tensor, t: Tensor, labels: Tensor) -> Tensor:
            output, hidden = model(x_t, t, labels, hidden_after=self.depth)  # (B, out, H, W), (B, N, C)
            kept.append(hidden)
            return output

        objective = objective_losses(model_fn, x, y)["loss"]  # (B,)
        return objective, alignment_loss(self.projector(kept[0]), targets)  # (B,), (B,)

"""The export: everything generation needs from a trained model, in a folder of two files.

    export/
        ema.safetensors   EMA weights, float32
        config.json       the ExportDescription below, as JSON

Training writes one into every checkpoint (`<run>/checkpoints/step-XXXXXXX/export/`); official DiT/SiT
`.pt` files become one through `generation.official`; `Export` moves one to and from the Hugging Face Hub.
Nothing here unpickles: weights are safetensors, the description is JSON.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import ModelCard, ModelHubMixin
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from atomic_files import atomic_output, write_json_atomic
from commands import UserError
from dit_vca.model_spec import ModelSpec
from generation.run_layout import CHECKPOINTS_FOLDER, EXPORT_FOLDER, STEP_PREFIX, TRAINER_STATE, list_checkpoints
from generation.vae import LatentNormalization
from objectives import ObjectiveSpec, objective_from_record, objective_record

EXPORT_WEIGHTS = "ema.safetensors"
EXPORT_CONFIG = "config.json"
# 5: the model record is a ModelSpec (its preset `blocks`; `vca` a section for either attention); 4: latent_mean,
# latent_std, class_names; 3: vae_path; 2 to 4 are read as 5 without what they lack
FORMAT_VERSION = 5
SPACES = ("pixels", "latents")


MODEL_CARD = """---
{{ card_data }}
---

# {{ title }}

A class-conditional image generator exported by the VCA diffusion project (`generation.export`): `ema.safetensors`
holds the EMA weights, `config.json` the description that rebuilds the network.

{{ facts }}

Sample with `python sample.py --ckpt <this repository id> --num-samples 50000 --out samples.npz`, or in Python with
`generation.load_export` and `ImageGenerator.from_export`.
"""


def _settings(spec: ObjectiveSpec) -> str:
    return ", ".join(f"{key} {value}" for key, value in asdict(spec).items())


class ExportError(UserError):
    """An export folder or file that is missing, incomplete or unreadable (the message names the file)."""


@dataclass(frozen=True)
class ExportDescription:
    """What rebuilds the network and turns its outputs into images.

    `space` says where the model works: "pixels" (its outputs are images in [-1, 1]) or "latents" (its
    outputs, divided by `latent_scale`, are decoded by the autoencoder `vae`: its hub id where one is known, else
    the absolute path of its folder, with `vae_path`, the absolute local folder training loaded it from, as a hint
    tried first where it exists (generation.portable).
    """

    model: ModelSpec  # the network, every setting decided (ModelSpec.resolved): dit_vca.models.DiT(model)
    objective: ObjectiveSpec  # objectives.DiffusionSpec or TransportSpec (objective_builder.create_objective)
    space: str  # "pixels" | "latents"
    image_size: int  # side of the generated images in pixels
    num_classes: int
    vae: str | None = None  # latents only
    vae_path: str | None = None  # latents only, where the VAE was a local folder
    latent_scale: float | None = None  # latents only
    latent_mean: list[float] | None = None  # latents only, per channel, where the latents were normalised by their
    latent_std: list[float] | None = None  # statistics (generation.vae.LatentNormalization); None: scale only
    train_step: int | None = None  # optimiser steps behind the weights, when known
    source: str | None = None  # where the weights came from, for an export not written by training
    posthoc_ema: dict[str, Any] | None = None  # a post-hoc EMA reconstruction's sigma_rel, step and snapshots
    class_names: list[str] | None = None  # of the training data's classes, where it had names (an image folder's)

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", self.model.resolved())  # the record names the network it holds
        if self.space not in SPACES:
            raise ValueError(f"export space must be one of {SPACES}, got {self.space!r}")
        if self.space == "latents" and (self.vae is None or self.latent_scale is None):
            raise ValueError("an export in latent space needs vae and latent_scale")
        if self.latent_mean is not None or self.latent_std is not None:
            channels = self.latent_normalization.channels  # checks that both are given, of one length
            if self.space != "latents" or channels != self.channels:
                raise ValueError(
                    f"latent_mean and latent_std ({channels} channels) need space 'latents' and one value per "
                    f"channel of the model ({self.channels})"
                )

    @property
    def in_pixel_space(self) -> bool:
        return self.space == "pixels"

    @property
    def latent_normalization(self) -> LatentNormalization:
        """The map from VAE latents to the model's inputs (latent space only)."""
        statistics = None if self.latent_mean is None else (tuple(self.latent_mean), tuple(self.latent_std))
        return LatentNormalization(self.latent_scale, *(statistics or ()))

    @property
    def channels(self) -> int:
        """Channels of what the model generates (model.in_channels)."""
        return self.model.in_channels

    @property
    def has_null_class(self) -> bool:
        """Trained with label dropout, so classifier-free guidance is possible."""
        return self.model.class_dropout_prob > 0

    def located_in(self, folder: str | Path) -> ExportDescription:
        """This description as read from the export `folder`: a relative local path in `vae` or `vae_path` (written
        by hand; training writes absolute ones) names a folder relative to the export, not to the working
        directory, and becomes absolute. `vae` counts as a path when it starts with "." or names a folder there;
        otherwise it is a hub id ("owner/name")."""
        base = Path(folder).resolve()
        located = {}
        for key in ("vae", "vae_path"):
            value = getattr(self, key)
            if value is None or Path(value).expanduser().is_absolute():
                continue
            if key == "vae_path" or value.startswith(".") or (base / value).is_dir():
                located[key] = str((base / value).resolve())
        return replace(self, **located)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT_VERSION, **asdict(self), "objective": objective_record(self.objective)}

    @classmethod
    def from_json(cls, values: dict[str, Any]) -> ExportDescription:
        """Read the current layout or an earlier one: the first had a "data" section with "kind"; the model and
        objective records of every format are read by ModelSpec.from_record and objectives.objective_from_record."""
        values = dict(values)
        if "format" not in values and "data" not in values:  # neither this layout nor the first one
            raise ValueError(f'no "format" key; expected one with a whole number from 1 to {FORMAT_VERSION}')
        version = values.pop("format", 1)
        whole = isinstance(version, int) and not isinstance(version, bool)  # "3" or 3.0: written by hand
        if whole and version > FORMAT_VERSION:
            raise ValueError(f"export format {version} is newer than this code understands ({FORMAT_VERSION})")
        if not whole or version < 1:
            raise ValueError(f'"format" is {json.dumps(version)}; expected a whole number from 1 to {FORMAT_VERSION}')
        if version == 1:
            data = values.pop("data")
            values.update(
                space=data["kind"],
                image_size=data["image_size"],
                num_classes=data["num_classes"],
                vae=data.get("vae"),
                latent_scale=data.get("latent_scale"),
            )
        values.update(
            model=ModelSpec.from_record(values["model"]), objective=objective_from_record(values["objective"])
        )
        return cls(**values)


@dataclass
class Export(ModelHubMixin, library_name="vca-diffusion", tags=["diffusion", "visual-contrast-attention"]):
    """An export in memory: its description and EMA weights. `save_pretrained`, `from_pretrained` (a local
    folder or a hub id) and `push_to_hub` come from huggingface_hub's ModelHubMixin."""

    description: ExportDescription
    weights: dict[str, torch.Tensor] = field(repr=False)

    def _save_pretrained(self, save_directory: Path) -> None:
        write_export(save_directory, self.weights, self.description)

    def generate_model_card(self, *args: Any, **kwargs: Any) -> ModelCard:
        """The README.md that `save_pretrained` and `push_to_hub` write: what the export's description says (the
        mixin's own card is a template of empty fields)."""
        description, model = self.description, self.description.model
        sizes = f"depth {model.depth}, width {model.hidden_size}, {model.num_heads} heads"
        facts = [
            f"- Model: {model.name} ({sizes}), attention: {model.attention}",
            f"- Objective: {description.objective.kind} ({_settings(description.objective)})",
            f"- Generates: {description.image_size} px images of {description.num_classes} classes, "
            + ("in pixel space" if description.in_pixel_space else f"in the latent space of the VAE {description.vae}"),
        ]
        if not description.in_pixel_space:
            facts.append(f"- Latent scale: {description.latent_scale:g}")
            if description.latent_mean is not None:
                facts.append("- Latents normalised per channel by the mean and std in config.json")
        if description.train_step is not None:
            facts.append(f"- EMA weights after {description.train_step:,} optimiser steps")
        if description.source is not None:
            facts.append(f"- Converted from: {description.source}")
        return ModelCard.from_template(
            card_data=self._hub_mixin_info.model_card_data,
            template_str=MODEL_CARD,
            title=f"{model.name} with {model.attention.upper()} attention",
            facts="\n".join(facts),
            **kwargs,
        )

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | Path, **kwargs: Any) -> Export:
        """A local export, checkpoint or run folder (read here: the mixin would look for a config.json at the
        top of a run folder and print that it found none), else a Hugging Face Hub id ("owner/name")."""
        if Path(pretrained_model_name_or_path).is_dir():
            return read_export(pretrained_model_name_or_path)
        return super().from_pretrained(pretrained_model_name_or_path, **kwargs)

    @classmethod
    def _from_pretrained(
        cls,
        *,
        model_id: str,
        revision: str | None,
        cache_dir: str | Path | None,
        force_download: bool,
        local_files_only: bool,
        token: str | bool | None,
        **unused: Any,
    ) -> Export:
        from huggingface_hub import hf_hub_download

        files = [
            hf_hub_download(
                repo_id=model_id,
                filename=name,
                revision=revision,
                cache_dir=cache_dir,
                force_download=force_download,
                local_files_only=local_files_only,
                token=token,
            )
            for name in (EXPORT_CONFIG, EXPORT_WEIGHTS)
        ]
        return read_export(Path(files[0]).parent)


def write_export(folder: str | Path, weights: dict[str, torch.Tensor], description: ExportDescription) -> None:
    """Write the weights (as float32) and the description into `folder`, each file atomically."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_output(folder / EXPORT_WEIGHTS) as temporary:
        save_file({key: value.detach().float().cpu().contiguous() for key, value in weights.items()}, temporary)
    write_json_atomic(folder / EXPORT_CONFIG, description.to_json())


def find_export(path: str | Path) -> Path:
    """The export folder of an export folder, a checkpoint folder, or a run directory (its newest complete
    checkpoint, generation.run_layout.list_checkpoints)."""
    path = Path(path)
    candidates = [path, path / EXPORT_FOLDER]
    checkpoints = list_checkpoints(path / CHECKPOINTS_FOLDER)  # complete ones only
    if checkpoints:
        candidates.append(checkpoints[-1] / EXPORT_FOLDER)
    for candidate in candidates:
        if (candidate / EXPORT_CONFIG).is_file() and (candidate / EXPORT_WEIGHTS).is_file():
            return candidate
    incomplete = f"{STEP_PREFIX}*/{EXPORT_FOLDER}/{EXPORT_CONFIG}"  # the exports of incomplete checkpoints
    exports = sorted((path / CHECKPOINTS_FOLDER).glob(incomplete))
    hint = f" ({exports[-1].parent} is in a checkpoint without {TRAINER_STATE}: pass it itself)" if exports else ""
    raise ExportError(
        f"no export at {path}: expected {EXPORT_WEIGHTS} and {EXPORT_CONFIG} in it, in its "
        f"{EXPORT_FOLDER}/ folder, or in the newest complete checkpoint of a run directory{hint}"
    )


def read_description(folder: str | Path) -> ExportDescription:
    """The description of an export folder (cheap: no weights are read)."""
    path = Path(folder) / EXPORT_CONFIG
    try:
        return ExportDescription.from_json(json.loads(path.read_text())).located_in(folder)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ExportError(f"{path} is not valid JSON ({error}); the export is damaged") from None
    except (KeyError, TypeError, ValueError) as error:
        raise ExportError(f"{path} is not an export description ({type(error).__name__}: {error})") from None


def read_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """The EMA weights of an export folder; weights that are NaN or infinite are refused here, before sampling
    starts or anything is written (they could only give NaN images)."""
    path = Path(folder) / EXPORT_WEIGHTS
    try:
        weights = load_file(path)
    except (SafetensorError, OSError) as error:
        raise ExportError(f"{path} cannot be read as safetensors ({error}); the export is damaged") from None
    for key, value in weights.items():
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise ExportError(f"{path}: weight {key!r} holds NaN or infinite values; export an earlier checkpoint")
    return weights


def read_export(path: str | Path) -> Export:
    """The export at `path` (an export folder, a checkpoint folder or a run directory)."""
    folder = find_export(path)
    return Export(read_description(folder), read_weights(folder))

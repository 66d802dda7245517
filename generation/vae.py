"""The autoencoder (diffusers `AutoencoderKL`: the Stable-Diffusion VAEs, or any other latent channel count and
downsampling, e.g. a 32-channel f16 one): loading, encoding and decoding.

Latents seen by the model are `scale * z` with z drawn from the encoder's posterior, or `scale * (z - mean) / std`
per channel where the latents' statistics are used (`LatentNormalization`); `scale` comes from the config (0.18215
for the SD VAEs), the statistics from the extracted latents (training.latents), never from a constant here.

A VAE is named so that the name travels between folders and machines (generation.portable): by its hub id where
one is known, also for a local folder (diffusers' `save_pretrained` keeps the id it was loaded from in the folder's
config.json), with the folder's absolute path as a hint that is tried first where it exists. diffusers is imported
only when a VAE is loaded: a command that checks its arguments or config never pays for it.
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from commands import UserError
from generation.portable import PortableSource, local_copy, portable_source

if TYPE_CHECKING:
    from diffusers import AutoencoderKL

# The SD 1.x autoencoder (also sd-vae-ft-ema / -mse): used to build a randomly initialised twin for
# benchmarks, so throughput can be measured without downloading the weights.
SD_VAE_ARCHITECTURE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(128, 256, 512, 512),
    layers_per_block=2,
    latent_channels=4,
    norm_num_groups=32,
)


@dataclass(frozen=True)
class LatentNormalization:
    """How VAE latents z (B, C, h, w) become what the model sees, x = scale · (z − mean_c) / std_c, and back.

    Without statistics (mean and std None) it is the SD VAEs' x = scale · z. With them (LightningDiT's latent
    normalisation, for autoencoders whose channels differ in offset and spread), every channel enters the model
    centred and of similar spread; an export stores them, since sampling must invert the same map."""

    scale: float
    mean: tuple[float, ...] | None = None  # per channel
    std: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if (self.mean is None) != (self.std is None) or (self.mean is not None and len(self.mean) != len(self.std)):
            raise ValueError(f"latent mean {self.mean} and std {self.std} must both be given, one value per channel")

    @property
    def channels(self) -> int | None:
        """The channel count the statistics are for, or None (any)."""
        return None if self.mean is None else len(self.mean)

    def _per_channel(self, values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
        return torch.tensor(values, dtype=like.dtype, device=like.device).view(-1, 1, 1)  # (C, 1, 1)

    def to_model(self, z: torch.Tensor) -> torch.Tensor:
        """Model-space latents of VAE latents: (..., C, h, w) -> (..., C, h, w)."""
        if self.mean is not None:
            z = (z - self._per_channel(self.mean, z)) / self._per_channel(self.std, z)
        return self.scale * z

    def log_abs_det(self, channels: int, pixels: int) -> float:
        """log |det| of the Jacobian of `to_model` on latents of `channels` channels of `pixels` (h · w) pixels each:
        h w Σ_c log(scale / std_c), or C h w log(scale) without statistics. A density of the model's inputs x is
        one of the VAE's latents z times exp(this): -log p(z) = -log p(x) - log |det|."""
        if self.std is None:
            return channels * pixels * math.log(self.scale)
        if len(self.std) != channels:
            raise ValueError(f"statistics of {len(self.std)} channels for latents of {channels}")
        return pixels * sum(math.log(self.scale / std) for std in self.std)

    def from_model(self, x: torch.Tensor) -> torch.Tensor:
        """VAE latents of model-space latents (..., C, h, w): the inverse of `to_model`."""
        z = x / self.scale
        if self.mean is not None:
            z = z * self._per_channel(self.std, z) + self._per_channel(self.mean, z)
        return z


HUB_PROBE_SECONDS = 5.0  # one request to the hub's API before downloading (the downloads retry with back-off)


class VAEUnavailableError(UserError):
    """The requested autoencoder cannot be loaded (missing folder, or offline without a cached copy)."""


def vae_source(spec: str, hint: str | None = None) -> PortableSource:
    """The portable name of what `spec` (a hub id or a local folder, relative to the working directory) names.

    A local folder is named by the hub id in its config.json (`_name_or_path`, which diffusers' save_pretrained
    writes as the id the VAE was loaded from), else by its absolute path; its absolute path becomes the hint. For a
    hub id, a recorded `hint` is kept unless it is a folder here that names another VAE."""
    return portable_source(spec, hint, _recorded_hub_id)


def load_vae(
    spec: str, device: torch.device | str | None = None, hint: str | None = None, option: str = "vae.name"
) -> AutoencoderKL:
    """A frozen AutoencoderKL from a local folder (written by `save_pretrained`) or a hub id.

    `hint` (a `PortableSource.path`) is loaded first when it exists and is the VAE `spec` names. A hub id is looked
    up in the local Hugging Face cache next; the network is only tried when the hub is not marked offline
    (HF_HUB_OFFLINE=1), and only once one request to the hub has answered, so offline runs fail at once, naming
    the cause and `option`, the setting that chooses another VAE in the call that was made: vae.name for training,
    --vae for sample.py, a function's argument such as "ImageGenerator.from_export(vae)" from Python (`_setting`).
    """
    spec = local_copy(spec, hint, _recorded_hub_id)
    folder = Path(spec).expanduser()
    if folder.is_dir():
        vae = _load_folder(folder)
    elif _looks_like_path(spec):
        raise VAEUnavailableError(
            f"VAE folder {folder} does not exist; set {_setting(option, 'a VAE folder or hub id')}"
        )
    else:
        vae = _load_from_hub(spec, option, hint)
    return vae.eval().requires_grad_(False).to(device)


def _load_folder(folder: Path) -> AutoencoderKL:
    from diffusers import AutoencoderKL

    if not (folder / "config.json").is_file():
        raise VAEUnavailableError(
            f"VAE folder {folder} has no config.json; expected a folder written by AutoencoderKL.save_pretrained"
        )
    try:
        return AutoencoderKL.from_pretrained(folder)
    except (OSError, ValueError, RuntimeError) as error:  # missing or cut weights, a config of another model
        raise VAEUnavailableError(
            f"VAE folder {folder} cannot be loaded ({_first_line(error)}); expected a folder "
            f"written by AutoencoderKL.save_pretrained"
        ) from None


def _recorded_hub_id(folder: Path) -> str | None:
    """The hub id a saved VAE folder says it was loaded from, or None (saved from a folder, or made here)."""
    try:
        recorded = json.loads((folder / "config.json").read_text()).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None  # loading the folder names what is wrong with it
    if not isinstance(recorded, str) or _looks_like_path(recorded) or Path(recorded).expanduser().exists():
        return None
    return recorded if recorded.count("/") == 1 else None


def _setting(option: str, value: str) -> str:
    """How a user sets `option` to `value`: `--vae VALUE` on a command line, `vae.name=VALUE` as an override,
    `ImageGenerator.from_export(vae='VALUE')` for the argument "ImageGenerator.from_export(vae)" of a Python call."""
    if option.startswith("--"):
        return f"{option} {value}"
    if option.endswith(")"):
        function, _, argument = option[:-1].partition("(")
        return f"{function}({argument}={value!r})"
    return f"{option}={value}"


def latent_downsampling(vae_config: Mapping) -> int:
    """Pixels per latent cell along each side (8 for the SD VAEs), from `vae.config` or an architecture dict."""
    return 2 ** (len(vae_config["block_out_channels"]) - 1)


@torch.no_grad()
def encode_posterior(vae: AutoencoderKL, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and standard deviation of q(z | image) for images in [-1, 1]: (B, 3, H, W) -> 2 x (B, C, H/f, W/f)
    (C = vae.config.latent_channels, f = latent_downsampling)."""
    posterior = vae.encode(images).latent_dist
    return posterior.mean, posterior.std


@torch.no_grad()
def decode_latents(vae: AutoencoderKL, latents: torch.Tensor, normalization: LatentNormalization) -> torch.Tensor:
    """Images in [-1, 1] from model-space latents (B, C, h, w) -> (B, 3, f·h, f·w)."""
    return vae.decode(normalization.from_model(latents)).sample.clamp(-1, 1)


def _looks_like_path(spec: str) -> bool:
    # Hub ids are "name" or "owner/name"; anything else that is not an existing folder is a missing path.
    return spec.startswith((".", "/", "~")) or spec.count("/") > 1


def _hub_offline() -> bool:
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}
    return flag or bool(constants.HF_HUB_OFFLINE)


def _load_from_hub(repo_id: str, option: str, hint: str | None) -> AutoencoderKL:
    try:
        return _from_hub(repo_id, local_files_only=True)
    except OSError:
        pass  # not cached: download below, unless offline
    copy = f"vae/{repo_id.split('/')[-1]}"
    how_to = (
        f"To provide it, on a machine with internet run "
        f'`python -c "from diffusers import AutoencoderKL; '
        f"AutoencoderKL.from_pretrained('{repo_id}').save_pretrained('{copy}')\"`, "
        f"copy the folder here and set {_setting(option, copy)} "
        f"(or copy the Hugging Face cache into $HF_HOME)."
    )
    missing_copy = f" (its local copy {hint} is not on this machine)" if hint is not None else ""
    if _hub_offline():
        raise VAEUnavailableError(
            f"VAE '{repo_id}'{missing_copy} is not in the local Hugging Face cache and the hub is "
            f"offline (HF_HUB_OFFLINE=1). {how_to}"
        )
    _probe_hub(repo_id, how_to, option)
    try:
        return _from_hub(repo_id)
    except OSError as error:
        raise VAEUnavailableError(f"VAE '{repo_id}' could not be downloaded ({error}). {how_to}") from error


def _from_hub(repo_id: str, **options) -> AutoencoderKL:
    """AutoencoderKL.from_pretrained of a hub id, without huggingface_hub's deprecation warning: diffusers (0.42)
    passes the retired `local_dir_use_symlinks` argument to every config download it makes, which the hub
    ignores but warns of at each load, cached or not."""
    from diffusers import AutoencoderKL

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*local_dir_use_symlinks", category=UserWarning)
        return AutoencoderKL.from_pretrained(repo_id, **options)


def _probe_hub(repo_id: str, how_to: str, option: str) -> None:
    """Ask the hub once, with a short timeout, whether `repo_id` exists; raise VAEUnavailableError naming the cause
    when it cannot be reached or has no such model. Without this, diffusers' download of an unreachable hub
    retries with back-off for about 30 s and then reports "no file named config.json"."""
    from huggingface_hub import constants, model_info
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    try:
        model_info(repo_id, timeout=HUB_PROBE_SECONDS)
    except RepositoryNotFoundError:
        raise VAEUnavailableError(
            f"{option} '{repo_id}': {constants.ENDPOINT} has no such model (or it is private and no token is set)"
        ) from None
    except HfHubHTTPError as error:
        raise VAEUnavailableError(
            f"VAE '{repo_id}' is not in the local Hugging Face cache and {constants.ENDPOINT} "
            f"answered {_first_line(error)}. {how_to}"
        ) from None
    except _network_errors() as error:
        raise VAEUnavailableError(
            f"VAE '{repo_id}' is not in the local Hugging Face cache and {constants.ENDPOINT} "
            f"cannot be reached ({type(error).__name__}: {_first_line(error)}); no internet? "
            f"{how_to}"
        ) from None


def _network_errors() -> tuple[type[BaseException], ...]:
    # huggingface_hub < 1.0 uses requests, whose errors are OSErrors; later versions use httpx (or its fork
    # httpx2), whose transport errors derive from its HTTPError: whichever the hub imported is the one raised.
    clients = (sys.modules.get(name) for name in ("httpx", "httpx2"))
    return (OSError, *(client.HTTPError for client in clients if client is not None))


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__


@torch.no_grad()
def sample_latents(vae: AutoencoderKL, images: torch.Tensor, normalization: LatentNormalization) -> torch.Tensor:
    """Model-space latents of z ~ q(z | image), for online encoding: (B, 3, H, W) -> (B, C, H/f, W/f)."""
    return normalization.to_model(vae.encode(images).latent_dist.sample().float())

"""The Stable-Diffusion autoencoder (diffusers `AutoencoderKL`): loading, encoding and decoding.

Latents seen by the model are `scale * z` with z drawn from the encoder's posterior; `scale` comes from the
config (0.18215 for the SD VAEs), never from a constant here.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch
from diffusers import AutoencoderKL

from commands import UserError

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


HUB_PROBE_SECONDS = 5.0  # one request to the hub's API before downloading (the downloads retry with back-off)


class VAEUnavailableError(UserError):
    """The requested autoencoder cannot be loaded (missing folder, or offline without a cached copy)."""


def load_vae(spec: str, device: torch.device | str | None = None) -> AutoencoderKL:
    """A frozen AutoencoderKL from a local folder (written by `save_pretrained`) or a hub id.

    A hub id is looked up in the local Hugging Face cache first; the network is only tried when the hub is
    not marked offline (HF_HUB_OFFLINE=1), and only once one request to the hub has answered, so offline runs
    fail at once, naming the cause, instead of retrying.
    """
    folder = Path(spec).expanduser()
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise VAEUnavailableError(
                f"VAE folder {folder} has no config.json; expected a folder written by AutoencoderKL.save_pretrained"
            )
        try:
            vae = AutoencoderKL.from_pretrained(folder)
        except (OSError, ValueError, RuntimeError) as error:  # missing or cut weights, a config of another model
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise VAEUnavailableError(
                f"VAE folder {folder} cannot be loaded ({first[:300]}); expected a folder "
                f"written by AutoencoderKL.save_pretrained"
            ) from None
    elif _looks_like_path(spec):
        raise VAEUnavailableError(f"VAE folder {folder} does not exist")
    else:
        vae = _load_from_hub(spec)
    return vae.eval().requires_grad_(False).to(device)


def latent_downsampling(vae_config: Mapping) -> int:
    """Pixels per latent cell along each side (8 for the SD VAEs), from `vae.config` or an architecture dict."""
    return 2 ** (len(vae_config["block_out_channels"]) - 1)


@torch.no_grad()
def encode_posterior(vae: AutoencoderKL, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and standard deviation of q(z | image) for images in [-1, 1]: (B, 3, H, W) -> 2 x (B, 4, H/8, W/8)."""
    posterior = vae.encode(images).latent_dist
    return posterior.mean, posterior.std


@torch.no_grad()
def decode_latents(vae: AutoencoderKL, latents: torch.Tensor, scale: float) -> torch.Tensor:
    """Images in [-1, 1] from model-space latents (B, 4, h, w) -> (B, 3, 8h, 8w)."""
    return vae.decode(latents / scale).sample.clamp(-1, 1)


def _looks_like_path(spec: str) -> bool:
    # Hub ids are "name" or "owner/name"; anything else that is not an existing folder is a missing path.
    return spec.startswith((".", "/", "~")) or spec.count("/") > 1


def _hub_offline() -> bool:
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}
    return flag or bool(constants.HF_HUB_OFFLINE)


def _load_from_hub(repo_id: str) -> AutoencoderKL:
    try:
        return _from_hub(repo_id, local_files_only=True)
    except OSError:
        pass  # not cached: download below, unless offline
    how_to = (
        f"To provide it, on a machine with internet run "
        f'`python -c "from diffusers import AutoencoderKL; '
        f"AutoencoderKL.from_pretrained('{repo_id}').save_pretrained('vae/{repo_id.split('/')[-1]}')\"`, "
        f"copy the folder here and set vae.name=vae/{repo_id.split('/')[-1]} "
        f"(or copy the Hugging Face cache into $HF_HOME)."
    )
    if _hub_offline():
        raise VAEUnavailableError(
            f"VAE '{repo_id}' is not in the local Hugging Face cache and the hub is "
            f"offline (HF_HUB_OFFLINE=1). {how_to}"
        )
    _probe_hub(repo_id, how_to)
    try:
        return _from_hub(repo_id)
    except OSError as error:
        raise VAEUnavailableError(f"VAE '{repo_id}' could not be downloaded ({error}). {how_to}") from error


def _from_hub(repo_id: str, **options) -> AutoencoderKL:
    """AutoencoderKL.from_pretrained of a hub id, without huggingface_hub's deprecation warning: diffusers (0.42)
    passes the retired `local_dir_use_symlinks` argument to every config download it makes, which the hub
    ignores but warns of at each load, cached or not."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*local_dir_use_symlinks", category=UserWarning)
        return AutoencoderKL.from_pretrained(repo_id, **options)


def _probe_hub(repo_id: str, how_to: str) -> None:
    """Ask the hub once, with a short timeout, whether `repo_id` exists; raise VAEUnavailableError naming the cause
    when it cannot be reached or has no such model. Without this, diffusers' download of an unreachable hub
    retries with back-off for about 30 s and then reports "no file named config.json"."""
    from huggingface_hub import constants, model_info
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    try:
        model_info(repo_id, timeout=HUB_PROBE_SECONDS)
    except RepositoryNotFoundError:
        raise VAEUnavailableError(
            f"vae.name '{repo_id}': {constants.ENDPOINT} has no such model (or it is private and no token is set)"
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
def sample_latents(vae: AutoencoderKL, images: torch.Tensor, scale: float) -> torch.Tensor:
    """Model-space latents scale * z, z ~ q(z | image), for online encoding: (B, 3, H, W) -> (B, 4, H/8, W/8)."""
    return scale * vae.encode(images).latent_dist.sample().float()

"""Official DiT / SiT checkpoints (`.pt` state dicts) as exports: one converter, a function and a command.

    python -m generation.official DiT-XL-2-256x256.pt --out exports/dit-xl2-256        # by name: downloads once
    python -m generation.official my-sit.pt --model SiT-XL/2 --image-size 256 --out exports/my-sit

`sample.py --ckpt FILE.pt` converts on the fly with the same function. The three released checkpoints can be
named bare (`DiT-XL-2-256x256.pt`, `DiT-XL-2-512x512.pt`, `SiT-XL-2-256x256.pt`): they are downloaded on first
use from the locations the official download scripts use into the torch hub cache
(`$TORCH_HOME/hub/checkpoints/`), through a temporary file that is checked (a state dict with the expected keys
and shapes) before it is renamed. Offline, the error says where to put the file by hand.

The weights go into the MHSA baseline, whose parameter layout is the official one. learn_sigma is read from the
shape of the final layer, for both families: the released SiT-XL/2 was trained with learn_sigma=True (8 output
channels), and SiT uses the first half (the velocity), as the official SiT forward does.
"""

from __future__ import annotations

import argparse
import os
import pickle
import re
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import yaml

from atomic_files import OutputError
from commands import CommandParser, UserError, run_command
from dit_vca.model_spec import ModelSpec, all_model_names, model_family
from dit_vca.models import DiT
from generation.export import Export, ExportDescription, write_export
from generation.objective_builder import default_objective
from objectives import DIFFUSION, MODEL_FAMILIES

# The recipe the official checkpoints were trained with (VAE, latent scale, classes), written down once.
OFFICIAL_RECIPE = Path(__file__).resolve().parents[1] / "configs" / "imagenet256.yaml"
LATENT_DOWNSAMPLING = 8  # the SD VAE maps 8x8 pixels to one latent cell
LATENT_CHANNELS = 4
FILE_NAME_PATTERN = re.compile(r"^(DiT|SiT)-(S|B|L|XL)-(2|4|8)-(\d+)x\d+\.pt$")  # e.g. DiT-XL-2-256x256.pt


@dataclass(frozen=True)
class ReleasedCheckpoint:
    url: str
    model: str
    image_size: int


RELEASED = {
    "DiT-XL-2-256x256.pt": ReleasedCheckpoint(
        "https://dl.fbaipublicfiles.com/DiT/models/DiT-XL-2-256x256.pt", "DiT-XL/2", 256
    ),
    "DiT-XL-2-512x512.pt": ReleasedCheckpoint(
        "https://dl.fbaipublicfiles.com/DiT/models/DiT-XL-2-512x512.pt", "DiT-XL/2", 512
    ),
    # The link of the official SiT download script (its file is SiT-XL-2-256.pt; stored under the DiT-style name).
    "SiT-XL-2-256x256.pt": ReleasedCheckpoint(
        "https://www.dl.dropboxusercontent.com/scl/fi/as9oeomcbub47de5g4be0/SiT-XL-2-256.pt"
        "?rlkey=uxzxmpicu46coq3msb17b9ofa&dl=0",
        "SiT-XL/2",
        256,
    ),
}


class OfficialCheckpointError(UserError):
    """An official checkpoint that is missing, unreadable or does not fit the named model."""


def cache_path(name: str) -> Path:
    """Where a released checkpoint lives once downloaded (torch hub's checkpoint cache)."""
    return Path(torch.hub.get_dir()) / "checkpoints" / name


def is_official_reference(ckpt: str | Path) -> bool:
    """True for a `.pt` file or the bare name of a released checkpoint; a folder is never one, whatever its name
    (an export folder called `run.pt` is an export)."""
    return str(ckpt) in RELEASED or (Path(ckpt).suffix == ".pt" and not Path(ckpt).is_dir())


def official_path(ckpt: str | Path) -> Path:
    """The file of an official checkpoint: the path itself, or a released name's cached file (downloaded first)."""
    return resolve_released(str(ckpt)) if str(ckpt) in RELEASED and not Path(ckpt).is_file() else Path(ckpt)


def architecture_from_name(path: str | Path, model: str | None, image_size: int | None) -> tuple[str, int]:
    """(model name, image size): as given, else read from a file name such as `SiT-XL-2-256x256.pt`."""
    match = FILE_NAME_PATTERN.match(Path(path).name)
    if model is None:
        if match is None:
            raise OfficialCheckpointError(
                f"{path}: name its architecture with --model (one of {', '.join(all_model_names())}); it cannot be "
                f"read from the file name"
            )
        model = f"{match.group(1)}-{match.group(2)}/{match.group(3)}"
    try:
        model_family(model)
    except ValueError:
        raise OfficialCheckpointError(f"--model {model!r}: expected one of {', '.join(all_model_names())}") from None
    if image_size is None:
        image_size = int(match.group(4)) if match else 256
    if image_size % LATENT_DOWNSAMPLING:
        raise OfficialCheckpointError(f"--image-size {image_size}: expected a multiple of {LATENT_DOWNSAMPLING}")
    return model, image_size


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """A plain state dict from `path`, read with weights_only=True (never runs pickled code).

    Accepts what the official repositories write: a bare state dict (released files) or a training checkpoint
    {"model", "ema", "opt", "args"}, whose EMA weights are used.
    """
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):  # the "args" of official training checkpoints
            state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise OfficialCheckpointError(f"{path}: no such file") from None
    except pickle.UnpicklingError as error:
        refused = [line.strip() for line in str(error).splitlines() if "Unsupported global" in line]
        raise OfficialCheckpointError(
            f"{path} is not a plain state dict (read with weights_only=True, which "
            f"refuses to run code){': ' + refused[0] if refused else ''}"
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError) as error:
        raise OfficialCheckpointError(
            f"{path} cannot be read ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else 'truncated'}); "
            f"the file is damaged or incomplete"
        ) from None
    if isinstance(state, dict) and isinstance(state.get("ema"), dict):
        state = state["ema"]
    if not isinstance(state, dict) or not all(isinstance(value, torch.Tensor) for value in state.values()):
        raise OfficialCheckpointError(f"{path} does not hold a state dict of tensors")
    return state


def official_description(model: str, image_size: int, state: dict[str, torch.Tensor], source: str) -> ExportDescription:
    """The export description of an official checkpoint: the MHSA baseline, the family's objective with its
    defaults, the official recipe's VAE, latent scale and classes; learn_sigma read from the final layer."""
    recipe = yaml.safe_load(OFFICIAL_RECIPE.read_text())
    family = model_family(model)
    patch = int(model.rsplit("/", 1)[1])
    try:
        outputs = state["final_layer.linear.weight"].shape[0] // (patch * patch)
    except KeyError:
        raise OfficialCheckpointError(f"{source} has no final_layer.linear.weight: not a DiT/SiT state dict") from None
    if outputs not in (LATENT_CHANNELS, 2 * LATENT_CHANNELS):
        raise OfficialCheckpointError(
            f"{source}: the final layer has {outputs} channels per pixel, which does not fit "
            f"--model {model} ({LATENT_CHANNELS} or {2 * LATENT_CHANNELS} expected)"
        )
    learn_sigma = outputs == 2 * LATENT_CHANNELS
    objective = default_objective(family)
    if MODEL_FAMILIES[family] is DIFFUSION:
        objective = replace(objective, learn_sigma=learn_sigma)
    spec = ModelSpec(
        model,
        attention="mhsa",
        input_size=image_size // LATENT_DOWNSAMPLING,
        in_channels=LATENT_CHANNELS,
        num_classes=recipe["data"]["num_classes"],
        learn_sigma=learn_sigma,
    )
    return ExportDescription(
        model=spec,
        objective=objective,
        space="latents",
        image_size=image_size,
        num_classes=recipe["data"]["num_classes"],
        vae=recipe["vae"]["name"],
        latent_scale=recipe["vae"]["scale"],
        source=source,
    )


def check_fits(description: ExportDescription, state: dict[str, torch.Tensor], source: str) -> None:
    """Every key and shape of the model the description names, and nothing else, on the meta device."""
    with torch.device("meta"):
        model = DiT(description.model)
    expected = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    found = {key: tuple(value.shape) for key, value in state.items()}
    missing, unexpected = sorted(expected.keys() - found.keys()), sorted(found.keys() - expected.keys())
    wrong = sorted(key for key in expected.keys() & found.keys() if expected[key] != found[key])
    if missing or unexpected or wrong:
        details = "; ".join(
            f"{what}: {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}"
            for what, keys in (
                ("missing", missing),
                ("unexpected", unexpected),
                ("other shape", [f"{k} {found[k]} vs {expected[k]}" for k in wrong]),
            )
            if keys
        )
        raise OfficialCheckpointError(
            f"{source} does not fit --model {description.model.name} at --image-size "
            f"{description.image_size} ({details})"
        )


def official_export(ckpt: str | Path, model: str | None = None, image_size: int | None = None) -> Export:
    """An official checkpoint (a `.pt` path or the bare name of a released one) as an in-memory export."""
    path = official_path(ckpt)
    model, image_size = architecture_from_name(path, model, image_size)
    state = load_state_dict(path)
    description = official_description(model, image_size, state, source=str(path))
    check_fits(description, state, str(path))
    return Export(description, state)


def resolve_released(name: str) -> Path:
    """The cached file of a released checkpoint, downloaded first if it is not there yet."""
    target = cache_path(name)
    if target.is_file():
        return target
    release = RELEASED[name]
    temporary = target.with_name(f".{name}.download-{os.getpid()}")  # processes that start together do not collide
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        torch.hub.download_url_to_file(release.url, str(temporary), progress=True)
    except OSError as error:  # URLError, timeouts and refused connections are all OSErrors
        temporary.unlink(missing_ok=True)
        raise OfficialCheckpointError(
            f"cannot download {name} ({error}); offline, fetch {release.url} elsewhere and put it at {target}"
        ) from None
    try:
        state = load_state_dict(temporary)
        model, image_size = release.model, release.image_size
        check_fits(official_description(model, image_size, state, source=release.url), state, release.url)
    except OfficialCheckpointError:
        temporary.unlink(missing_ok=True)
        raise
    temporary.replace(target)
    return target


def main(argv: Sequence[str] | None = None) -> None:
    parser = CommandParser(prog="python -m generation.official", description=__doc__)
    parser.add_argument("ckpt", help=f"an official .pt file, or one of {', '.join(RELEASED)} (downloaded once)")
    parser.add_argument("--out", type=Path, required=True, help="export folder to write (must not exist yet)")
    parser.add_argument("--model", help="architecture, e.g. DiT-XL/2 (default: read from the file name)")
    parser.add_argument("--image-size", type=int, help="image size in pixels (default: from the file name, else 256)")
    args = parser.parse_args(argv)
    write_converted(args.out, lambda: official_export(args.ckpt, args.model, args.image_size))


def write_converted(out: Path, convert: Callable[[], Export]) -> None:
    """A converter command's last steps: refuse an existing `out` (before converting), convert, write the export
    and say what was written."""
    if out.exists():
        raise OutputError(f"--out {out} exists; choose a new folder")
    export = convert()
    write_export(out, export.weights, export.description)
    print(f"wrote {out} ({export.description.model.name}, {export.description.image_size} px)")


def command() -> None:
    """The installed command's entry point (and `python -m generation.official`): one line, exit 2 on a user error."""
    run_command(main)


if __name__ == "__main__":
    command()

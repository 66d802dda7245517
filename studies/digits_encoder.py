"""The offline stand-in for DINOv2 in the REPA digits study: a small timm ViT classifier trained on the digits.

    python -m studies.digits_encoder   # writes studies/digits_encoder/: config.json, model.safetensors, training.json

REPA aligns a diffusion model's tokens with the patch features of a pretrained vision encoder (DINOv2 ViT-B/14 in
the paper). No such encoder for 8x8 digits exists offline, so this trains one once on scikit-learn's digits
themselves: a 4-block, 64-wide ViT (patch 2: a 4x4 patch grid, the same as the digits DiT-S/2's 4x4 tokens),
average-pooled patch tokens into a linear classifier, so the patch tokens are trained to carry the digit's class.
It is far weaker and smaller than DINOv2 and has seen only these 1797 digits: a stand-in that lets the study's
machinery run end to end, not a reproduction of REPA's encoder.

Training: 75 % of the digits (stratified split, seed 0: the split of the digits judge, judges.digits), random
shifts of up to one pixel, AdamW (lr 3e-3 with a cosine decay to 0, weight decay 0.05), batch 64, 100 epochs,
seed 0; the held-out 25 % measure it. The folder is timm's save_for_hf layout, so
`train.repa.encoder=studies/digits_encoder` loads it (training.repa); training.json records the accuracy and the
wall time.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

FOLDER = Path(__file__).resolve().parent / "digits_encoder"
ARCHITECTURE = "vit_tiny_patch16_224"  # timm's ViT family; every size argument is set below
MODEL_ARGS = dict(
    img_size=8, patch_size=2, in_chans=1, embed_dim=64, depth=4, num_heads=4, num_classes=10, global_pool="avg"
)
# Inputs are the digits in [-1, 1]; training.repa maps images to [0, 1] and normalises with these: identity.
NORMALISATION = {"mean": (0.5,), "std": (0.5,)}
EPOCHS, BATCH, LR, WEIGHT_DECAY, SEED = 100, 64, 3e-3, 0.05, 0
HELD_OUT_FRACTION = 0.25


def split_digits(seed: int = SEED) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train images (N, 1, 8, 8) in [-1, 1], train labels, held-out images, held-out labels)."""
    from sklearn.model_selection import train_test_split

    from training.builtin_data import DigitsDataset

    dataset = DigitsDataset()
    indices = np.arange(len(dataset))
    train, test = train_test_split(
        indices, test_size=HELD_OUT_FRACTION, stratify=dataset.labels.numpy(), random_state=seed
    )
    return dataset.images[train], dataset.labels[train], dataset.images[test], dataset.labels[test]


def random_shift(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Each image moved by up to one pixel along each axis (the border filled with the background, -1)."""
    padded = F.pad(images, (1, 1, 1, 1), value=-1.0)  # (B, 1, 10, 10)
    offsets = torch.randint(0, 3, (len(images), 2), generator=generator)
    return torch.stack([padded[i, :, dy : dy + 8, dx : dx + 8] for i, (dy, dx) in enumerate(offsets.tolist())])


def accuracy(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        return float((model(images).argmax(-1) == labels).float().mean())


def train_encoder(epochs: int = EPOCHS, seed: int = SEED) -> tuple[torch.nn.Module, dict]:
    import timm

    torch.manual_seed(seed)
    model = timm.create_model(
        ARCHITECTURE, pretrained=False, **MODEL_ARGS, pretrained_cfg_overlay={**NORMALISATION, "input_size": (1, 8, 8)}
    )
    train_x, train_y, test_x, test_y = split_digits(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    steps_per_epoch = -(-len(train_x) // BATCH)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs * steps_per_epoch)
    generator = torch.Generator().manual_seed(seed)
    started = time.perf_counter()
    for _ in range(epochs):
        model.train()
        order = torch.randperm(len(train_x), generator=generator)
        for start in range(0, len(order), BATCH):
            batch = order[start : start + BATCH]
            loss = F.cross_entropy(model(random_shift(train_x[batch], generator)), train_y[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
    seconds = time.perf_counter() - started
    record = {
        "architecture": ARCHITECTURE,
        "model_args": MODEL_ARGS,
        "epochs": epochs,
        "batch": BATCH,
        "lr": LR,
        "schedule": "cosine to 0 over all steps",
        "weight_decay": WEIGHT_DECAY,
        "seed": seed,
        "train_images": len(train_x),
        "held_out_images": len(test_x),
        "train_accuracy": accuracy(model, train_x, train_y),
        "held_out_accuracy": accuracy(model, test_x, test_y),
        "seconds": round(seconds, 1),
        "parameters": sum(p.numel() for p in model.parameters()),
        "threads": torch.get_num_threads(),
    }
    return model.eval(), record


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m studies.digits_encoder",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=FOLDER, help="the encoder folder to write")
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    args = parser.parse_args(argv)
    import json

    from timm.models import save_for_hf

    from atomic_files import write_text_atomic

    model, record = train_encoder(args.epochs)
    save_for_hf(model, args.out, safe_serialization=True)
    write_text_atomic(args.out / "training.json", json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    return record


if __name__ == "__main__":
    main()

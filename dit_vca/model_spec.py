"""The network's settings, written once: the size table (the names "DiT-S/1" ... "SiT-XL/8" and the depth, width
and heads each stands for) and `ModelSpec`, the one dataclass of every setting of the backbone.

A `ModelSpec` is at once
- the config's `model:` section: training.config reads it with omegaconf and checks each value against its field's
  choices or range (`settings`), and `train.py --help` lists its fields with the comments beside them;
- the export's model record: generation.export writes it as JSON and reads it back with `ModelSpec.from_record`,
  also in the layouts that earlier code wrote;
- the backbone's one argument: `dit_vca.models.DiT(spec)`.

A setting left None is decided elsewhere: the sizes by the name, the block options by the preset `blocks`, the
input and the classes by the data (training sets them from data.*), learn_sigma by the objective; `resolved()`
decides them all, as the backbone does when it is built and as the export records it.

No torch here: training's config schema and the commands' `--help` read these without importing the network.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from objectives import MODEL_FAMILIES
from settings import choice, decided_by, value_range

from .model_options import ATTENTION_KINDS, BLOCK_PRESETS, MLPS, NORMS, VCAOptions

MODEL_SIZES = {"S": (12, 384, 6), "B": (12, 768, 12), "L": (24, 1024, 16), "XL": (28, 1152, 16)}  # depth, width, heads
PATCH_SIZES = (1, 2, 4, 8)  # 1: LightningDiT's XL/1 on 16x16 latents of an f16 autoencoder
MLP_RATIO = 4.0  # MLP width / width of every name
# What a spec builds for where no data sets its input and classes: ImageNet at 256 px in SD-VAE's latents, the
# official checkpoints' (dit_vca.create_model("DiT-XL/2") is the official DiT-XL/2).
IMAGENET_LATENTS = dict(input_size=32, in_channels=4, num_classes=1000)
VCA_KEYS = tuple(item.name for item in fields(VCAOptions))  # the top-level keys of first-format records


def model_names(family: str) -> tuple[str, ...]:
    """The sixteen names of a family, e.g. "DiT-S/1" … "DiT-XL/8"."""
    return tuple(f"{family}-{size}/{patch}" for size in MODEL_SIZES for patch in PATCH_SIZES)


def all_model_names() -> tuple[str, ...]:
    """Every valid model name, DiT first."""
    return tuple(name for family in MODEL_FAMILIES for name in model_names(family))


def model_family(name: str) -> str:
    """ "DiT" or "SiT" for a valid model name such as "SiT-XL/2"; ValueError naming the valid names otherwise."""
    family = name.split("-", 1)[0] if isinstance(name, str) else None
    if family not in MODEL_FAMILIES or name not in model_names(family):
        raise ValueError(f"unknown model name {name!r}; valid names: {', '.join(all_model_names())}")
    return family


def name_size(name: str) -> tuple[tuple[int, int, int], int]:
    """((depth, width, heads), patch size) that a valid model name such as "SiT-XL/2" stands for."""
    size, patch = name.split("-", 1)[1].split("/")
    return MODEL_SIZES[size], int(patch)


@dataclass(frozen=True)
class ModelSpec:
    """The network: a size name ("DiT-S/2", "SiT-XL/2", ...) plus the attention and its switches.

    The config's model section, the export's model record and DiT's one argument (the module's docstring). Its
    fields' comments are `train.py --help`'s lines, their `settings` metadata the config's checks.
    """

    name: str  # "DiT-S/2" ... "SiT-XL/8"
    attention: str = choice("vca", *ATTENTION_KINDS)  # token mixer: Visual-Contrast Attention or the MHSA baseline
    class_dropout_prob: float = value_range(0.1, 0.0, 1.0)  # labels replaced by the null class (CFG needs > 0)
    vca: VCAOptions = field(default_factory=VCAOptions)  # contrast grid and ablation switches (docs/VCA.md)
    gradient_checkpointing: bool = False  # recompute each block in backward: less memory, more time
    depth: int | None = value_range(None, 1)  # blocks; None: the name's (these size overrides: small models, tests)
    hidden_size: int | None = value_range(None, 1)  # width; None: the name's
    num_heads: int | None = value_range(None, 1)  # attention heads; None: the name's
    mlp_ratio: float | None = value_range(None, 0.0, above=True)  # MLP width / width; None: the name's
    blocks: str = choice("dit", *BLOCK_PRESETS)  # the block options' preset: dit (2022), lightning (RMSNorm,
    # SwiGLU, RoPE), lightning-qknorm (and QK-norm); blocks only (the modern recipe: configs/modern.yaml)
    norm: str | None = choice(None, None, *NORMS)  # block norms: layernorm (DiT) or rmsnorm; null: the preset's
    mlp: str | None = choice(None, None, *MLPS)  # gelu (DiT) or swiglu (2/3 of the GELU width); null: the preset's
    qk_norm: bool | None = None  # RMSNorm of each head's queries and keys (docs/models.md); null: the preset's
    rope: bool | None = None  # 2-D rotary position embedding of queries and keys (docs/models.md); null: the preset's
    input_size: int | None = decided_by("data.image_size (over the VAE's downsampling in latent space)")  # side
    # of the input grid
    in_channels: int | None = decided_by("the data (its channels, or the VAE's latent channels)")  # input channels
    num_classes: int | None = decided_by("data.num_classes")  # labels, the null class not counted
    learn_sigma: bool | None = decided_by("diffusion.learn_sigma (DiT names; SiT names: false)")  # also predict a
    # variance (twice the output channels)

    @property
    def block_options(self) -> dict[str, Any]:
        """norm, mlp, qk_norm and rope: the preset's, each replaced where set."""
        preset = BLOCK_PRESETS[self.blocks]
        return {key: preset[key] if getattr(self, key) is None else getattr(self, key) for key in preset}

    def resolved(self) -> ModelSpec:
        """This spec with every setting decided: sizes from the name, block options from the preset, learn_sigma
        from the family's objective, input and classes those of `IMAGENET_LATENTS` where nothing set them.
        ValueError names a setting that builds no network."""
        family = model_family(self.name)
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"unknown attention {self.attention!r}; expected one of {ATTENTION_KINDS}")
        if self.blocks not in BLOCK_PRESETS:
            raise ValueError(f"unknown block preset {self.blocks!r}; expected one of {tuple(BLOCK_PRESETS)}")
        (depth, width, heads), patch = name_size(self.name)
        decided = {
            "depth": depth,
            "hidden_size": width,
            "num_heads": heads,
            "mlp_ratio": MLP_RATIO,
            **self.block_options,
            "learn_sigma": MODEL_FAMILIES[family].learn_sigma,
            **IMAGENET_LATENTS,
        }
        spec = replace(self, **{key: value for key, value in decided.items() if getattr(self, key) is None})
        if spec.norm not in NORMS or spec.mlp not in MLPS:
            raise ValueError(
                f"norm={spec.norm!r}, mlp={spec.mlp!r}: expected norm one of {NORMS} and mlp one of {MLPS}"
            )
        if spec.attention == "mhsa" and spec.vca != VCAOptions():
            raise ValueError(f"VCA options {spec.vca} have no effect with attention='mhsa'")
        if spec.input_size % patch:
            raise ValueError(f"input_size={spec.input_size} is not divisible by the patch size {patch}")
        if spec.hidden_size % spec.num_heads:
            raise ValueError(f"hidden_size={spec.hidden_size} is not divisible by num_heads={spec.num_heads}")
        if spec.rope and (spec.hidden_size // spec.num_heads) % 4:
            raise ValueError(f"rope needs a head dimension divisible by 4, got {spec.hidden_size // spec.num_heads}")
        return spec

    @property
    def patch_size(self) -> int:
        """The side of a patch in input cells, the name's ("SiT-XL/2": 2)."""
        return name_size(self.name)[1]

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> ModelSpec:
        """The spec of an export's model record (JSON values), in today's layout or an earlier one: before the VCA
        switches became one section ("vca") they stood at the top level (exports of the first format), and an MHSA
        model recorded its section as null."""
        settings = dict(record)
        legacy = {key: settings.pop(key) for key in VCA_KEYS if key in settings}
        vca = settings.get("vca") or legacy
        settings["vca"] = vca if isinstance(vca, VCAOptions) else VCAOptions(**vca)
        return cls(**settings)

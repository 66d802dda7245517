"""What a user chooses about the network, as plain data: the block options and their presets (`RECIPES`, the
config's model.recipe, norm, mlp, qk_norm, rope), Visual-Contrast Attention's switches (`VCAOptions`, the config's
`model.vca`) and the kernel that runs its core (train.vca_kernel, sample.py --vca-kernel).

No torch here: training's config schema and the commands' `--help` read these without importing the network
code (dit_vca.models and dit_vca.attention, which use them)."""

from __future__ import annotations

from dataclasses import dataclass

VCA_KERNELS = ("aten", "triton")  # VisualContrastAttention.kernel
VCA_KERNEL_SETTINGS = ("auto", *VCA_KERNELS)  # the user's spelling (train.vca_kernel, --vca-kernel); auto: None
NORMS = ("layernorm", "rmsnorm")  # the blocks' norms (dit_vca.models.block_norm)
MLPS = ("gelu", "swiglu")  # the blocks' feed-forward layers (dit_vca.models.feed_forward)


@dataclass(frozen=True)
class VCAOptions:
    """Switches of Visual-Contrast Attention. The defaults are the released code; the others give the paper's
    ablation rows (see VisualContrastAttention for what each switch turns off)."""

    contrast_grid: int | None = None  # side p of the pooled p×p grid; None means H/2 (n = N/4)
    joint_softmax: bool = True  # Stage II: one softmax over the 2n columns (released code) or two (paper text)
    stage1_differential: bool = True  # False: Stage I is plain attention of T⁺ (no negative stream, λ₁)
    stage2_differential: bool = True  # False: Stage II is plain attention over T⁺ (no negative stream, λ₂)
    pooled_content: bool = True  # False: the streams are the embeddings E± alone


# Architecture presets: the block options (create_backbone's norm, mlp, qk_norm, rope) that a recipe switches on.
# "dit" is the 2022 DiT/SiT (the official layout); "lightning" LightningDiT's released model (RMSNorm, SwiGLU,
# 2-D RoPE; its configs leave QK-norm off); "lightning-qknorm" the same with QK-norm, the whole set.
RECIPES = {
    "dit": dict(norm="layernorm", mlp="gelu", qk_norm=False, rope=False),
    "lightning": dict(norm="rmsnorm", mlp="swiglu", qk_norm=False, rope=True),
    "lightning-qknorm": dict(norm="rmsnorm", mlp="swiglu", qk_norm=True, rope=True),
}


def recipe_options(recipe: str, **overrides: object) -> dict[str, object]:
    """The block options of `recipe`, each replaced by an override that is not None: e.g.
    `create_model(name, attention="mhsa", **recipe_options("lightning", rope=False))`."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; expected one of {tuple(RECIPES)}")
    unknown = overrides.keys() - RECIPES[recipe].keys()
    if unknown:
        raise ValueError(f"{sorted(unknown)} are not block options; expected {tuple(RECIPES[recipe])}")
    return {key: default if overrides.get(key) is None else overrides[key] for key, default in RECIPES[recipe].items()}

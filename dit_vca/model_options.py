"""What a user chooses about the network, as plain data: the attention (`ATTENTION_KINDS`), the block options
and their presets (`BLOCK_PRESETS`, the config's model.blocks, norm, mlp, qk_norm, rope), Visual-Contrast
Attention's switches (`VCAOptions`, the config's `model.vca`) and the kernel that runs its core (train.vca_kernel,
sample.py --vca-kernel). The model's spec, which holds them all, is `dit_vca.model_spec.ModelSpec`.

No torch here: training's config schema and the commands' `--help` read these without importing the network
code (dit_vca.models and dit_vca.attention, which use them)."""

from __future__ import annotations

from dataclasses import dataclass

ATTENTION_KINDS = ("vca", "mhsa")  # the token mixer: Visual-Contrast Attention or the MHSA baseline
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


# The block options' presets (the spec's `blocks`): the values of norm, mlp, qk_norm and rope that a preset
# switches on, each replaced by the spec's own where that is set. "dit" is the 2022 DiT/SiT (the official layout);
# "lightning" LightningDiT's released model (RMSNorm, SwiGLU, 2-D RoPE; its configs leave QK-norm off);
# "lightning-qknorm" the same with QK-norm, the whole set. A preset is the blocks alone: the modern recipe's
# objective, training times, loss and AdamW betas are a config's (configs/modern.yaml).
BLOCK_PRESETS = {
    "dit": dict(norm="layernorm", mlp="gelu", qk_norm=False, rope=False),
    "lightning": dict(norm="rmsnorm", mlp="swiglu", qk_norm=False, rope=True),
    "lightning-qknorm": dict(norm="rmsnorm", mlp="swiglu", qk_norm=True, rope=True),
}

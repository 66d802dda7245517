"""What a user chooses about Visual-Contrast Attention, as plain data: its switches (`VCAOptions`, the config's
`model.vca`) and the kernel that runs its core (train.vca_kernel, sample.py --vca-kernel).

No torch here: training's config schema and the commands' `--help` read these without importing the network
code (dit_vca.attention, which uses them)."""

from __future__ import annotations

from dataclasses import dataclass

VCA_KERNELS = ("aten", "triton")  # VisualContrastAttention.kernel
VCA_KERNEL_SETTINGS = ("auto", *VCA_KERNELS)  # the user's spelling (train.vca_kernel, --vca-kernel); auto: None


@dataclass(frozen=True)
class VCAOptions:
    """Switches of Visual-Contrast Attention. The defaults are the released code; the others give the paper's
    ablation rows (see VisualContrastAttention for what each switch turns off)."""

    contrast_grid: int | None = None  # side p of the pooled p×p grid; None means H/2 (n = N/4)
    joint_softmax: bool = True  # Stage II: one softmax over the 2n columns (released code) or two (paper text)
    stage1_differential: bool = True  # False: Stage I is plain attention of T⁺ (no negative stream, λ₁)
    stage2_differential: bool = True  # False: Stage II is plain attention over T⁺ (no negative stream, λ₂)
    pooled_content: bool = True  # False: the streams are the embeddings E± alone

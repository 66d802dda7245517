"""Token mixers for DiT/SiT blocks: the official multi-head self-attention and Visual-Contrast Attention.

Both map tokens (B, N, C), laid out row-major on a square H×W grid, to tokens of the same shape, and both
keep the official DiT parameter names (`qkv`, a fused Linear(C, 3C), and `proj`), so a block holds either.
VCA follows docs/VCA.md (Pu et al., NeurIPS 2025, "Linear Differential Vision Transformer").
"""

import importlib.util
import math
import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from commands import UserError
from dit_vca.kernel_layout import KernelLayout
from dit_vca.model_options import ATTENTION_KINDS, VCA_KERNEL_SETTINGS, VCA_KERNELS, VCAOptions
from dit_vca.rope import RotaryEmbedding2d
from dit_vca.vca_core import CoreTensors, autocast_exists, stage2_uses_sdpa, vca_core

KERNEL_ATTRIBUTE = "VisualContrastAttention.kernel"  # how a refusal names the choice when no option made it
TRITON_DEVICE_TYPES = ("cuda",)  # where the automatic choice (kernel None) runs the core on the Triton kernels
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None  # looked up, not imported
NORM_EPS = 1e-5  # of VCA's two RMSNorms
QK_NORM_EPS = 1e-6  # of the RMSNorms of queries and keys (QK-norm), LightningDiT's


def resolve_contrast_grid(grid_size: int, contrast_grid: int | None) -> int:
    """Side p of the contrast grid for an H×W = grid_size×grid_size token grid; p must divide grid_size."""
    if contrast_grid is None:
        if grid_size % 2:
            raise ValueError(
                f"the default contrast grid is H/2, but the token grid is {grid_size}x{grid_size} (odd); "
                f"pass contrast_grid= a divisor of {grid_size}"
            )
        return grid_size // 2
    if contrast_grid < 1 or grid_size % contrast_grid:
        raise ValueError(
            f"contrast_grid={contrast_grid} must be a positive divisor of the token grid side {grid_size} "
            f"(token grid {grid_size}x{grid_size})"
        )
    return contrast_grid


def lambda_init(block_index: int) -> float:
    """Initial differential weight of block ℓ (0-based): 0.8 − 0.6·exp(−0.3·ℓ), as in the Differential Transformer."""
    return 0.8 - 0.6 * math.exp(-0.3 * block_index)


class MultiHeadSelfAttention(nn.Module):
    """Multi-head self-attention on SDPA with the official DiT layout (`qkv`, `proj`): the baseline.

    Options (off by default, LightningDiT's names and layout): `qk_norm` normalises each head's queries and keys
    by an RMSNorm with a learned gain (`q_norm`, `k_norm`) before the dot product, which bounds the attention
    logits; `rope_grid`, the side of the token grid, rotates queries and keys by 2-D RoPE (dit_vca.rope), after
    QK-norm."""

    def __init__(self, dim: int, num_heads: int, *, qk_norm: bool = False, rope_grid: int | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        head_dim = dim // num_heads
        self.q_norm = nn.RMSNorm(head_dim, eps=QK_NORM_EPS) if qk_norm else None
        self.k_norm = nn.RMSNorm(head_dim, eps=QK_NORM_EPS) if qk_norm else None
        self.rope = RotaryEmbedding2d(head_dim, rope_grid) if rope_grid is not None else None

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """softmax(qkᵀ/√d)·v per head; a separate method so benchmarks can swap the kernel."""
        return F.scaled_dot_product_attention(q, k, v)  # (B, h, N, d)

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4).unbind(0)
        if self.q_norm is not None:
            q, k = _scaled_rms_norm(self.q_norm, q, 1.0), _scaled_rms_norm(self.k_norm, k, 1.0)  # (B, h, N, d)
        if self.rope is not None:
            q, k = self.rope(q), self.rope(k)  # (B, h, N, d)
        out = self.attend(q, k, v)  # (B, h, N, d)
        return self.proj(out.transpose(1, 2).reshape(B, N, C))  # (B, N, C)


def _scaled_rms_norm(norm: nn.RMSNorm, x: Tensor, scale: float) -> Tensor:
    """scale · RMSNorm(x) over the last dimension, the scale folded into the norm's weight. Computed in the
    weight's dtype (float32 under bf16 autocast, for accuracy) and returned in x's dtype."""
    weight = norm.weight * scale
    return F.rms_norm(x.to(weight.dtype), norm.normalized_shape, weight, norm.eps).to(x.dtype)


class DifferentialWeight(nn.Module):
    """The scalar λ = exp(⟨λ_q1, λ_k1⟩) − exp(⟨λ_q2, λ_k2⟩) + λ_init that weighs a negative stream. Its forward is
    the readable path's; the fused core computes λ itself from the four vectors, with its own backward
    (dit_vca.vca_core)."""

    def __init__(self, head_dim: int, init: float):
        super().__init__()
        self.init = init
        self.q1, self.k1, self.q2, self.k2 = (nn.Parameter(torch.empty(head_dim)) for _ in range(4))
        for vector in (self.q1, self.k1, self.q2, self.k2):
            nn.init.normal_(vector, std=0.1)

    def forward(self) -> Tensor:
        return torch.exp(torch.dot(self.q1, self.k1)) - torch.exp(torch.dot(self.q2, self.k2)) + self.init


def _vectors(weight: DifferentialWeight | None) -> tuple[Tensor | None, ...]:
    """The four vectors of a differential weight (q1, k1, q2, k2), from which the core computes λ; None for each
    where the stage is not differential."""
    return (None,) * 4 if weight is None else (weight.q1, weight.k1, weight.q2, weight.k2)


class VisualContrastAttention(nn.Module):
    """Visual-Contrast Attention: O(N·n·C) attention through n = p² pooled contrast tokens (VCA.md).

    Stage I lets the positive and negative contrast streams T± = pool(q) + E± read all tokens and takes their
    λ₁-weighted difference V̂; Stage II lets every query read V̂ through the λ₂-weighted difference of its
    attention to T⁺ and T⁻. A depthwise 3×3 convolution of v adds local detail before the output projection.

    Ablation switches (our reading of the paper's rows; VCA.md does not spell out the "off" states):
    - `stage1_differential=False` ("Stage II only"): Stage I is plain attention of T⁺ over the tokens,
      V̂ = softmax(T⁺kᵀ/√d)·v, with no negative stream, λ₁, RMSNorm or (1 − λ_init) scale.
    - `stage2_differential=False` ("Stage I only"): Stage II is plain attention of the queries over the
      positive contrast tokens, O = softmax(qT⁺ᵀ/√d)·V̂, likewise without λ₂, RMSNorm or scale.
    - `pooled_content=False` ("streams from embeddings only"): T± = E±, the pooled queries are not used.
    - `joint_softmax=False`: Stage II uses two softmaxes (paper text) instead of one over 2n columns.
    The paper's "plain differential attention in both stages" row is not defined precisely enough in
    VCA.md to reproduce, so it has no switch. Parameters that a configuration never uses are not created.

    Block options, as MultiHeadSelfAttention's (off by default; docs/VCA.md, "QK-norm and 2-D RoPE"): `qk_norm`
    normalises each head's queries and keys by an RMSNorm with a learned gain (`q_norm`, `k_norm`), before the
    pooling, so the contrast tokens are pooled from normalised queries (and not normalised again); `rope` rotates
    queries and keys by 2-D RoPE at their tokens' positions and the pooled content of each contrast token at the
    centre of its pooling cell (`contrast_rope`), after QK-norm. Both apply inside the fused core.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        grid_size: int,
        block_index: int,
        options: VCAOptions = VCAOptions(),
        *,
        qk_norm: bool = False,
        rope: bool = False,
    ):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.grid_size = grid_size
        self.contrast_grid = resolve_contrast_grid(grid_size, options.contrast_grid)
        self.options = options
        self.lambda_init = lambda_init(block_index)
        num_contrast = self.contrast_grid**2

        self.qkv = nn.Linear(dim, 3 * dim)
        # E⁺ = contrast_embed[:, :, 0] and E⁻ = contrast_embed[:, :, 1] (absent when no stage is differential),
        # stored together so that both streams come out of one broadcast add, already stacked.
        num_streams = 2 if options.stage1_differential or options.stage2_differential else 1
        self.contrast_embed = nn.Parameter(torch.empty(1, num_heads, num_streams, num_contrast, self.head_dim))
        nn.init.normal_(self.contrast_embed)
        if options.stage1_differential:
            self.lambda1 = DifferentialWeight(self.head_dim, self.lambda_init)
            self.norm1 = nn.RMSNorm(self.head_dim, eps=NORM_EPS)
        if options.stage2_differential:
            self.lambda2 = DifferentialWeight(self.head_dim, self.lambda_init)
            self.norm2 = nn.RMSNorm(self.head_dim, eps=NORM_EPS)
        self.value_conv = nn.Conv2d(dim, dim, kernel_size=3, padding=1, groups=dim)
        self.proj = nn.Linear(dim, dim)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=QK_NORM_EPS) if qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=QK_NORM_EPS) if qk_norm else None
        # RoPE tables (non-persistent buffers): the tokens' positions, and the centres of the r×r pooling cells,
        # where the contrast tokens sit (r = H / p; a half-integer position for even r).
        pooling_cell = grid_size // self.contrast_grid
        self.rope = RotaryEmbedding2d(self.head_dim, grid_size) if rope else None
        self.contrast_rope = RotaryEmbedding2d(self.head_dim, grid_size, pooling_cell) if rope else None

        # Not parameters or buffers (exports are unchanged). recompute_qkv: True trades one more qkv GEMM in
        # backward for 3·B·N·C fewer values saved for it (see dit_vca.vca_core). stage2_sdpa: Stage II of the
        # fast forward as SDPA calls (True) or GEMM–softmax–GEMM (False); None: the faster per device type
        # (vca_core.STAGE2_SDPA).
        # kernel: the core's attention stages in ATen operations ("aten") or in the Triton kernels of
        # dit_vca.vca_triton ("triton"); None: Triton on CUDA where triton is installed, ATen elsewhere (on CPU
        # tensors "triton" needs Triton's interpreter, TRITON_INTERPRET=1 before triton is imported).
        self.recompute_qkv = False
        self.stage2_sdpa: bool | None = None
        self.kernel: str | None = None

    def forward(self, x: Tensor) -> Tensor:
        """The fast path: the layer as one autograd node with a hand-written backward (dit_vca.vca_core), under
        torch.compile an opaque custom operator. Equal to `reference_forward` up to float rounding, outputs and
        gradients (tested). Under autocast the layer computes in the autocast dtype and returns its output in it, as
        nn.Linear would; the parameters' gradients come back in their own dtype (float32)."""
        device_type = x.device.type
        autocast = autocast_exists(device_type) and torch.is_autocast_enabled(device_type)
        dtype = torch.get_autocast_dtype(device_type) if autocast else x.dtype
        return self.core(x, self.runs_triton(x.device, dtype), dtype)  # (B, N, C)

    def core(self, x: Tensor, triton: bool, dtype: torch.dtype | None = None) -> Tensor:
        """The fused layer (dit_vca.vca_core) on tokens x (B, N, C), from the qkv projection to the output
        projection, computed in `dtype` (default x's) on the Triton kernels or the ATen operations: its output
        (B, N, C) in that dtype."""
        options = self.options
        layout = KernelLayout(
            self.num_heads,
            self.grid_size,
            self.contrast_grid,
            options.joint_softmax,
            options.stage1_differential,
            options.stage2_differential,
            options.pooled_content,
            self.lambda_init,
            NORM_EPS,
            self.recompute_qkv,
            stage2_uses_sdpa(x.device.type) if self.stage2_sdpa is None else self.stage2_sdpa,
            triton,
            QK_NORM_EPS if self.q_norm is not None else None,
        )
        rope = (None,) * 4
        if self.rope is not None:
            rope = (self.rope.cos, self.rope.sin, self.contrast_rope.cos, self.contrast_rope.sin)
        tensors = CoreTensors(
            self.qkv.weight,
            self.qkv.bias,
            self.contrast_embed,
            *_vectors(self.lambda1 if options.stage1_differential else None),
            *_vectors(self.lambda2 if options.stage2_differential else None),
            self.norm1.weight if options.stage1_differential else None,
            self.norm2.weight if options.stage2_differential else None,
            self.value_conv.weight,
            self.value_conv.bias,
            self.proj.weight,
            self.proj.bias,
            None if self.q_norm is None else self.q_norm.weight,
            None if self.k_norm is None else self.k_norm.weight,
            *rope,
        )
        return vca_core(x, tensors, layout, dtype)  # (B, N, C)

    def uses_triton(self, device_type: str) -> bool:
        """Whether the core runs on the Triton kernels for tensors of `device_type` (see `kernel`)."""
        if self.kernel is None:
            return device_type in TRITON_DEVICE_TYPES and TRITON_INSTALLED
        if self.kernel not in VCA_KERNELS:
            raise ValueError(f"VisualContrastAttention.kernel={self.kernel!r}; expected None or one of {VCA_KERNELS}")
        return self.kernel == "triton"

    def runs_triton(self, device: torch.device, dtype: torch.dtype, option: str = KERNEL_ATTRIBUTE) -> bool:
        """Whether a call on `device` computing in `dtype` runs the Triton core: the kernel choice (`uses_triton`),
        then the first-use check of dit_vca.triton_check for this device, dtype, head dim and switches. A failed
        check falls back to ATen when the choice was automatic, and is a UserError naming `option` when
        `kernel` is "triton"."""
        if not self.uses_triton(device.type):
            return False
        # Imported here: marking the check constant for Dynamo imports torch._dynamo (seconds), which a process that
        # never runs the Triton core (the CPU, a config error) should not pay.
        from dit_vca.triton_check import triton_core_passes

        o = self.options
        switches = (o.joint_softmax, o.stage1_differential, o.stage2_differential, o.pooled_content)
        forced_by = option if self.kernel == "triton" else None
        return triton_core_passes(
            type(self), device, dtype, self.head_dim, self.grid_size, self.contrast_grid, switches, forced_by
        )

    def reference_forward(self, x: Tensor) -> Tensor:
        """The readable path: VCA step by step in autograd-differentiated torch operations. It is the
        specification `forward` is tested against, and the one to read to understand VCA."""
        B, N, C = x.shape
        h, d, H, p = self.num_heads, self.head_dim, self.grid_size, self.contrast_grid
        options = self.options
        q, k, v = self.qkv(x).view(B, N, 3, h, d).permute(2, 0, 3, 1, 4).unbind(0)  # 3 × (B, h, N, d)
        n = p * p
        if self.q_norm is not None:  # QK-norm, as MHSA's: everything below reads the normalised q and k
            q, k = _scaled_rms_norm(self.q_norm, q, 1.0), _scaled_rms_norm(self.k_norm, k, 1.0)  # (B, h, N, d)

        # 1-2. Contrast streams [T⁺; T⁻] = adaptive average pool of q to p×p, plus E±.
        streams = self.contrast_embed.expand(B, -1, -1, -1, -1)  # (B, h, 2 or 1, n, d)
        if options.pooled_content:
            q_image = q.transpose(1, 2).reshape(B, H, H, C).permute(0, 3, 1, 2)  # (B, C, H, W), a view
            pooled = F.adaptive_avg_pool2d(q_image, p).flatten(2).unflatten(1, (h, d)).transpose(2, 3)  # (B, h, n, d)
            if self.rope is not None:  # RoPE: the pooled content turned to its pooling cell's centre
                pooled = self.contrast_rope(pooled)  # (B, h, n, d)
            streams = streams + pooled.unsqueeze(2)
        if self.rope is not None:  # RoPE: queries and keys turned to their tokens' positions (after the pooling)
            q, k = self.rope(q), self.rope(k)  # (B, h, N, d)
        # (B, h, 2n, d): T⁺ rows first, then T⁻; in q's dtype (E± is a float32 parameter), so that the SDPA
        # operands share one dtype, as the fused kernels require (dit_vca.vca_core.SDPA_FUSED_CONSTRAINTS).
        streams = streams.flatten(2, 3).to(q.dtype)
        t_pos = streams[:, :, :n]  # (B, h, n, d)

        # 4. Stage I: the contrast tokens attend to all N keys (one fused call for both streams).
        if options.stage1_differential:
            read_pos, read_neg = F.scaled_dot_product_attention(streams, k, v).unflatten(2, (2, n)).unbind(2)
            contrast_values = _scaled_rms_norm(self.norm1, read_pos - self.lambda1() * read_neg, 1 - self.lambda_init)
        else:
            contrast_values = F.scaled_dot_product_attention(t_pos, k, v)  # (B, h, n, d)

        # 5. Stage II: every query reads the contrast values: one matmul and a softmax over the n (or 2n) columns.
        # Combining the two maps before the value product keeps it at 3·n·N·C multiply-adds.
        if options.stage2_differential:
            scores = q @ (streams * d**-0.5).transpose(-2, -1)  # (B, h, N, 2n)
            if options.joint_softmax:
                probs = scores.softmax(dim=-1).unflatten(-1, (2, n))  # (B, h, N, 2, n)
            else:
                probs = scores.unflatten(-1, (2, n)).softmax(dim=-1)  # (B, h, N, 2, n)
            probs_pos, probs_neg = probs.unbind(-2)  # (B, h, N, n) each
            weights = torch.addcmul(probs_pos, probs_neg, -self.lambda2())  # S⁺ − λ₂·S⁻
            out = _scaled_rms_norm(self.norm2, weights @ contrast_values, 1 - self.lambda_init)  # (B, h, N, d)
        else:
            out = (q @ (t_pos * d**-0.5).transpose(-2, -1)).softmax(dim=-1) @ contrast_values  # (B, h, N, d)
        out = out.transpose(1, 2).reshape(B, N, C)  # heads concatenated

        # 6. Local detail: depthwise 3×3 convolution of v (channels-last, its natural token layout).
        v_image = v.transpose(1, 2).reshape(B, H, H, C).permute(0, 3, 1, 2)  # (B, C, H, W)
        local = self.value_conv(v_image.contiguous(memory_format=torch.channels_last))  # (B, C, H, W)
        return self.proj(out + local.flatten(2).transpose(1, 2))  # (B, N, C)


def set_vca_kernel(
    model: nn.Module, kernel: str, device: torch.device | str, option: str, dtype: torch.dtype | None = None
) -> None:
    """Set `kernel` ("auto", "aten" or "triton"; see VisualContrastAttention.kernel) on every VCA module of
    `model`, which runs on `device`; MHSA modules have no such choice. A choice that cannot run there is a user
    error naming `option` (train.vca_kernel, --vca-kernel) now, not a Triton failure in the first forward. With
    `dtype`, the dtype the core will compute in (the autocast dtype, else the model's), the Triton core's
    first-use check (dit_vca.triton_check) runs now for every layer that will use it, before the model is
    compiled: a failure falls back to ATen with a warning, or with "triton" is a user error naming `option`."""
    if kernel not in VCA_KERNEL_SETTINGS:
        raise UserError(f"{option} is {kernel!r}; valid choices: {', '.join(VCA_KERNEL_SETTINGS)}")
    device = torch.device(device)
    if kernel == "triton":
        if not TRITON_INSTALLED:
            raise UserError(f"{option} triton needs the triton package, which is not installed; use aten or auto")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise UserError(
                f"{option} triton on {device.type} needs a CUDA device or Triton's interpreter (TRITON_INTERPRET=1 in "
                "the environment); use aten or auto"
            )
    for module in model.modules():
        if isinstance(module, VisualContrastAttention):
            module.kernel = None if kernel == "auto" else kernel
            if dtype is not None:
                module.runs_triton(device, dtype, option)


def build_attention(
    kind: str,
    dim: int,
    num_heads: int,
    grid_size: int,
    block_index: int,
    vca_options: VCAOptions,
    qk_norm: bool = False,
    rope: bool = False,
) -> nn.Module:
    """The token mixer of block `block_index`: "mhsa" (official DiT) or "vca"; `qk_norm` and `rope` as in
    MultiHeadSelfAttention, and in VCA as VisualContrastAttention applies them (docs/VCA.md)."""
    if kind == "mhsa":
        return MultiHeadSelfAttention(dim, num_heads, qk_norm=qk_norm, rope_grid=grid_size if rope else None)
    if kind == "vca":
        return VisualContrastAttention(dim, num_heads, grid_size, block_index, vca_options, qk_norm=qk_norm, rope=rope)
    raise ValueError(f"unknown attention {kind!r}; expected one of {ATTENTION_KINDS}")

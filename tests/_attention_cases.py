"""Attention modules and measurements that the tests of VCA's PyTorch paths (tests/test_attention.py) and of its
Triton kernels (tests/test_vca_triton.py) share: VCA with every parameter moved off its init, the switch and
block-option cases with their test ids, outputs with their gradients, and the attention core's multiply-adds."""

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from dit_vca.attention import VCAOptions, VisualContrastAttention

SWITCHES = ("joint_softmax", "stage1_differential", "stage2_differential", "pooled_content")


# The block options that enter VCA's core, alone and together (keywords of VisualContrastAttention).
BLOCK_OPTIONS = [dict(qk_norm=True), dict(rope=True), dict(qk_norm=True, rope=True)]


def perturbed_vca(
    dim: int, heads: int, grid: int, block_index: int, options: VCAOptions, **block_options: bool
) -> VisualContrastAttention:
    """A VCA module whose λ vectors and norm weights (QK-norm's gains too) are moved off their init, so every
    parameter matters; `block_options`: qk_norm, rope."""
    torch.manual_seed(block_index)
    module = VisualContrastAttention(dim, heads, grid, block_index, options, **block_options)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.startswith(("lambda", "norm", "q_norm", "k_norm")):
                param.add_(0.3 * torch.randn_like(param))
    return module


def block_ids(block_options: dict) -> str:
    return "+".join(block_options) or "plain"


def switch_ids(options: VCAOptions) -> str:
    return "-".join(str(int(getattr(options, s))) for s in SWITCHES)


def outputs_and_gradients(module: VisualContrastAttention, path: str, x: torch.Tensor, grad: torch.Tensor):
    """The output of `module.<path>(x)` and, after backward with `grad`, the gradients of x and of every
    parameter, by name."""
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out = getattr(module, path)(x)
    out.backward(grad)
    return {"output": out.detach(), "x": x.grad, **{name: p.grad for name, p in module.named_parameters()}}


def core_multiply_adds(forward, x: torch.Tensor) -> float:
    """Multiply-adds of the attention core of a forward pass on x (1, N, C): the whole pass minus the qkv and
    output projections (N·3C·C + N·C·C)."""
    # The fused CPU SDPA kernels report 0 FLOPs; the math backend decomposes into counted matmuls.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        forward(x)
    _, tokens, dim = x.shape
    return counter.get_total_flops() / 2 - 4 * tokens * dim**2  # counter: 2 FLOPs per MAC

"""VisualContrastAttention and the MHSA baseline against literal references, the parameter formula and the
cost formula of ../shared/docs/VCA.md."""

import itertools
from dataclasses import replace

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from _reference_vca import reference_mhsa, reference_vca
from dit_vca.attention import MultiHeadSelfAttention, VCAOptions, VisualContrastAttention, build_attention

SWITCHES = ("joint_softmax", "stage1_differential", "stage2_differential", "pooled_content")
ALL_OPTIONS = [VCAOptions(None, *values) for values in itertools.product((True, False), repeat=4)]


def perturbed_vca(dim: int, heads: int, grid: int, block_index: int, options: VCAOptions) -> VisualContrastAttention:
    """A VCA module whose λ vectors and norm weights are moved off their init, so every parameter matters."""
    torch.manual_seed(block_index)
    module = VisualContrastAttention(dim, heads, grid, block_index, options)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.startswith(("lambda", "norm")):
                param.add_(0.3 * torch.randn_like(param))
    return module


@pytest.mark.parametrize("options", ALL_OPTIONS, ids=lambda o: "-".join(str(int(getattr(o, s))) for s in SWITCHES))
def test_vca_matches_literal_reference(options):
    module = perturbed_vca(32, 2, 8, block_index=3, options=options)
    x = torch.randn(2, 64, 32)
    # fp32 module vs float64 reference on O(1) outputs: fp32 rounding over sums of ≤ 64 terms stays ~1e-6.
    assert (module(x).double() - reference_vca(module, x, block_index=3)).abs().max() <= 1e-5


@pytest.mark.parametrize("contrast_grid", [1, 2, 4, 8])
def test_vca_contrast_grids_match_reference(contrast_grid):
    options = VCAOptions(contrast_grid=contrast_grid)
    module = perturbed_vca(24, 3, 8, block_index=0, options=options)
    x = torch.randn(2, 64, 24)
    assert module.contrast_embed.shape == (1, 3, 2, contrast_grid**2, 8)  # (1, h, E±, n, d)
    assert (module(x).double() - reference_vca(module, x, block_index=0)).abs().max() <= 1e-5


def test_every_switch_changes_the_output():
    # joint_softmax only concerns a differential Stage II: without one, the two settings are the same model.
    x = torch.randn(1, 64, 32)
    full = perturbed_vca(32, 2, 8, block_index=2, options=VCAOptions())
    outputs = {}
    for options in ALL_OPTIONS:
        module = VisualContrastAttention(32, 2, 8, 2, options)
        state = full.state_dict()  # the parameters `module` has are those of `full` (E⁺ alone if no E⁻)
        state["contrast_embed"] = state["contrast_embed"][:, :, : module.contrast_embed.shape[2]]
        module.load_state_dict(state, strict=False)
        outputs[options] = module(x)
    distinct = [o for o in ALL_OPTIONS if o.stage2_differential or o.joint_softmax]
    for a, b in itertools.combinations(distinct, 2):
        assert not torch.allclose(outputs[a], outputs[b], atol=1e-4), (a, b)
    for options in set(ALL_OPTIONS) - set(distinct):
        assert torch.equal(outputs[options], outputs[replace(options, joint_softmax=True)])


def test_lambda_init_follows_block_index():
    # λ_init = 0.8 − 0.6·exp(−0.3·ℓ): 0.2 at ℓ = 0, → 0.8 for deep blocks.
    assert VisualContrastAttention(8, 1, 4, 0).lambda_init == pytest.approx(0.2)
    assert VisualContrastAttention(8, 1, 4, 5).lambda_init == pytest.approx(0.8 - 0.6 * 0.22313016014842982)
    # λ starts near λ_init: ⟨a, b⟩ of two std-0.1 vectors in R^8 has std 0.03, so each exp(·) ≈ 1 ± 0.03.
    λ = VisualContrastAttention(8, 1, 4, 5).lambda1()
    assert abs(λ.item() - (0.8 - 0.6 * 0.22313016014842982)) < 0.2


def test_mhsa_matches_literal_reference():
    module = MultiHeadSelfAttention(48, 3)
    x = torch.randn(2, 20, 48)
    expected = reference_mhsa(module.qkv.weight, module.qkv.bias, module.proj.weight, module.proj.bias, x, 3)
    assert (module(x).double() - expected).abs().max() <= 1e-5  # fp32 vs float64, O(1) outputs


def parameter_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def vca_overhead_formula(dim: int, heads: int, n: int) -> int:
    """VCA.md: 2·n·C (E±) + 10·C (depthwise conv) + 8·d (λ vectors) + 2·d (RMSNorm weights)."""
    d = dim // heads
    return 2 * n * dim + 10 * dim + 8 * d + 2 * d


@pytest.mark.parametrize("dim,heads,grid,contrast_grid", [(384, 6, 16, None), (192, 3, 14, 7), (64, 4, 8, 2)])
def test_parameter_overhead_per_layer(dim, heads, grid, contrast_grid):
    vca = VisualContrastAttention(dim, heads, grid, 0, VCAOptions(contrast_grid=contrast_grid))
    n = vca.contrast_grid**2
    assert parameter_count(vca) - parameter_count(MultiHeadSelfAttention(dim, heads)) == vca_overhead_formula(
        dim, heads, n
    )


@pytest.mark.parametrize("dim,heads,expected_millions", [(192, 3, 0.257), (384, 6, 0.505)])
def test_deit_stack_overhead(dim, heads, expected_millions):
    # DeiT at 224 px: 14×14 tokens, n = 49 (7×7 contrast grid), 12 layers; VCA.md quotes +0.257 M / +0.505 M.
    def stack(kind: str) -> torch.nn.ModuleList:
        return torch.nn.ModuleList(
            build_attention(kind, dim, heads, 14, index, VCAOptions(contrast_grid=7) if kind == "vca" else VCAOptions())
            for index in range(12)
        )

    with torch.device("meta"):
        gained = parameter_count(stack("vca")) - parameter_count(stack("mhsa"))
    assert gained == 12 * vca_overhead_formula(dim, heads, 49)
    assert abs(gained / 1e6 - expected_millions) <= 0.005


def core_multiply_adds(module: torch.nn.Module, x: torch.Tensor) -> float:
    """Multiply-adds of the attention core: the whole forward minus the qkv and output projections."""
    # The fused CPU SDPA kernels report 0 FLOPs; the math backend decomposes into counted matmuls.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        module(x)
    counts = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    name = type(module).__name__
    return (counts[name] - counts[f"{name}.qkv"] - counts[f"{name}.proj"]) / 2  # counter: 2 FLOPs per MAC


@pytest.mark.parametrize("tokens,max_ratio", [(256, 1.0), (4096, 0.1)])
def test_vca_core_cost_against_mhsa(tokens, max_ratio):
    dim, heads, grid, n = 384, 6, int(tokens**0.5), 64
    with torch.device("meta"):  # shapes only: the counter needs no data
        vca = VisualContrastAttention(dim, heads, grid, 0, VCAOptions(contrast_grid=8))
        mhsa = MultiHeadSelfAttention(dim, heads)
        x = torch.empty(1, tokens, dim)
        vca_cost, mhsa_cost = core_multiply_adds(vca, x), core_multiply_adds(mhsa, x)
    assert mhsa_cost == 2 * tokens**2 * dim
    # VCA.md: ≈ 7·n·N·C + 10·N·C; the counter sees the matmuls (7·n·N·C) and the 3×3 conv (9·N·C), not the
    # element-wise pooling, softmax and norms.
    assert vca_cost == 7 * n * tokens * dim + 9 * tokens * dim
    assert vca_cost / mhsa_cost <= max_ratio


def test_invalid_contrast_grid_names_the_values():
    with pytest.raises(ValueError, match="contrast_grid=3.*16"):
        VisualContrastAttention(64, 4, 16, 0, VCAOptions(contrast_grid=3))
    with pytest.raises(ValueError, match="7x7"):
        VisualContrastAttention(64, 4, 7, 0)


def test_unknown_attention_names_the_value():
    with pytest.raises(ValueError, match="'linear'"):
        build_attention("linear", 64, 4, 8, 0, VCAOptions())

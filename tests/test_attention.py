"""VisualContrastAttention and the MHSA baseline against literal references, the parameter formula and the
cost formula of docs/VCA.md; VCA's fast path against its readable one, also with the block options QK-norm and
RoPE, which apply inside the fused core; activation memory saved for backward."""

import contextlib
import copy
import itertools
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from _attention_cases import (
    BLOCK_OPTIONS,
    block_ids,
    core_multiply_adds,
    outputs_and_gradients,
    perturbed_vca,
    switch_ids,
)
from _reference_vca import reference_mhsa, reference_vca
from bench._harness import saved_activation_bytes
from dit_vca.attention import MultiHeadSelfAttention, VCAOptions, VisualContrastAttention, build_attention

ALL_OPTIONS = [VCAOptions(None, *values) for values in itertools.product((True, False), repeat=4)]


@pytest.mark.parametrize("options", ALL_OPTIONS, ids=switch_ids)
@pytest.mark.parametrize("path", ["forward", "reference_forward"])
def test_vca_matches_literal_reference(options, path):
    module = perturbed_vca(32, 2, 8, block_index=3, options=options)
    x = torch.randn(2, 64, 32)
    # fp32 module vs float64 reference on O(1) outputs: fp32 rounding over sums of ≤ 64 terms stays ~1e-6.
    assert (getattr(module, path)(x).double() - reference_vca(module, x, block_index=3)).abs().max() <= 1e-5


@pytest.mark.parametrize("contrast_grid", [1, 2, 4, 8])
@pytest.mark.parametrize("path", ["forward", "reference_forward"])
def test_vca_contrast_grids_match_reference(contrast_grid, path):
    options = VCAOptions(contrast_grid=contrast_grid)
    module = perturbed_vca(24, 3, 8, block_index=0, options=options)
    x = torch.randn(2, 64, 24)
    assert module.contrast_embed.shape == (1, 3, 2, contrast_grid**2, 8)  # (1, h, E±, n, d)
    assert (getattr(module, path)(x).double() - reference_vca(module, x, block_index=0)).abs().max() <= 1e-5


@pytest.mark.parametrize("block_options", BLOCK_OPTIONS, ids=block_ids)
@pytest.mark.parametrize("grid,contrast_grid", [(8, 4), (6, 2)], ids=["r2", "r3"])
@pytest.mark.parametrize("path", ["forward", "reference_forward"])
def test_vca_with_qk_norm_and_rope_matches_literal_reference(block_options, grid, contrast_grid, path):
    """QK-norm and RoPE as docs/VCA.md states them (the literal reference: q and k normalised, contrast tokens
    pooled from the normalised queries and turned to their cells' centres, half-integer for r = 2, integer for
    r = 3), through both paths, every parameter off its init."""
    options = VCAOptions(contrast_grid=contrast_grid)
    module = perturbed_vca(32, 2, grid, block_index=3, options=options, **block_options)
    x = torch.randn(2, grid * grid, 32)
    # fp32 module vs float64 reference on O(1) outputs: fp32 rounding over sums of ≤ 64 terms stays ~1e-6.
    assert (getattr(module, path)(x).double() - reference_vca(module, x, block_index=3)).abs().max() <= 1e-5


# Every switch combination on the default grid (p = H/2), Stage II of the forward as GEMMs and as SDPA calls;
# then grids p ≠ H/2: p = 1, 2, 8 on H = 8 (r = H/p = 8, 4, 1) and p = 3, 2 on H = 6 (r = 2, 3: odd pooling
# windows), each with q, k, v saved or recomputed.
FAST_PATH_CASES = (
    [(8, options, False, stage2_sdpa) for options in ALL_OPTIONS for stage2_sdpa in (False, True)]
    + [(8, VCAOptions(contrast_grid=p), recompute, True) for p in (1, 2, 8) for recompute in (False, True)]
    + [(6, VCAOptions(contrast_grid=p), recompute, False) for p in (3, 2) for recompute in (False, True)]
)


def case_id(value) -> str:
    return switch_ids(value) if isinstance(value, VCAOptions) else str(value)


@pytest.mark.parametrize("grid,options,recompute,stage2_sdpa", FAST_PATH_CASES, ids=case_id)
def test_fast_path_equals_readable_path(grid, options, recompute, stage2_sdpa):
    """Outputs and the gradients of the input and of every parameter: the hand-written backward is exact."""
    torch.manual_seed(grid)
    module = perturbed_vca(32, 2, grid, block_index=3, options=options)
    module.recompute_qkv, module.stage2_sdpa = recompute, stage2_sdpa
    assert_fast_path_equals_readable_path(module, grid)


# QK-norm and RoPE together with every switch combination (Stage II of the forward as GEMMs and as SDPA calls in
# turn), then each option alone on the default switches, on streams from the embeddings only and on grids with odd
# pooling cells (H = 6, p = 2: r = 3, integer centres), q, k, v saved or recomputed.
BLOCK_OPTION_CASES = (
    [(8, options, dict(qk_norm=True, rope=True), False, i % 2 == 1) for i, options in enumerate(ALL_OPTIONS)]
    + [(8, VCAOptions(), block, recompute, False) for block in BLOCK_OPTIONS[:2] for recompute in (False, True)]
    + [(8, VCAOptions(pooled_content=False), block, False, True) for block in BLOCK_OPTIONS[:2]]
    + [(6, VCAOptions(contrast_grid=2), block, True, False) for block in BLOCK_OPTIONS]
)


@pytest.mark.parametrize(
    "grid,options,block_options,recompute,stage2_sdpa",
    BLOCK_OPTION_CASES,
    ids=lambda value: block_ids(value) if isinstance(value, dict) else case_id(value),
)
def test_fast_path_with_qk_norm_and_rope_equals_readable_path(grid, options, block_options, recompute, stage2_sdpa):
    """The ATen core with the pre-step of dit_vca.vca_qk against the readable path: the output and the gradients of
    x and of every parameter, QK-norm's gains included."""
    torch.manual_seed(grid)
    module = perturbed_vca(32, 2, grid, block_index=3, options=options, **block_options)
    module.recompute_qkv, module.stage2_sdpa = recompute, stage2_sdpa
    assert_fast_path_equals_readable_path(module, grid)


def assert_fast_path_equals_readable_path(module: VisualContrastAttention, grid: int) -> None:
    """`forward` against `reference_forward` of `module` on one image of grid×grid tokens: fp32, then float64."""
    x, grad = torch.randn(1, grid * grid, 32), torch.randn(1, grid * grid, 32)
    fast = outputs_and_gradients(module, "forward", x, grad)
    readable = outputs_and_gradients(module, "reference_forward", x, grad)
    assert fast.keys() == readable.keys() and all(value is not None for value in fast.values())
    for name, expected in readable.items():
        # fp32 on both sides, bound relative to the tensor's largest entry (gradients of weights sum B·N
        # products). Exception: the λ vectors' gradient is dλ·∂λ/∂vector with dλ = −Σ dW ⊙ S⁻ over N·n terms
        # that largely cancel (|dλ| ≈ 0.03 from terms of order 1 in one case here), so either path's fp32
        # result sits up to ~1.5e-5 from the float64 value (observed), past the 1e-5 bound of the others. The
        # float64 comparison below is the exact check for those.
        tolerance = 1e-4 if name.startswith("lambda") else 1e-5
        assert (fast[name] - expected).abs().max() <= tolerance * max(1.0, expected.abs().max().item()), name

    # In float64 the two paths agree to rounding (~1e-14): the same function and gradient, not an approximation.
    module64, x64, grad64 = copy.deepcopy(module).double(), x.double(), grad.double()
    fast = outputs_and_gradients(module64, "forward", x64, grad64)
    readable = outputs_and_gradients(module64, "reference_forward", x64, grad64)
    for name, expected in readable.items():
        assert (fast[name] - expected).abs().max() <= 1e-10 * max(1.0, expected.abs().max().item()), name


@pytest.mark.parametrize("stage2_sdpa", [False, True])
def test_fast_path_under_bf16_autocast_matches_readable_path(stage2_sdpa):
    # Under autocast both paths compute in bf16 (8-bit mantissa, ~0.4 % per rounding); a few roundings in a
    # row differ by ~1 % (observed ≤ 1.3 %), a wrong formula by far more. Parameter gradients stay fp32.
    module = perturbed_vca(32, 2, 8, block_index=3, options=VCAOptions())
    module.stage2_sdpa = stage2_sdpa
    x, grad = torch.randn(2, 64, 32), torch.randn(2, 64, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast = outputs_and_gradients(module, "forward", x, grad)
        readable = outputs_and_gradients(module, "reference_forward", x, grad)
    assert fast["output"].dtype == torch.bfloat16 and fast["qkv.weight"].dtype == torch.float32
    for name in ("output", "x", "qkv.weight", "contrast_embed", "lambda2.q1", "value_conv.weight"):
        expected = readable[name].float()
        assert (fast[name].float() - expected).abs().max() <= 0.03 * expected.abs().max(), name


def test_qk_norm_adds_two_gains_and_rope_no_state():
    # QK-norm: MHSA's names (`q_norm.weight`, `k_norm.weight`, d each); RoPE's tables are non-persistent buffers.
    plain = VisualContrastAttention(32, 2, 8, 0).state_dict()
    both = VisualContrastAttention(32, 2, 8, 0, qk_norm=True, rope=True).state_dict()
    assert {name: tuple(t.shape) for name, t in both.items() if name not in plain} == {
        "q_norm.weight": (16,),
        "k_norm.weight": (16,),
    }
    assert both.keys() - plain.keys() == MultiHeadSelfAttention(
        32, 2, qk_norm=True, rope_grid=8
    ).state_dict().keys() - {
        "qkv.weight",
        "qkv.bias",
        "proj.weight",
        "proj.bias",
    }


def test_state_dict_layout_is_unchanged():
    # Exports written before the fast path still load: same keys, same shapes (C = 32, h = 2, 8×8 grid, p = 4).
    module = VisualContrastAttention(32, 2, 8, 0)
    lambda_shapes = {f"lambda{i}.{v}": (16,) for i in (1, 2) for v in ("q1", "k1", "q2", "k2")}
    assert {name: tuple(t.shape) for name, t in module.state_dict().items()} == {
        "qkv.weight": (96, 32),
        "qkv.bias": (96,),
        "contrast_embed": (1, 2, 2, 16, 16),
        **lambda_shapes,
        "norm1.weight": (16,),
        "norm2.weight": (16,),
        "value_conv.weight": (32, 1, 3, 3),
        "value_conv.bias": (32,),
        "proj.weight": (32, 32),
        "proj.bias": (32,),
    }


def layer_saved_bytes(module: torch.nn.Module, tokens: int, dim: int) -> int:
    x = torch.randn(1, tokens, dim, requires_grad=True)
    return saved_activation_bytes(lambda: module(x), [*module.parameters(), *module.buffers()])


def lambda_bytes(module: VisualContrastAttention) -> int:
    """What the core keeps of λ for the backward (float32): λ, the exponentials of its two terms and its vectors
    stacked (q, k, q of each term), per differential stage."""
    stages = int(module.options.stage1_differential) + int(module.options.stage2_differential)
    return 4 * stages * (1 + 2 + 6 * module.head_dim)


@pytest.mark.parametrize("tokens", [256, 1024])
def test_vca_saves_one_token_tensor_more_for_backward_than_mhsa(tokens):
    """The fused core keeps x, q, k, v, the value image of its convolution (built once, in the forward) and the
    output projection's input: 6·N·C values, against MHSA's 5·N·C + h·N (x, q, k, v, the attention output and its
    log-sum-exp), and the readable path's far more; with recompute_qkv x and the projection's input alone."""
    dim, heads, grid = 384, 6, int(tokens**0.5)
    mhsa = layer_saved_bytes(MultiHeadSelfAttention(dim, heads), tokens, dim)
    assert mhsa == 4 * (5 * tokens * dim + heads * tokens)
    for contrast_grid in (8, None):  # n = 64 and n = N/4
        vca = VisualContrastAttention(dim, heads, grid, 0, VCAOptions(contrast_grid=contrast_grid))
        assert layer_saved_bytes(vca, tokens, dim) == 4 * 6 * tokens * dim + lambda_bytes(vca)
        # The readable path keeps every intermediate, N×2n probabilities included: well above MHSA.
        readable = saved_activation_bytes(
            lambda vca=vca: vca.reference_forward(torch.randn(1, tokens, dim)), vca.parameters()
        )
        assert readable > 2 * mhsa
        vca.recompute_qkv = True  # x and the projection input only: 2·N·C floats and λ's
        assert layer_saved_bytes(vca, tokens, dim) == 4 * 2 * tokens * dim + lambda_bytes(vca)


def test_qk_norm_and_rope_add_nothing_to_what_vca_saves():
    """QK-norm and RoPE run inside the core, whose backward recomputes them from q and k: VCA with both saves
    what plain VCA saves (x, q, k, v and n-row tensors) plus the gains, a few bytes, below MHSA with both (which
    saves the normalised and rotated q, k beside their inputs, through autograd)."""
    dim, heads, tokens = 384, 6, 256
    plain = VisualContrastAttention(dim, heads, 16, 0, VCAOptions(contrast_grid=8))
    both = VisualContrastAttention(dim, heads, 16, 0, VCAOptions(contrast_grid=8), qk_norm=True, rope=True)
    mhsa = MultiHeadSelfAttention(dim, heads, qk_norm=True, rope_grid=16)
    saved = layer_saved_bytes(both, tokens, dim)
    assert saved == layer_saved_bytes(plain, tokens, dim)
    assert saved < layer_saved_bytes(mhsa, tokens, dim)


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


@pytest.mark.parametrize("tokens,max_ratio", [(256, 1.0), (4096, 0.1)])
def test_vca_core_cost_against_mhsa(tokens, max_ratio):
    dim, heads, grid, n = 384, 6, int(tokens**0.5), 64
    with torch.device("meta"):  # shapes only: the counter needs no data
        vca = VisualContrastAttention(dim, heads, grid, 0, VCAOptions(contrast_grid=8))
        mhsa = MultiHeadSelfAttention(dim, heads)
        x = torch.empty(1, tokens, dim)
        readable, fast, mhsa_cost = (core_multiply_adds(f, x) for f in (vca.reference_forward, vca, mhsa))
    assert mhsa_cost == 2 * tokens**2 * dim
    # VCA.md: ≈ 7·n·N·C + 10·N·C; the counter sees the matmuls (7·n·N·C) and the 3×3 conv (9·N·C), not the
    # element-wise pooling, softmax and norms. Both paths do the same products in the forward pass.
    assert readable == fast == 7 * n * tokens * dim + 9 * tokens * dim
    assert fast / mhsa_cost <= max_ratio


def test_invalid_contrast_grid_names_the_values():
    with pytest.raises(ValueError, match="contrast_grid=3.*16"):
        VisualContrastAttention(64, 4, 16, 0, VCAOptions(contrast_grid=3))
    with pytest.raises(ValueError, match="7x7"):
        VisualContrastAttention(64, 4, 7, 0)


def test_unknown_attention_names_the_value():
    with pytest.raises(ValueError, match="'linear'"):
        build_attention("linear", 64, 4, 8, 0, VCAOptions())


class SDPARecorder:
    """Replaces F.scaled_dot_product_attention (looked up at call time by dit_vca) by a wrapper that records
    the operands of every call: what the SDPA dispatcher sees. (A TorchFunctionMode would not see the calls
    made inside the custom operator's kernel.)"""

    def __init__(self, monkeypatch):
        self.calls = []
        original = F.scaled_dot_product_attention

        def recording(query, key, value, *args, **kwargs):
            self.calls.append({"operands": (query, key, value), "args": args, "kwargs": kwargs})
            return original(query, key, value, *args, **kwargs)

        monkeypatch.setattr(F, "scaled_dot_product_attention", recording)


def fused_kernel_violations(call: dict, low_precision: bool) -> list[str]:
    """What keeps one SDPA call off the flash kernel on CUDA (dit_vca.vca_core.SDPA_FUSED_CONSTRAINTS)."""
    q, k, v = call["operands"]
    problems = []
    if not q.dim() == k.dim() == v.dim() == 4:
        problems.append(f"not 4-D: {q.dim()}, {k.dim()}, {v.dim()}")
    elif not (q.shape[0] == k.shape[0] == v.shape[0] and q.shape[1] == k.shape[1] == v.shape[1]):
        problems.append(f"batch or heads differ: {q.shape}, {k.shape}, {v.shape}")
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        problems.append(f"last-dimension strides {q.stride(-1)}, {k.stride(-1)}, {v.stride(-1)}")
    if not q.dtype == k.dtype == v.dtype:
        problems.append(f"dtypes {q.dtype}, {k.dtype}, {v.dtype}")
    if low_precision and q.dtype not in (torch.float16, torch.bfloat16):
        problems.append(f"{q.dtype} under low-precision autocast: flash takes fp16/bf16 only")
    if not q.shape[-1] == k.shape[-1] == v.shape[-1] <= 256:
        problems.append(f"head dimensions {q.shape[-1]}, {k.shape[-1]}, {v.shape[-1]}")
    if call["args"] or call["kwargs"].get("attn_mask") is not None or call["kwargs"].get("dropout_p", 0):
        problems.append(f"mask or dropout: {call['args']}, {call['kwargs']}")
    return problems


@pytest.mark.parametrize("options", ALL_OPTIONS, ids=switch_ids)
@pytest.mark.parametrize("path", ["forward", "forward-sdpa2", "reference_forward"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_every_sdpa_call_meets_the_fused_kernel_constraints(options, path, precision, monkeypatch):
    """Forward and backward (with recomputation) of every switch combination, both paths, both forms of Stage
    II: each SDPA call takes operands the CUDA flash kernel accepts. The CPU accepts 3-D operands too, which is
    why only this check shows the difference."""
    module = perturbed_vca(64, 2, 8, block_index=1, options=options)  # head dimension 32, a multiple of 8
    module.stage2_sdpa = path == "forward-sdpa2"
    recorder = SDPARecorder(monkeypatch)
    x = torch.randn(2, 64, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        out = getattr(module, path.removesuffix("-sdpa2"))(x)
    out.float().square().mean().backward()
    stage2_calls = (2 if options.stage2_differential and not options.joint_softmax else 1) if module.stage2_sdpa else 0
    assert len(recorder.calls) == 1 + stage2_calls  # Stage I is one call for both streams
    for call in recorder.calls:
        assert not fused_kernel_violations(call, precision == "bf16")


def fp16_scaled_gradients(
    module: VisualContrastAttention, x: torch.Tensor, grad: torch.Tensor, scale: float, fp16: bool
) -> dict[str, torch.Tensor]:
    """The gradients of the parameters and of x for loss = scale · ⟨out, grad⟩ (fp16 autocast or fp32),
    unscaled as a GradScaler would unscale them."""
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
        out = module(x)
    (out.float() * grad).sum().mul(scale).backward()
    return {"x": x.grad / scale, **{name: p.grad / scale for name, p in module.named_parameters()}}


@pytest.mark.parametrize("path", ["forward", "forward-sdpa2", "reference_forward"])
def test_sdpa_calls_with_qk_norm_and_rope_meet_the_fused_kernel_constraints(path, monkeypatch):
    """The normalised and rotated q and k and the rotated contrast tokens reach SDPA in the autocast dtype with a
    unit last stride (bf16, forward and backward)."""
    module = perturbed_vca(64, 2, 8, block_index=1, options=VCAOptions(), qk_norm=True, rope=True)
    module.stage2_sdpa = path == "forward-sdpa2"
    recorder = SDPARecorder(monkeypatch)
    x = torch.randn(2, 64, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = getattr(module, path.removesuffix("-sdpa2"))(x)
    out.float().square().mean().backward()
    assert len(recorder.calls) == 1 + module.stage2_sdpa
    for call in recorder.calls:
        assert not fused_kernel_violations(call, low_precision=True)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_every_parameter_gradient_has_its_parameters_strides(precision):
    """DDP copies a gradient into its bucket view at every step, and warns, when the strides differ; the
    depthwise convolution's weight gradient of a channels-last image comes out channels-last unless the core
    lays it out as its weight."""
    module = perturbed_vca(32, 2, 4, block_index=1, options=VCAOptions())
    x = torch.randn(2, 16, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        module(x).float().sum().backward()
    mismatched = {
        name: (tuple(p.stride()), tuple(p.grad.stride()))
        for name, p in module.named_parameters()
        if p.grad.stride() != p.stride()
    }
    assert mismatched == {}


class ThroughTheOperator(TorchDispatchMode):
    """A dispatch mode that changes nothing: with one active the core goes through its custom operator (what
    torch.compile, fake tensors and FlopCounterMode see) instead of its eager autograd node."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("options", ALL_OPTIONS, ids=switch_ids)
def test_eager_node_and_operator_compute_the_same(options):
    """The core's two doors (dit_vca.vca_core: the autograd.Function eagerly; for torch.compile the custom
    operators, with λ and the output projection traced around them) run the same code: the same output and
    gradients, bit for bit, in float32 and under bf16 autocast (x and the parameters cast in the forward, the
    gradients cast back), but for the projection's bias gradient under autocast, which autograd sums in bf16 there
    (as nn.Linear's) and the eager node in float32: within bf16's rounding of it (2⁻⁸ relative)."""
    module = perturbed_vca(32, 2, 4, block_index=3, options=replace(options, contrast_grid=2))
    x, grad = torch.randn(2, 16, 32), torch.randn(2, 16, 32)
    for autocast in (False, True):
        results = []
        for mode in (contextlib.nullcontext(), ThroughTheOperator()):
            with mode, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                results.append(outputs_and_gradients(module, "forward", x, grad.bfloat16() if autocast else grad))
        eager, operator = results
        for name, value in eager.items():
            if autocast and name == "proj.bias":
                assert ((value - operator[name]).abs() <= 2**-8 * value.abs()).all(), name
                continue
            assert value is None and operator[name] is None or torch.equal(value, operator[name]), name


@pytest.mark.parametrize("block_options", [{}, dict(qk_norm=True, rope=True)], ids=block_ids)
def test_inference_keeps_nothing_for_a_backward(block_options):
    """Under no_grad or inference_mode (sampling), or with nothing that requires grad, the core builds no autograd
    node and keeps nothing: no tensor goes to autograd, and its output equals the training forward's."""
    module = perturbed_vca(32, 2, 4, block_index=1, options=VCAOptions(), **block_options)
    x = torch.randn(2, 16, 32)
    expected = module(x.clone().requires_grad_())
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            assert saved_activation_bytes(lambda: module(x), module.parameters()) == 0
            out = module(x)
        assert out.grad_fn is None and torch.equal(out, expected.detach())
    frozen = copy.deepcopy(module).requires_grad_(False)
    assert saved_activation_bytes(lambda: frozen(x), frozen.parameters()) == 0 and frozen(x).grad_fn is None


def test_half_precision_parameters_get_gradients_in_their_dtype():
    """A layer whose parameters are bf16 (no autocast): it computes in bf16, λ in float32 from its bf16 vectors,
    and every gradient comes back in bf16, in its parameter's strides, as close to the float32 layer's as the
    readable path's in bf16 are."""
    module = perturbed_vca(32, 2, 4, block_index=1, options=VCAOptions())
    half = copy.deepcopy(module).to(torch.bfloat16)
    x, grad = torch.randn(2, 16, 32), torch.randn(2, 16, 32)
    full = outputs_and_gradients(module, "forward", x, grad)
    result = outputs_and_gradients(half, "forward", x.bfloat16(), grad.bfloat16())
    readable = outputs_and_gradients(half, "reference_forward", x.bfloat16(), grad.bfloat16())
    for name, value in result.items():
        assert value.dtype == torch.bfloat16 and value.stride() == full[name].stride(), name
        error = (value.float() - full[name]).abs().max()
        # Twice the readable path's error in bf16 (its roundings are others, as many), or 5 % of the largest entry.
        bound = max(2 * (readable[name].float() - full[name]).abs().max(), 0.05 * full[name].abs().max())
        assert error <= bound, (name, error, bound)


def test_fp16_loss_scaling_keeps_the_parameter_gradients_finite():
    """A GradScaler's initial scale 2¹⁶ on a mean loss: the gradients of λ, the RMSNorm weights, E± and the
    biases are sums over B·h·N rows, which in fp16 (max 65504) reach inf; summed in fp32 they stay finite and
    match the fp32 gradients."""
    torch.manual_seed(0)
    module = perturbed_vca(64, 2, 16, block_index=3, options=VCAOptions())
    x = torch.randn(4, 256, 64)
    grad = torch.randn(4, 256, 64) / x.numel() ** 0.5  # a mean-like loss: per-element gradients ~ 1/√numel
    scale = 2.0**16
    half = fp16_scaled_gradients(module, x, grad, scale, fp16=True)
    full = fp16_scaled_gradients(module, x, grad, scale, fp16=False)
    for name, expected in full.items():
        assert torch.isfinite(half[name]).all(), name
        # fp16 keeps 11 bits (~5e-4 per rounding); a chain of a few dozen roundings through both stages and the
        # norms stays within 2 % of the largest entry (observed ≤ 0.6 %); an overflow or a wrong sum is far off.
        assert (half[name].float() - expected).abs().max() <= 0.02 * expected.abs().max(), name


def compiled_saved_bytes(module: torch.nn.Module, tokens: int, dim: int) -> int:
    """Activation bytes saved for backward by `module` compiled with inductor (fullgraph, CPU)."""
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True, backend="inductor")
    x = torch.randn(2, tokens, dim, requires_grad=True)
    compiled(x).sum().backward()  # compiles forward and backward
    return saved_activation_bytes(lambda: compiled(x), module.parameters())


@pytest.mark.parametrize("tokens", [256, 1024])
def test_compiled_vca_saves_what_eager_vca_saves(tokens):
    """Under torch.compile (inductor) the fused core stays in the graph, so VCA keeps its memory: what the eager
    core keeps (one (B, N, C) tensor more than compiled MHSA's x, q/k/v and attention output), and with
    recompute_qkv x and the projection input alone. The readable path, which compile used to trace, kept 2.6×
    MHSA (issue 19)."""
    dim, heads, grid = 384, 6, int(tokens**0.5)
    torch.manual_seed(0)
    mhsa = compiled_saved_bytes(MultiHeadSelfAttention(dim, heads), tokens, dim)
    vca = VisualContrastAttention(dim, heads, grid, 0, VCAOptions(contrast_grid=8))
    saved = compiled_saved_bytes(vca, tokens, dim)
    assert saved == 4 * 2 * 6 * tokens * dim + lambda_bytes(vca) and saved <= 1.2 * mhsa  # batch 2
    vca.recompute_qkv = True
    assert compiled_saved_bytes(vca, tokens, dim) < 0.45 * mhsa

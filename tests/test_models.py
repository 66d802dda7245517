"""DiT/SiT backbones: the official checkpoint layout and sizes, the factory and its spec, adaLN-Zero, gradients,
mixed precision, gradient checkpointing and torch.compile."""

import json
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from diffusers.models.embeddings import get_2d_sincos_pos_embed, get_timestep_embedding
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import dit_vca
import sit_vca
from dit_vca.attention import VCAOptions
from dit_vca.model_spec import ModelSpec, model_names
from dit_vca.models import DiT, sincos_pos_embed_2d, timestep_embedding

REFERENCE = Path(__file__).resolve().parent / "data"  # official state-dict shapes, see tests/data/README.md
TINY = dict(depth=2, hidden_size=32, num_heads=2, input_size=8, in_channels=3, num_classes=10)

# Official DiT parameter counts (32×32×4 latent, 1000 classes, learn_sigma), pos_embed included (counted from the
# official code).
OFFICIAL_PARAMETERS = {"DiT-S/2": 32_963_360, "DiT-B/4": 130_475_648, "DiT-XL/2": 675_129_632}


def parameter_count(model: torch.nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def tiny_inputs(model: dit_vca.DiT, batch: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    size = model.spec.input_size
    x = torch.randn(batch, model.spec.in_channels, size, size, generator=generator)
    t = torch.randint(0, 1000, (batch,), generator=generator)
    y = torch.randint(0, model.spec.num_classes + 1, (batch,), generator=generator)  # includes the null class
    return x, t, y


def randomize_zero_init(model: torch.nn.Module) -> None:
    """Replace adaLN-Zero's zeros by small noise so that every parameter influences the output."""
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad and not param.any():
                param.normal_(std=0.02)


@pytest.mark.parametrize("name", list(OFFICIAL_PARAMETERS))
def test_mhsa_matches_official_state_dict(name):
    reference = json.loads((REFERENCE / "dit_state_dict_shapes.json").read_text())[name]
    with torch.device("meta"):  # shapes only, no memory
        model = dit_vca.create_model(name, attention="mhsa")
    shapes = {key: list(value.shape) for key, value in model.state_dict().items()}
    assert shapes == reference
    assert parameter_count(model) == OFFICIAL_PARAMETERS[name]
    assert not model.pos_embed.requires_grad


def test_dit_s2_trainable_parameters():
    with torch.device("meta"):
        model = dit_vca.create_model("DiT-S/2", attention="mhsa")
    assert parameter_count(model, trainable_only=True) == 32_865_056  # official count without pos_embed


def test_vca_model_overhead_matches_formula():
    with torch.device("meta"):
        vca = dit_vca.create_model("DiT-S/2", attention="vca")
        mhsa = dit_vca.create_model("DiT-S/2", attention="mhsa")
    C, d, n = 384, 64, 64  # 16×16 tokens, default grid H/2 = 8
    per_layer = 2 * n * C + 10 * C + 8 * d + 2 * d  # docs/VCA.md, "Parameters"
    assert parameter_count(vca) - parameter_count(mhsa) == 12 * per_layer
    # Outside the attention the two models share every key and shape.
    mhsa_shapes = {k: v.shape for k, v in mhsa.state_dict().items()}
    assert all(vca.state_dict()[k].shape == shape for k, shape in mhsa_shapes.items())


def test_dit_s2_forward_flops():
    # DiT paper: DiT-S/2 at 256 px is 6.06 G multiply-adds per forward; the counter reports 2 FLOPs per MAC and
    # needs the math SDPA backend (fused CPU kernels report 0).
    with torch.device("meta"):
        model = dit_vca.create_model("DiT-S/2", attention="mhsa")
        x, t, y = torch.empty(1, 4, 32, 32), torch.zeros(1), torch.zeros(1, dtype=torch.long)
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            model(x, t, y)
    assert counter.get_total_flops() / 2 == pytest.approx(6.06e9, rel=0.01)


def test_names_and_defaults():
    assert len(model_names("DiT")) == 16 and {"DiT-S/1", "DiT-XL/8"} <= set(model_names("DiT"))  # patch 1, 2, 4, 8
    with torch.device("meta"):
        dit = dit_vca.create_model("DiT-B/4")
        sit = sit_vca.create_model("SiT-B/4")
    assert (dit.spec.learn_sigma, dit.out_channels, sit.spec.learn_sigma, sit.out_channels) == (True, 8, False, 4)
    assert isinstance(sit, dit_vca.DiT)  # one backbone
    assert sit.final_layer.linear.out_features == 4 * 4 * 4


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="DiT-M/2.*DiT-S/2, DiT-S/4"):
        dit_vca.create_model("DiT-M/2")
    with pytest.raises(ValueError, match="SiT-S/2"):
        sit_vca.create_model("DiT-S/2")


def test_invalid_options_name_the_value():
    with pytest.raises(ValueError, match="'flash'"):
        dit_vca.create_model("DiT-S/2", attention="flash", **TINY)
    with pytest.raises(ValueError, match="contrast_grid=3"):
        dit_vca.create_model("DiT-S/2", vca=VCAOptions(contrast_grid=3), **TINY)  # 4×4 token grid
    with pytest.raises(ValueError, match="mhsa"):
        dit_vca.create_model("DiT-S/2", attention="mhsa", vca=VCAOptions(contrast_grid=2), **TINY)
    with pytest.raises(ValueError, match="'VCA-S/2'"):
        DiT(ModelSpec("VCA-S/2"))


@pytest.mark.parametrize("create", [dit_vca.create_model, sit_vca.create_model])
def test_the_spec_as_json_rebuilds_the_model(create):
    family = "DiT" if create is dit_vca.create_model else "SiT"
    model = create(f"{family}-S/4", vca=VCAOptions(contrast_grid=1, stage2_differential=False), **TINY)
    record = json.loads(json.dumps(asdict(model.spec)))  # plain JSON values, as an export records them
    rebuilt = DiT(ModelSpec.from_record(record))
    rebuilt.load_state_dict(model.state_dict())  # same keys and shapes
    assert rebuilt.spec == model.spec
    randomize_zero_init(model)
    rebuilt.load_state_dict(model.state_dict())
    x, t, y = tiny_inputs(model)
    assert torch.equal(model.eval()(x, t, y), rebuilt.eval()(x, t, y))


@pytest.mark.parametrize("attention", ["mhsa", "vca"])
def test_adaln_zero_initial_output_is_exactly_zero(attention):
    model = dit_vca.create_model("DiT-S/2", attention=attention, **TINY)
    out = model(*tiny_inputs(model))
    assert out.shape == (3, 6, 8, 8)
    assert torch.equal(out, torch.zeros_like(out))


VARIANTS = [
    dict(attention="mhsa"),
    dict(attention="vca"),
    dict(attention="vca", vca=VCAOptions(joint_softmax=False, pooled_content=False)),
    dict(attention="vca", vca=VCAOptions(stage1_differential=False)),
    dict(attention="vca", vca=VCAOptions(stage2_differential=False)),
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(f"{k}={v}" for k, v in v.items()))
def test_gradients_reach_every_trainable_parameter(variant):
    model = dit_vca.create_model("DiT-S/2", **variant, **TINY)
    randomize_zero_init(model)
    model(*tiny_inputs(model)).square().mean().backward()
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert param.grad is not None and param.grad.abs().sum() > 0, name
        else:
            assert param.grad is None, name


def test_gradient_checkpointing_gives_the_same_gradients():
    plain = dit_vca.create_model("DiT-S/2", **TINY)
    randomize_zero_init(plain)
    checkpointed = dit_vca.create_model("DiT-S/2", gradient_checkpointing=True, **TINY)
    checkpointed.load_state_dict(plain.state_dict())
    inputs = tiny_inputs(plain)
    for model in (plain, checkpointed):
        model.eval()(*inputs).square().mean().backward()
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters()):
        if a.requires_grad:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)  # recomputation: fp32 noise


@pytest.mark.parametrize("attention", ["mhsa", "vca"])
def test_bf16_autocast_is_finite_and_close(attention):
    model = dit_vca.create_model("DiT-S/2", attention=attention, **TINY).eval()
    randomize_zero_init(model)
    inputs = tiny_inputs(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model(*inputs)
    high = model(*inputs)
    assert low.dtype == torch.bfloat16 and low.isfinite().all()
    # bf16 keeps 8 significant bits (relative error 2^-8 ≈ 0.4 % per op); over a 2-block net 5 % of the output
    # scale is a loose but meaningful bound (a wrong op would be off by O(100 %)).
    assert (low.float() - high).abs().max() <= 0.05 * high.abs().max()


def test_label_dropout_uses_the_null_class():
    model = dit_vca.create_model("DiT-S/2", class_dropout_prob=1.0, **TINY)
    randomize_zero_init(model)
    x, t, y = tiny_inputs(model)
    null = torch.full_like(y, model.spec.num_classes)
    dropped = model.train()(x, t, y)
    assert torch.equal(dropped, model.eval()(x, t, null))  # every label dropped in training
    assert not torch.equal(model(x, t, y), dropped)  # none in eval


def test_timestep_embedding_matches_diffusers():
    t = torch.tensor([0.0, 1.0, 0.37, 999.0])  # DDPM indices and SiT's continuous times
    expected = get_timestep_embedding(t, 256, flip_sin_to_cos=True, downscale_freq_shift=0)  # DiT's convention
    torch.testing.assert_close(timestep_embedding(t), expected, rtol=0, atol=1e-5)  # fp32 sin/cos of args ≤ 1e3


@pytest.mark.parametrize("dim,grid", [(384, 16), (64, 4)])
def test_pos_embed_matches_diffusers(dim, grid):
    expected = get_2d_sincos_pos_embed(dim, grid, base_size=grid)  # MAE/DiT layout, positions 0..grid-1
    torch.testing.assert_close(sincos_pos_embed_2d(dim, grid), expected.float(), rtol=0, atol=1e-6)


def test_unpatchify_inverts_the_patch_layout():
    # Official layout: token (i, j) holds out[c, i·p + a, j·p + b] at feature (a·p + b)·C + c.
    model = dit_vca.create_model("DiT-S/4", **TINY)
    p, C, grid = 4, model.out_channels, 2
    image = torch.randn(1, C, grid * p, grid * p)
    tokens = torch.empty(1, grid * grid, p * p * C)
    for i in range(grid):
        for j in range(grid):
            for a in range(p):
                for b in range(p):
                    tokens[0, i * grid + j, (a * p + b) * C : (a * p + b + 1) * C] = image[0, :, i * p + a, j * p + b]
    assert torch.equal(model.unpatchify(tokens), image)


@pytest.mark.parametrize("attention", ["mhsa", "vca"])
def test_compiles_with_fullgraph(attention):
    # fullgraph=True fails on any graph break. The aot_eager backend traces forward and backward graphs like
    # inductor does but skips C++ code generation (about 45 s per model on 2 cores).
    model = dit_vca.create_model("DiT-S/2", attention=attention, **TINY).eval()
    randomize_zero_init(model)
    inputs = tiny_inputs(model)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(*inputs)
    out.square().mean().backward()
    torch.testing.assert_close(out, model(*inputs), rtol=1e-5, atol=1e-6)  # same ops, fp32 reordering only
    assert model.blocks[0].attn.qkv.weight.grad is not None


def test_compiled_dit_vca_keeps_the_fused_core():
    """torch.compile(fullgraph=True) with inductor, the backend training uses (train.compile=true), default
    settings, on the CPU: one graph, no break; VCA's fused core is in it as the opaque operator
    dit_vca::vca_core (not the readable path retraced), and the compiled model's outputs and gradients
    equal the eager model's."""
    model = dit_vca.create_model("DiT-S/2", attention="vca", **TINY)
    randomize_zero_init(model)
    inputs = tiny_inputs(model)
    explanation = torch._dynamo.explain(model)(*inputs)
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0, explanation.break_reasons
    targets = [node.target for graph in explanation.graphs for node in graph.graph.nodes]
    assert targets.count(torch.ops.dit_vca.vca_core.default) == TINY["depth"]
    assert not any("scaled_dot_product_attention" in str(target) for target in targets)

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="inductor")
    out = compiled(*inputs)
    out.square().mean().backward()
    gradients = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    expected = model(*inputs)
    expected.square().mean().backward()
    # fp32 on both sides, the same kernels for the core; inductor reorders the element-wise code around it.
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert (gradients[name] - p.grad).abs().max() <= 1e-5 * max(1.0, p.grad.abs().max().item()), name


def test_qk_norm_and_rope_stay_inside_the_compiled_vca_core():
    """torch.compile(fullgraph=True) sees a VCA model with QK-norm and RoPE as it sees plain VCA: one graph, one
    opaque dit_vca::vca_core per block, and around it the operations of plain VCA (λ from its vectors, the output
    projection, the blocks), none of the options' (no RMSNorm, no rotation: the block norms stay LayerNorm here)."""

    def targets(**block_options) -> Counter:
        model = dit_vca.create_model("DiT-S/2", attention="vca", **block_options, **TINY)
        randomize_zero_init(model)
        explanation = torch._dynamo.explain(model)(*tiny_inputs(model))
        assert explanation.graph_count == 1 and explanation.graph_break_count == 0, explanation.break_reasons
        return Counter(str(node.target) for graph in explanation.graphs for node in graph.graph.nodes
                       if node.op == "call_function")  # fmt: skip

    both, plain = targets(qk_norm=True, rope=True), targets()
    assert both[str(torch.ops.dit_vca.vca_core.default)] == TINY["depth"]
    assert both == plain, (both - plain, plain - both)
    names = " ".join(both)
    assert "rms_norm" not in names and "scaled_dot_product_attention" not in names

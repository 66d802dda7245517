"""LightningDiT's model options in the shared backbone (RMSNorm blocks, SwiGLU, QK-norm, 2-D RoPE) and the presets
(model.blocks) that switch them on, each against closed forms written here: the norm and the MLP as formulas in
float64, RoPE by the properties that define it (a rotation: norms kept; attention logits that depend on the offset
between two positions only) and its frequencies, and MHSA with QK-norm and RoPE as softmax(qkᵀ/√d)·v over explicitly
normalised and rotated queries and keys."""

import math
from pathlib import Path

import pytest
import torch

import dit_vca
import sit_vca
from _tiny_runs import run_train
from dit_vca.attention import MultiHeadSelfAttention
from dit_vca.model_options import BLOCK_PRESETS
from dit_vca.model_spec import ModelSpec
from dit_vca.models import DiT, block_norm, feed_forward, swiglu_hidden_size
from dit_vca.rope import RotaryEmbedding2d, grid_positions, rope_angles, rotate_pairs

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(depth=2, hidden_size=32, num_heads=2, input_size=8, in_channels=3, num_classes=10)
# float64 throughout: the closed forms and the modules agree to rounding (~1e-15 relative); 1e-12 catches any slip.
TOLERANCE = dict(rtol=1e-12, atol=1e-12)


def test_rmsnorm_block_norm_is_the_closed_form_with_a_learned_gain():
    torch.manual_seed(0)
    norm = block_norm("rmsnorm", 16).double()
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 5, 16, dtype=torch.float64) * 4 + 1
    expected = x / torch.sqrt(x.square().mean(-1, keepdim=True) + 1e-6) * norm.weight  # RMSNorm, eps 1e-6
    torch.testing.assert_close(norm(x), expected, **TOLERANCE)
    assert [name for name, _ in norm.named_parameters()] == ["weight"]  # LightningDiT's `normX.weight`
    assert list(block_norm("layernorm", 16).parameters()) == []  # DiT's LayerNorm has no affine parameters


@pytest.mark.parametrize("width, hidden", [(384, 1024), (768, 2048), (1024, 2730), (1152, 3072)])
def test_swiglu_width_is_two_thirds_of_the_gelu_mlp(width, hidden):
    # int(2/3 · 4C) for S, B, L, XL (LightningDiT: SwiGLUFFN(C, int(2/3 · mlp_hidden_dim))).
    assert swiglu_hidden_size(width, 4.0) == hidden
    with torch.device("meta"):
        mlp = feed_forward("swiglu", width, 4.0)
    assert (tuple(mlp.fc1.weight.shape), tuple(mlp.fc2.weight.shape)) == ((2 * hidden, width), (width, hidden))


def test_swiglu_is_silu_of_the_first_half_times_the_second():
    torch.manual_seed(0)
    mlp = feed_forward("swiglu", 12, 4.0).double()
    x = torch.randn(2, 7, 12, dtype=torch.float64)
    hidden = x @ mlp.fc1.weight.T + mlp.fc1.bias  # (2, 7, 2h)
    gate, value = hidden[..., :32], hidden[..., 32:]  # h = int(2/3 · 48) = 32
    expected = (gate / (1 + torch.exp(-gate)) * value) @ mlp.fc2.weight.T + mlp.fc2.bias  # SiLU(a)·b, then w3
    torch.testing.assert_close(mlp(x), expected, **TOLERANCE)


def rotated(vectors: torch.Tensor, rows, cols) -> torch.Tensor:
    """vectors (P, d) rotated by 2-D RoPE at positions (rows, cols)."""
    angles = rope_angles(torch.as_tensor(rows, dtype=torch.float64), torch.as_tensor(cols, dtype=torch.float64), 16)
    return rotate_pairs(vectors, angles.cos(), angles.sin())


def test_rope_is_a_rotation_and_the_identity_at_the_origin():
    torch.manual_seed(0)
    x = torch.randn(6, 16, dtype=torch.float64)
    rows, cols = [0, 1, 5, 2.5, 100, 7], [0, 3, 0, 1, 9, 7]
    y = rotated(x, rows, cols)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), **TOLERANCE)  # lengths kept
    torch.testing.assert_close(y[0], x[0], **TOLERANCE)  # position (0, 0) turns nothing
    # and each channel pair (a 2-D plane) keeps its own length: it is a rotation within the pair
    torch.testing.assert_close(y.view(6, 8, 2).norm(dim=-1), x.view(6, 8, 2).norm(dim=-1), **TOLERANCE)


def test_rope_logits_depend_on_the_offset_between_positions_only():
    torch.manual_seed(0)
    q, k = torch.randn(1, 16, dtype=torch.float64), torch.randn(1, 16, dtype=torch.float64)
    offsets = [(0, 0), (3, -2), (-7, 11), (0.5, 4)]
    for row_q, col_q, row_k, col_k in [(2, 5, 0, 1), (9, 3, 4, 4), (0, 0, 6, 2)]:
        logits = [
            (rotated(q, [row_q + a], [col_q + b]) * rotated(k, [row_k + a], [col_k + b])).sum().item()
            for a, b in offsets
        ]
        assert logits == pytest.approx([logits[0]] * len(offsets), rel=1e-12, abs=1e-12)
        relative = (rotated(q, [row_q - row_k], [col_q - col_k]) * k).sum().item()  # only q turned, by the offset
        assert logits[0] == pytest.approx(relative, rel=1e-12, abs=1e-12)


def test_rope_frequencies_rows_in_the_first_half_columns_in_the_second():
    # Pair m of the first half turns by row · θ^(−m/(d/4)), pair m of the second half by column · the same, θ = 10⁴.
    d, row, col = 16, 3.0, 5.0
    x = torch.zeros(d // 2, d, dtype=torch.float64)
    x[torch.arange(d // 2), 2 * torch.arange(d // 2)] = 1  # each row a unit vector along one pair's first axis
    y = rotated(x, [row] * (d // 2), [col] * (d // 2))
    angles = torch.atan2(
        y[torch.arange(d // 2), 2 * torch.arange(d // 2) + 1], y[torch.arange(d // 2), 2 * torch.arange(d // 2)]
    )
    omega = torch.tensor([10_000 ** (-m / (d / 4)) for m in range(d // 4)], dtype=torch.float64)
    expected = torch.cat([row * omega, col * omega])
    torch.testing.assert_close(angles, torch.atan2(expected.sin(), expected.cos()), **TOLERANCE)


def test_rope_module_covers_the_grid_row_major():
    rope = RotaryEmbedding2d(16, 4)
    assert rope.cos.shape == (16, 8) and not dict(rope.state_dict())  # non-persistent: in no state dict
    angles = rope_angles(torch.tensor([2.0]), torch.tensor([3.0]), 16)  # token 2·4 + 3 = 11
    torch.testing.assert_close(rope.cos[11], angles[0].cos().float())


def test_mhsa_with_qk_norm_and_rope_is_attention_over_normalised_rotated_queries_and_keys():
    torch.manual_seed(0)
    attention = MultiHeadSelfAttention(32, 2, qk_norm=True, rope_grid=4).double()
    with torch.no_grad():
        attention.q_norm.weight.normal_()
        attention.k_norm.weight.normal_()
    x = torch.randn(2, 16, 32, dtype=torch.float64)
    q, k, v = (x @ attention.qkv.weight.T + attention.qkv.bias).view(2, 16, 3, 2, 16).permute(2, 0, 3, 1, 4)

    def rms(t, gain):
        return t / torch.sqrt(t.square().mean(-1, keepdim=True) + 1e-6) * gain

    grid = torch.arange(4, dtype=torch.float64)
    rows, cols = grid.repeat_interleave(4), grid.repeat(4)  # token i at (i // 4, i % 4)
    angles = rope_angles(rows, cols, 16)
    q = rotate_pairs(rms(q, attention.q_norm.weight), angles.cos(), angles.sin())
    k = rotate_pairs(rms(k, attention.k_norm.weight), angles.cos(), angles.sin())
    weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(16), dim=-1)
    expected = (weights @ v).transpose(1, 2).reshape(2, 16, 32) @ attention.proj.weight.T + attention.proj.bias
    # The module's RoPE tables are float32 (as used), rounded by ~6e-8 relative: the logits move by ~1e-7 at most.
    torch.testing.assert_close(attention(x), expected, rtol=1e-6, atol=1e-7)


def test_every_option_is_off_by_default_and_the_dit_preset_is_the_default():
    assert BLOCK_PRESETS["dit"] == dict(norm="layernorm", mlp="gelu", qk_norm=False, rope=False)
    torch.manual_seed(0)
    default = dit_vca.create_model("DiT-S/2", attention="mhsa", **TINY)
    torch.manual_seed(0)
    explicit = dit_vca.create_model("DiT-S/2", attention="mhsa", **TINY, **BLOCK_PRESETS["dit"])
    assert default.state_dict().keys() == explicit.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(default.state_dict().values(), explicit.state_dict().values()))
    assert default.spec.block_options == BLOCK_PRESETS["dit"] and default.spec.blocks == "dit"


def test_the_lightning_preset_builds_its_layout_rebuilds_from_its_spec_and_trains():
    options = ModelSpec("SiT-S/2", blocks="lightning-qknorm").block_options
    assert options == dict(norm="rmsnorm", mlp="swiglu", qk_norm=True, rope=True)
    assert ModelSpec("SiT-S/2", blocks="lightning", rope=False).block_options["rope"] is False  # a setting wins
    assert ModelSpec("SiT-S/2", blocks="lightning", rope=None).block_options["rope"] is True  # None: the preset's
    torch.manual_seed(0)
    model = sit_vca.create_model("SiT-S/2", attention="mhsa", **TINY, blocks="lightning-qknorm")
    keys = set(model.state_dict())
    assert {"blocks.0.norm1.weight", "blocks.0.attn.q_norm.weight", "final_layer.norm_final.weight"} <= keys
    assert model.blocks[0].mlp.fc1.out_features == 2 * swiglu_hidden_size(32, 4.0)
    rebuilt = DiT(model.spec)
    rebuilt.load_state_dict(model.state_dict())
    x, t, y = torch.randn(2, 3, 8, 8), torch.rand(2), torch.tensor([1, 10])
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(x, t, y), model(x, t, y), rtol=0, atol=0)
    for parameter in model.parameters():  # adaLN-Zero hides everything else from the loss: wake it
        if parameter.requires_grad and not parameter.any():
            torch.nn.init.normal_(parameter, std=0.02)
    model(x, t, y).square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters() if p.requires_grad)


def test_the_startup_summary_names_the_block_options_that_are_not_dits():
    from training.summary import describe_model

    with torch.device("meta"):
        lightning = dit_vca.create_model("DiT-XL/2", attention="mhsa", blocks="lightning")
        dit = dit_vca.create_model("DiT-XL/2", attention="mhsa")
    assert describe_model(lightning.spec) == "DiT-XL/2 with rmsnorm, swiglu (hidden width 3072), rope"
    assert describe_model(dit.spec) == "DiT-XL/2"


def test_vca_takes_every_block_option_of_the_presets():
    # QK-norm and RoPE apply inside VCA's core (tests/test_attention.py, test_vca_triton.py check the arithmetic);
    # a preset switches them on for VCA as for MHSA, and the spec rebuilds the same model.
    model = dit_vca.create_model("DiT-S/2", attention="vca", **TINY, blocks="lightning-qknorm")
    assert model.spec.block_options == BLOCK_PRESETS["lightning-qknorm"]
    attention = model.blocks[0].attn
    assert attention.q_norm.weight.shape == (16,) and attention.rope.cos.shape == (16, 8)  # d = 16, N = 16
    assert attention.contrast_rope.cos.shape == (4, 8)  # n = 4 contrast tokens, p = H/2 = 2
    rebuilt = DiT(model.spec)
    assert list(rebuilt.state_dict()) == list(model.state_dict())


def test_contrast_tokens_sit_at_their_pooling_cells_centres():
    # Cells of r×r tokens: cell (a, b) covers rows a·r … a·r + r − 1, its centre a·r + (r − 1)/2 (half-integer for
    # even r), in the tokens' own units; r = 1 gives the tokens themselves.
    rows, cols = grid_positions(4, 2)
    assert rows.tolist() == [0.5, 0.5, 2.5, 2.5] and cols.tolist() == [0.5, 2.5, 0.5, 2.5]
    rows, cols = grid_positions(6, 3)
    assert rows.tolist() == [1, 1, 4, 4] and cols.tolist() == [1, 4, 1, 4]
    rows, cols = grid_positions(3)
    assert rows.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2] and cols.tolist() == [0, 1, 2] * 3
    centres = RotaryEmbedding2d(16, 4, cell=2)
    angles = rope_angles(torch.tensor([2.5]), torch.tensor([0.5]), 16)  # cell (1, 0)
    torch.testing.assert_close(centres.cos[2], angles[0].cos().float())
    with pytest.raises(ValueError, match="cells of 3x3 tokens do not tile a 4x4 grid"):
        grid_positions(4, 3)


def test_unknown_options_and_head_dimensions_that_rope_cannot_split_name_the_value():
    with pytest.raises(ValueError, match="norm='batchnorm'"):
        dit_vca.create_model("DiT-S/2", attention="mhsa", norm="batchnorm", **TINY)
    with pytest.raises(ValueError, match="unknown block preset 'modern'"):
        dit_vca.create_model("DiT-S/2", blocks="modern", **TINY)
    with pytest.raises(ValueError, match="head dimension divisible by 4, got 6"):
        dit_vca.create_model("DiT-S/2", attention="mhsa", rope=True, **{**TINY, "hidden_size": 24, "num_heads": 4})


def test_mixed_precision_keeps_rope_and_qk_norm_in_float32():
    # Under bf16 autocast q and k arrive in bf16; the norm and the rotation compute in float32 and hand SDPA bf16
    # operands of one dtype. The output is close to the float32 forward (bf16's 8 mantissa bits: ~1e-2).
    torch.manual_seed(0)
    model = dit_vca.create_model("DiT-S/2", attention="mhsa", **TINY, blocks="lightning-qknorm")
    for parameter in model.parameters():
        if parameter.requires_grad and not parameter.any():
            torch.nn.init.normal_(parameter, std=0.02)
    x, t, y = torch.randn(2, 3, 8, 8), torch.randint(0, 1000, (2,)), torch.tensor([1, 10])
    with torch.no_grad():
        reference = model(x, t, y)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed = model(x, t, y)
    assert torch.isfinite(mixed).all()
    torch.testing.assert_close(mixed.float(), reference, rtol=0, atol=5e-2 * reference.abs().max().item())


def test_the_block_options_do_not_change_the_official_layout_or_its_key_order():
    with torch.device("meta"):
        model = dit_vca.create_model("DiT-XL/2", attention="mhsa")
        swiglu = dit_vca.create_model("DiT-XL/2", attention="mhsa", mlp="swiglu")
    assert list(model.state_dict()) == list(swiglu.state_dict())  # same names: SwiGLU changes shapes only
    assert swiglu.blocks[0].mlp.fc1.weight.shape == (2 * 3072, 1152)


@pytest.mark.slow
@pytest.mark.parametrize(
    "family, attention, objective",
    [
        ("DiT", "vca", ["model.name=DiT-S/2"]),
        (
            "SiT",
            "mhsa",
            ["model.name=SiT-S/2", "transport.time_distribution=logit-normal", "transport.cosine_loss_weight=1"],
        ),
    ],
)
def test_the_lightning_preset_trains_and_samples_from_the_shipped_digits_config(tmp_path, family, attention, objective):
    """The preset from the repository alone: the shipped digits config, three steps, then sample.py on the run;
    with VCA (QK-norm and RoPE in its core) and with MHSA."""
    import numpy as np

    import sample
    from generation import load_export

    run = tmp_path / "run"
    run_train(
        "--config",
        str(ROOT / "configs" / "digits.yaml"),
        *[f"model.attention={attention}", "model.blocks=lightning-qknorm", "model.hidden_size=32", "model.depth=2"],
        *["model.num_heads=2", "train.betas=[0.9,0.95]", "train.global_batch_size=32", "train.max_steps=3"],
        *["log.sample_every=0", "log.trackers=[]", f"run.dir={run}", *objective],
    )
    description = load_export(run).description
    assert description.model.block_options == BLOCK_PRESETS["lightning-qknorm"]
    steps = ["--sampler", "ddim", "--steps", "4"] if family == "DiT" else ["--sampler", "euler", "--steps", "4"]
    sample.main(["--ckpt", str(run), "--num-samples", "4", "--out", str(tmp_path / "s.npz"), "--cpu", *steps])
    with np.load(tmp_path / "s.npz") as samples:
        assert samples["arr_0"].shape == (4, 8, 8, 3) and samples["arr_0"].dtype == np.uint8

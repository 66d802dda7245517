"""LightningDiT checkpoints (generation.lightning): the published layout's names and shapes load into the backbone
with MHSA, and its forward equals LightningDiT's arithmetic, re-derived here from its equations (RMSNorm with a
gain, adaLN, QK-norm, EVA-02's 2-D RoPE as complex rotations of channel pairs, SwiGLU, the final layer and
unpatchify); then a LightningDiT file becomes an export that samples through a 32-channel f16 autoencoder.

The layout below is read from hustvl/LightningDiT (models/lightningdit.py, models/swiglu_ffn.py,
models/pos_embed.py at 2725fed), not copied: key names per option, RoPE tables as buffers (N, d) of interleaved
pairs, the row angles in the first half of each head and the column angles in the second."""

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL

from _user_errors import one_line_error
from commands import USER_ERROR_STATUS, run_command
from dit_vca.models import DiT
from generation import ImageGenerator, load_export
from generation.lightning import backbone_state_dict, lightning_model_spec, main
from generation.official import OfficialCheckpointError
from objectives import TransportSpec

OPTIONS = dict(use_rmsnorm=True, use_swiglu=True, use_qknorm=True, use_rope=True)


def rope_angles_eva(grid: int, head_dim: int, dtype=torch.float64) -> torch.Tensor:
    """(N, d) angles of EVA-02's VisionRotaryEmbeddingFast(dim=d/2, pt_seq_len=grid): frequencies θ^(−2k/D),
    D = d/2, k < D/2, each used by two adjacent channels; rows in the first D channels, columns in the last."""
    half = head_dim // 2
    freqs = 1.0 / (10_000 ** (torch.arange(0, half, 2, dtype=dtype)[: half // 2] / half))  # (d/4,)
    positions = torch.arange(grid, dtype=dtype) / grid * grid
    per_axis = torch.outer(positions, freqs).repeat_interleave(2, dim=1)  # (G, D)
    rows = per_axis[:, None, :].expand(grid, grid, half)
    cols = per_axis[None, :, :].expand(grid, grid, half)
    return torch.cat([rows, cols], dim=-1).reshape(grid * grid, head_dim)  # token r·G + c


def lightning_state(depth, width, heads, patch, channels, grid, classes, learn_sigma, **options) -> dict:
    """A LightningDiT state dict with random values: the published names and shapes for these sizes and options."""
    options = {**{key: False for key in OPTIONS}, **options}
    head_dim, mlp_hidden = width // heads, 4 * width
    out = patch * patch * channels * (2 if learn_sigma else 1)
    shapes = {
        "pos_embed": (1, grid * grid, width),
        "x_embedder.proj.weight": (width, channels, patch, patch),
        "x_embedder.proj.bias": (width,),
        "t_embedder.mlp.0.weight": (width, 256),
        "t_embedder.mlp.0.bias": (width,),
        "t_embedder.mlp.2.weight": (width, width),
        "t_embedder.mlp.2.bias": (width,),
        "y_embedder.embedding_table.weight": (classes + 1, width),
        "final_layer.linear.weight": (out, width),
        "final_layer.linear.bias": (out,),
        "final_layer.adaLN_modulation.1.weight": (2 * width, width),
        "final_layer.adaLN_modulation.1.bias": (2 * width,),
    }
    if options["use_rmsnorm"]:
        shapes["final_layer.norm_final.weight"] = (width,)
    for i in range(depth):
        block = {
            "attn.qkv.weight": (3 * width, width),
            "attn.qkv.bias": (3 * width,),
            "attn.proj.weight": (width, width),
            "attn.proj.bias": (width,),
            "adaLN_modulation.1.weight": (6 * width, width),
            "adaLN_modulation.1.bias": (6 * width,),
        }
        if options["use_swiglu"]:
            hidden = int(2 / 3 * mlp_hidden)
            block.update({"mlp.w12.weight": (2 * hidden, width), "mlp.w12.bias": (2 * hidden,)})
            block.update({"mlp.w3.weight": (width, hidden), "mlp.w3.bias": (width,)})
        else:
            block.update({"mlp.fc1.weight": (mlp_hidden, width), "mlp.fc1.bias": (mlp_hidden,)})
            block.update({"mlp.fc2.weight": (width, mlp_hidden), "mlp.fc2.bias": (width,)})
        if options["use_rmsnorm"]:
            block.update({"norm1.weight": (width,), "norm2.weight": (width,)})
        if options["use_qknorm"]:  # RMSNorm(head_dim) when use_rmsnorm
            block.update({"attn.q_norm.weight": (head_dim,), "attn.k_norm.weight": (head_dim,)})
        shapes.update({f"blocks.{i}.{key}": shape for key, shape in block.items()})
    generator = torch.Generator().manual_seed(0)
    state = {key: 0.2 * torch.randn(shape, generator=generator) for key, shape in shapes.items()}
    for key in state:
        if key.endswith(("norm1.weight", "norm2.weight", "norm_final.weight", "q_norm.weight", "k_norm.weight")):
            state[key] = 1 + state[key]  # gains near 1, as trained ones are
    if options["use_rope"]:
        angles = rope_angles_eva(grid, head_dim, torch.float32)  # LightningDiT's buffers are float32
        state["feat_rope.freqs_cos"], state["feat_rope.freqs_sin"] = angles.cos(), angles.sin()
    return state


def rms(x, gain):
    return x / torch.sqrt(x.square().mean(-1, keepdim=True) + 1e-6) * gain


def lightning_forward(state, x, t, y, depth, heads, patch, learn_sigma, **options) -> torch.Tensor:
    """LightningDiT's forward, from its equations, on a float64 copy of `state`."""
    options = {**{key: False for key in OPTIONS}, **options}
    w = {key: value.double() for key, value in state.items()}
    B, channels, side, _ = x.shape
    grid = side // patch
    tokens = F.conv2d(x, w["x_embedder.proj.weight"], w["x_embedder.proj.bias"], stride=patch)
    h = tokens.flatten(2).transpose(1, 2) + w["pos_embed"]  # (B, N, C)
    width = h.shape[-1]
    freqs = torch.exp(-math.log(10_000) * torch.arange(128, dtype=torch.float64) / 128)
    t_freq = torch.cat([torch.cos(t[:, None] * freqs), torch.sin(t[:, None] * freqs)], dim=1)
    t_emb = F.linear(F.silu(F.linear(t_freq, w["t_embedder.mlp.0.weight"], w["t_embedder.mlp.0.bias"])),
                     w["t_embedder.mlp.2.weight"], w["t_embedder.mlp.2.bias"])  # fmt: skip
    c = t_emb + w["y_embedder.embedding_table.weight"][y]

    def norm(z, key):
        return rms(z, w[key]) if options["use_rmsnorm"] else F.layer_norm(z, (width,), eps=1e-6)

    head_dim = width // heads
    theta = rope_angles_eva(grid, head_dim)[:, 0::2]  # (N, d/2): one angle per channel pair
    for i in range(depth):
        p = f"blocks.{i}."
        modulation = F.linear(F.silu(c), w[p + "adaLN_modulation.1.weight"], w[p + "adaLN_modulation.1.bias"])
        shift1, scale1, gate1, shift2, scale2, gate2 = modulation[:, None].chunk(6, dim=-1)
        a = norm(h, p + "norm1.weight") * (1 + scale1) + shift1
        q, k, v = (
            F.linear(a, w[p + "attn.qkv.weight"], w[p + "attn.qkv.bias"]).view(B, -1, 3, heads, head_dim).unbind(2)
        )
        if options["use_qknorm"]:
            q, k = rms(q, w[p + "attn.q_norm.weight"]), rms(k, w[p + "attn.k_norm.weight"])
        if options["use_rope"]:  # (x_2m + i x_2m+1) · e^{iθ}
            turn = torch.polar(torch.ones_like(theta), theta)[:, None, :]  # (N, 1, d/2)
            pairs = (torch.view_as_complex(z.reshape(B, -1, heads, head_dim // 2, 2)) for z in (q, k))
            q, k = (torch.view_as_real(z * turn).flatten(3) for z in pairs)
        logits = torch.einsum("bnhd,bmhd->bhnm", q, k) / math.sqrt(head_dim)
        attended = torch.einsum("bhnm,bmhd->bnhd", logits.softmax(-1), v).reshape(B, -1, width)
        h = h + gate1 * F.linear(attended, w[p + "attn.proj.weight"], w[p + "attn.proj.bias"])
        m = norm(h, p + "norm2.weight") * (1 + scale2) + shift2
        if options["use_swiglu"]:
            gate, value = F.linear(m, w[p + "mlp.w12.weight"], w[p + "mlp.w12.bias"]).chunk(2, dim=-1)
            m = F.linear(F.silu(gate) * value, w[p + "mlp.w3.weight"], w[p + "mlp.w3.bias"])
        else:
            m = F.gelu(F.linear(m, w[p + "mlp.fc1.weight"], w[p + "mlp.fc1.bias"]), approximate="tanh")
            m = F.linear(m, w[p + "mlp.fc2.weight"], w[p + "mlp.fc2.bias"])
        h = h + gate2 * m
    shift, scale = F.linear(F.silu(c), w["final_layer.adaLN_modulation.1.weight"],
                            w["final_layer.adaLN_modulation.1.bias"])[:, None].chunk(2, dim=-1)  # fmt: skip
    out = F.linear(norm(h, "final_layer.norm_final.weight") * (1 + scale) + shift, w["final_layer.linear.weight"],
                   w["final_layer.linear.bias"])  # fmt: skip
    out_channels = out.shape[-1] // (patch * patch)
    image = torch.einsum("nhwpqc->nchpwq", out.reshape(B, grid, grid, patch, patch, out_channels))
    image = image.reshape(B, out_channels, side, side)
    return image[:, :channels] if learn_sigma else image


@pytest.mark.parametrize(
    "options",
    [OPTIONS, dict(use_rmsnorm=True, use_swiglu=True, use_rope=True), dict(use_swiglu=True), {}],
    ids=["all", "released", "swiglu-only", "none"],
)
def test_a_lightning_state_dict_loads_and_computes_lightnings_forward(options):
    sizes = dict(depth=2, heads=2, patch=1, learn_sigma=True)
    state = lightning_state(2, 32, 2, 1, 5, 4, 10, True, **options)
    spec = lightning_model_spec(state, "SiT-S/1", "test.pt", num_heads=2)
    expected_options = dict(
        norm="rmsnorm" if options.get("use_rmsnorm") else "layernorm",
        mlp="swiglu" if options.get("use_swiglu") else "gelu",
        qk_norm=bool(options.get("use_qknorm")),
        rope=bool(options.get("use_rope")),
    )
    assert spec.block_options == expected_options
    assert (spec.in_channels, spec.input_size, spec.num_classes, spec.learn_sigma) == (5, 4, 10, True)
    model = DiT(spec)
    model.load_state_dict(backbone_state_dict(state, model.spec, "test.pt"), strict=True)  # every name and shape

    generator = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 4, 4, generator=generator, dtype=torch.float64)
    t, y = torch.tensor([0.1, 0.5, 0.93], dtype=torch.float64), torch.tensor([0, 7, 10])  # 10: the null class
    with torch.no_grad():
        ours = model.eval()(x.float(), t.float(), y)[:, :5].double()  # the velocity half, as LightningDiT returns
    reference = lightning_forward(state, x, t, y, **sizes, **options)
    # The backbone runs in float32 (its timestep features are float32, as the official DiT's), the reference in
    # float64: two blocks of O(1) values agree to ~1e-6; a wrong convention (pair order, axis, norm) moves O(1).
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4 * reference.abs().max().item())


def test_the_released_xl1_layout_matches_key_for_key_and_shape_for_shape():
    # LightningDiT-XL/1 on VA-VAE's 16x16x32 latents, as released (use_qknorm false); on the meta device.
    with torch.device("meta"):
        state = lightning_state(28, 1152, 16, 1, 32, 16, 1000, False, use_rmsnorm=True, use_swiglu=True, use_rope=True)
        spec = lightning_model_spec(state, "SiT-XL/1", "xl1.pt")
        model = DiT(spec)
    rope = {"feat_rope.freqs_cos", "feat_rope.freqs_sin"}
    renamed = {key.replace(".w12.", ".fc1.").replace(".w3.", ".fc2."): tuple(v.shape) for key, v in state.items()}
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == {
        k: v for k, v in renamed.items() if k not in rope
    }
    assert model.blocks[0].mlp.fc2.in_features == 3072 and spec.input_size == 16


def test_foreign_variants_are_refused_by_name():
    state = lightning_state(1, 32, 2, 1, 4, 4, 10, False, use_rope=True)
    spec = lightning_model_spec(state, "SiT-S/1", "x.pt", num_heads=2)
    with pytest.raises(OfficialCheckpointError, match="x.pt is 32 wide, SiT-S/1 384: give its number of heads"):
        lightning_model_spec(state, "SiT-S/1", "x.pt")
    for key, value, message in [
        ("blocks.0.adaLN_modulation.1.weight", torch.zeros(4 * 32, 32), "wo_shift"),
        ("blocks.0.attn.q_norm.bias", torch.zeros(16), "QK-norm as LayerNorm"),
    ]:
        with pytest.raises(OfficialCheckpointError, match=message):
            lightning_model_spec({**state, key: value}, "SiT-S/1", "x.pt", num_heads=2)
    # A patch-2 checkpoint named with patch 1: the error names both patch sizes and the name that fits (before:
    # "16 tokens (not a square grid) or 16 output channels", for a square grid).
    patch2 = lightning_state(1, 32, 2, 2, 4, 4, 10, False)
    with pytest.raises(OfficialCheckpointError) as error:
        lightning_model_spec(patch2, "SiT-S/1", "x.pt", num_heads=2)
    assert str(error.value) == (
        "x.pt has patch size 2 (x_embedder.proj.weight (32, 4, 2, 2)), --model SiT-S/1 patch size 1: "
        "use --model SiT-S/2"
    )
    assert lightning_model_spec(patch2, "SiT-S/2", "x.pt", num_heads=2).input_size == 8
    transposed = {**state, "feat_rope.freqs_cos": rope_angles_eva(4, 16).T.reshape(16, 16).cos()}  # another layout
    with pytest.raises(OfficialCheckpointError, match="feat_rope.freqs_cos .16, 16. is not the 2-D RoPE"):
        backbone_state_dict(transposed, spec, "x.pt")


@pytest.fixture(scope="module")
def f16_vae(tmp_path_factory) -> Path:
    """A randomly initialised 32-channel autoencoder with 16x downsampling (five resolutions), saved locally."""
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("vae") / "f16d32"
    AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 5,
        up_block_types=("UpDecoderBlock2D",) * 5,
        block_out_channels=(8,) * 5,
        layers_per_block=1,
        latent_channels=32,
        norm_num_groups=8,
    ).save_pretrained(folder)
    return folder


def test_a_lightning_checkpoint_becomes_an_export_that_samples_through_its_f16_autoencoder(tmp_path, f16_vae, capsys):
    state = lightning_state(1, 32, 2, 1, 32, 4, 10, False, **OPTIONS)  # 64 px images: 4x4x32 latents, patch 1
    torch.save({"ema": state, "config": {"model": {"model_type": "LightningDiT-S/1"}}}, tmp_path / "ckpt.pt")
    mean, std = torch.linspace(-1, 1, 32).view(1, 32, 1, 1), torch.linspace(0.5, 2, 32).view(1, 32, 1, 1)
    torch.save({"mean": mean, "std": std}, tmp_path / "latents_stats.pt")
    arguments = [str(tmp_path / "ckpt.pt"), "--model", "SiT-S/1", "--num-heads", "2", "--vae", str(f16_vae)]
    run_command(main, [*arguments, "--latent-stats", str(tmp_path / "latents_stats.pt"), "--out", str(tmp_path / "e")])

    export = load_export(tmp_path / "e")
    description = export.description
    assert (description.image_size, description.channels, description.objective.kind) == (64, 32, "transport")
    assert description.latent_mean == pytest.approx(mean.flatten().tolist())
    assert description.latent_std == pytest.approx(std.flatten().tolist())
    images = ImageGenerator.from_export(export).generate([3, 10], [0, 1], sampler="euler", steps=2)
    assert images.shape == (2, 64, 64, 3) and images.dtype.name == "uint8"

    # Statistics of another channel count: one line naming the file, exit status 2, nothing written.
    torch.save({"mean": mean[:, :4], "std": std[:, :4]}, tmp_path / "four.pt")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        run_command(main, [*arguments, "--latent-stats", str(tmp_path / "four.pt"), "--out", str(tmp_path / "x")])
    assert exit_.value.code == USER_ERROR_STATUS and not (tmp_path / "x").exists()
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and f"--latent-stats {tmp_path / 'four.pt'}: expected" in error
    assert "with 32 values each" in error

    # Without statistics: refused, since every released LightningDiT model normalises its latents (before, an
    # export that decodes wrongly was written); --no-latent-norm says the checkpoint was trained without.
    error = one_line_error(main, [*arguments, "--out", str(tmp_path / "x")], capsys)
    assert "--latent-stats missing: LightningDiT normalises its latents per channel" in error
    assert "--no-latent-norm" in error and not (tmp_path / "x").exists()
    stats = ["--latent-stats", str(tmp_path / "latents_stats.pt")]
    error = one_line_error(main, [*arguments, *stats, "--no-latent-norm", "--out", str(tmp_path / "x")], capsys)
    assert "with --no-latent-norm: the statistics are for a model trained with latent_norm" in error
    run_command(main, [*arguments, "--no-latent-norm", "--out", str(tmp_path / "plain")])
    plain = load_export(tmp_path / "plain").description
    assert (plain.latent_mean, plain.latent_std, plain.latent_scale) == (None, None, 1.0)


def test_an_export_written_in_lightnings_format_has_its_layout_and_imports_back(tmp_path, f16_vae, capsys):
    """generation.lightning_writer: a SiT with LightningDiT's block options trained here (random weights) becomes
    LightningDiT's checkpoint: its keys and shapes those of the layout read from LightningDiT's code (this file's
    `lightning_state`), its RoPE buffers EVA-02's tables (the convention the importer checks), its statistics
    latents_stats.pt; imported back, the same weights and statistics. A VCA export is refused by name."""
    import sit_vca
    from generation import ExportDescription, write_export
    from generation.lightning_writer import main as write_main

    torch.manual_seed(0)
    model = sit_vca.create_model(
        "SiT-S/1", attention="mhsa", depth=1, hidden_size=32, num_heads=2, input_size=4, in_channels=32,
        num_classes=10, learn_sigma=False, norm="rmsnorm", mlp="swiglu", qk_norm=True, rope=True,
    )  # fmt: skip
    mean, std = torch.linspace(-1, 1, 32).tolist(), torch.linspace(0.5, 2, 32).tolist()
    description = ExportDescription(
        model=model.spec, objective=TransportSpec(path="linear", prediction="velocity"),
        space="latents", image_size=64, num_classes=10, vae=str(f16_vae), latent_scale=1.0, latent_mean=mean,
        latent_std=std,
    )  # fmt: skip
    write_export(tmp_path / "ours", model.state_dict(), description)
    run_command(write_main, [str(tmp_path / "ours"), "--out", str(tmp_path / "lightning")])
    printed = capsys.readouterr().out
    written = torch.load(tmp_path / "lightning" / "lightningdit.pt", weights_only=True)["ema"]
    layout = lightning_state(1, 32, 2, 1, 32, 4, 10, False, **OPTIONS)
    assert {key: tuple(value.shape) for key, value in written.items()} == {
        key: tuple(value.shape) for key, value in layout.items()
    }
    for key in ("feat_rope.freqs_cos", "feat_rope.freqs_sin"):  # LightningDiT's float32 buffers: agree to ~1e-6
        torch.testing.assert_close(written[key], layout[key], rtol=0, atol=1e-5)
    stats = torch.load(tmp_path / "lightning" / "latents_stats.pt", weights_only=True)
    assert stats["mean"].shape == (1, 32, 1, 1) and stats["std"].flatten().tolist() == pytest.approx(std)

    command = printed.split("import it with: python -m generation.lightning ")[1].split()
    assert command[-2:] == ["--out", "EXPORT"] and "--latent-stats" in command
    run_command(main, [*command[:-1], str(tmp_path / "back")])
    back = load_export(tmp_path / "back")
    assert back.description.latent_mean == pytest.approx(mean) and back.description.latent_std == pytest.approx(std)
    assert back.description.model == description.model
    assert all(torch.equal(back.weights[key], value) for key, value in model.state_dict().items())

    vca = sit_vca.create_model(
        "SiT-S/1", attention="vca", depth=1, hidden_size=32, num_heads=2, input_size=4, in_channels=32, num_classes=10
    )
    vca_description = ExportDescription(**{**description.__dict__, "model": vca.spec})
    write_export(tmp_path / "vca", vca.state_dict(), vca_description)
    error = one_line_error(write_main, [str(tmp_path / "vca"), "--out", str(tmp_path / "x")], capsys)
    assert "attention vca; LightningDiT has MHSA only" in error and not (tmp_path / "x").exists()


def test_a_float16_checkpoint_is_imported_in_float32_and_integer_weights_are_refused(tmp_path, f16_vae, capsys):
    """Issue 47: a float16 LightningDiT checkpoint was refused as "not the 2-D RoPE of dit_vca.rope" (its RoPE
    tables are rounded to float16), and integer "weights" were cast silently. The first is imported, cast to
    float32 with a line that says so, and computes what its float32 original computes to float16's rounding; the
    second is one line naming the tensor."""
    state = lightning_state(1, 32, 2, 1, 32, 4, 10, False, **OPTIONS)
    half = {key: value.half() for key, value in state.items()}
    torch.save({"ema": half}, tmp_path / "half.pt")
    arguments = ["--model", "SiT-S/1", "--num-heads", "2", "--vae", str(f16_vae), "--no-latent-norm"]
    run_command(main, [str(tmp_path / "half.pt"), *arguments, "--out", str(tmp_path / "e")])
    assert f"{tmp_path / 'half.pt'}: float16 weights, cast to float32 in the export" in capsys.readouterr().out
    weights = load_export(tmp_path / "e").weights
    assert all(value.dtype == torch.float32 for value in weights.values())
    key = "blocks.0.attn.qkv.weight"
    assert torch.equal(weights[key], state[key].half().float())  # the float16 values themselves, widened

    integer = {**state, "blocks.0.attn.proj.bias": torch.zeros(32, dtype=torch.int64)}
    torch.save({"ema": integer}, tmp_path / "integer.pt")
    with pytest.raises(SystemExit) as exit_:
        run_command(main, [str(tmp_path / "integer.pt"), *arguments, "--out", str(tmp_path / "x")])
    error = capsys.readouterr().err
    assert exit_.value.code == USER_ERROR_STATUS and error.count("\n") == 1, error
    assert "integer.pt: blocks.0.attn.proj.bias holds int64 values; a LightningDiT checkpoint's weights are" in error
    assert not (tmp_path / "x").exists()

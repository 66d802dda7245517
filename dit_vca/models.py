"""The DiT backbone (Peebles & Xie, 2023), shared by DiT and SiT, with MHSA or Visual-Contrast Attention.

With attention="mhsa" the parameter layout is the official one (key for key, shape for shape), so official
DiT checkpoints load with `load_state_dict`, and official SiT checkpoints into a SiT built with learn_sigma=True
(they carry the unused variance half). The method and the conventions: docs/VCA.md. LightningDiT's block options
(RMSNorm, SwiGLU, QK-norm, 2-D RoPE; their presets: `dit_vca.model_options.RECIPES`) are off by default; with them
the layout is LightningDiT's, up to the names of the SwiGLU matrices (generation.lightning).
"""

import math
from dataclasses import asdict, fields

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from objectives import MODEL_FAMILIES

from .attention import ATTENTION_KINDS, build_attention, resolve_contrast_grid
from .model_options import MLPS, NORMS, VCAOptions

TIMESTEP_FREQUENCY_DIM = 256  # width of the sinusoidal timestep features
MAX_PERIOD = 10_000  # longest period of the timestep and position sinusoids
NORM_EPS = 1e-6  # LayerNorm eps of the official DiT (and of LightningDiT's RMSNorm)


#################################################################################
#                     Embedding layers for timesteps, labels, positions         #
#################################################################################


def timestep_embedding(t: Tensor, dim: int = TIMESTEP_FREQUENCY_DIM, max_period: int = MAX_PERIOD) -> Tensor:
    """Sinusoidal features [cos(t·ω), sin(t·ω)] of (possibly fractional) timesteps t (B,) -> (B, dim).

    Written here rather than imported from diffusers to keep the model free of that heavy import; the tests
    check it against diffusers' `get_timestep_embedding`.
    """
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]  # (B, dim/2)
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)  # (B, dim)


def sincos_pos_embed_2d(dim: int, grid_size: int, device: torch.device | None = None) -> Tensor:
    """Fixed 2-D sin-cos position embedding of a grid_size² token grid (row-major) -> (grid_size², dim).

    The first half of the channels encodes the column, the second half the row (the official DiT/MAE order).
    """
    quarter = dim // 4
    omega = 1.0 / MAX_PERIOD ** (torch.arange(quarter, dtype=torch.float64, device=device) / quarter)  # (dim/4,)
    coords = torch.arange(grid_size, dtype=torch.float64, device=device)
    rows, cols = torch.meshgrid(coords, coords, indexing="ij")  # (G, G) each

    def encode(positions: Tensor) -> Tensor:
        args = positions.reshape(-1, 1) * omega  # (G², dim/4)
        return torch.cat([torch.sin(args), torch.cos(args)], dim=1)  # (G², dim/2)

    return torch.cat([encode(cols), encode(rows)], dim=1).float()  # (G², dim)


class TimestepEmbedder(nn.Module):
    """Embeds scalar timesteps into vectors: sinusoidal features followed by an MLP."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(TIMESTEP_FREQUENCY_DIM, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size)
        )

    def forward(self, t: Tensor) -> Tensor:
        return self.mlp(timestep_embedding(t))  # (B, C)


class LabelEmbedder(nn.Module):
    """Embeds class labels; during training drops them to the null class `num_classes` for classifier-free guidance."""

    def __init__(self, num_classes: int, hidden_size: int, dropout_prob: float):
        super().__init__()
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob
        self.embedding_table = nn.Embedding(num_classes + int(dropout_prob > 0), hidden_size)

    def forward(self, labels: Tensor) -> Tensor:
        if self.training and self.dropout_prob > 0:
            drop = torch.rand(labels.shape, device=labels.device) < self.dropout_prob  # (B,)
            labels = torch.where(drop, self.num_classes, labels)
        return self.embedding_table(labels)  # (B, C)


#################################################################################
#                                 Core DiT model                                #
#################################################################################


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """adaLN modulation of tokens (B, N, C) by per-sample shift and scale (B, C)."""
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def block_norm(kind: str, width: int) -> nn.Module:
    """A block's normalisation: "layernorm" without affine parameters (DiT) or "rmsnorm" with a learned gain
    `weight` (LightningDiT), both with eps 1e-6; adaLN modulates either."""
    if kind == "rmsnorm":
        return nn.RMSNorm(width, eps=NORM_EPS)
    return nn.LayerNorm(width, elementwise_affine=False, eps=NORM_EPS)


def swiglu_hidden_size(width: int, mlp_ratio: float) -> int:
    """LightningDiT's SwiGLU width: two thirds of the GELU MLP's, int(2/3 · int(mlp_ratio · C)) (3072 for
    XL's 1152), so that its three matrices hold about as many parameters as the GELU MLP's two."""
    return int(2 / 3 * int(width * mlp_ratio))


def feed_forward(kind: str, width: int, mlp_ratio: float) -> nn.Module:
    """A block's MLP: "gelu", fc2(GELU_tanh(fc1(x))) (DiT), or "swiglu", fc2(SiLU(a) · b) where (a, b) are the two
    halves of fc1(x) (LightningDiT's w12 and w3 under timm's names)."""
    from timm.layers import GluMlp, Mlp  # imported where used: a config check or --help never pays for timm

    if kind == "swiglu":
        hidden = swiglu_hidden_size(width, mlp_ratio)
        return GluMlp(width, 2 * hidden, act_layer=nn.SiLU, gate_last=False)  # gate: the first half
    return Mlp(width, int(width * mlp_ratio), act_layer=lambda: nn.GELU(approximate="tanh"))


class DiTBlock(nn.Module):
    """A transformer block with adaLN-Zero conditioning; its token mixer is MHSA or VCA, its norms and MLP those
    of `norm` and `mlp` (block_norm, feed_forward)."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        mlp_ratio: float,
        attention: nn.Module,
        norm: str = "layernorm",
        mlp: str = "gelu",
    ):
        super().__init__()
        self.norm1 = block_norm(norm, hidden_size)
        self.attn = attention
        self.norm2 = block_norm(norm, hidden_size)
        self.mlp = feed_forward(mlp, hidden_size, mlp_ratio)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))  # (B, N, C)
        return x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))  # (B, N, C)


class FinalLayer(nn.Module):
    """The last adaLN-modulated norm (the blocks' kind) and the linear map from tokens to patches."""

    def __init__(self, hidden_size: int, patch_size: int, out_channels: int, norm: str = "layernorm"):
        super().__init__()
        self.norm_final = block_norm(norm, hidden_size)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))  # (B, N, p·p·out)


class DiT(nn.Module):
    """Diffusion/flow transformer over a latent image, conditioned on a timestep and a class label.

    `model(x, t, y)`: x (B, in_channels, H, W); t (B,) DDPM step index (DiT) or time in [0, 1] (SiT);
    y (B,) labels, `num_classes` being the null label. Returns (B, out_channels, H, W).
    Models built by `create_model` also carry `config`, the dict that rebuilds them.
    """

    def __init__(
        self,
        input_size: int = 32,
        patch_size: int = 2,
        in_channels: int = 4,
        hidden_size: int = 1152,
        depth: int = 28,
        num_heads: int = 16,
        mlp_ratio: float = 4.0,
        class_dropout_prob: float = 0.1,
        num_classes: int = 1000,
        learn_sigma: bool = True,
        attention: str = "vca",
        vca_options: VCAOptions = VCAOptions(),
        gradient_checkpointing: bool = False,
        norm: str = "layernorm",
        mlp: str = "gelu",
        qk_norm: bool = False,
        rope: bool = False,
    ):
        super().__init__()
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"unknown attention {attention!r}; expected one of {ATTENTION_KINDS}")
        if norm not in NORMS or mlp not in MLPS:
            raise ValueError(f"norm={norm!r}, mlp={mlp!r}: expected norm one of {NORMS} and mlp one of {MLPS}")
        if attention == "mhsa" and vca_options != VCAOptions():
            raise ValueError(f"VCA options {vca_options} have no effect with attention='mhsa'")
        if input_size % patch_size:
            raise ValueError(f"input_size={input_size} is not divisible by the patch size {patch_size}")
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size={hidden_size} is not divisible by num_heads={num_heads}")
        grid_size = input_size // patch_size
        if attention == "vca":
            resolve_contrast_grid(grid_size, vca_options.contrast_grid)  # fail before building anything
        if rope and (hidden_size // num_heads) % 4:
            raise ValueError(f"rope needs a head dimension divisible by 4, got {hidden_size // num_heads}")

        self.input_size = input_size
        self.patch_size = patch_size
        self.in_channels = in_channels
        self.learn_sigma = learn_sigma
        self.out_channels = 2 * in_channels if learn_sigma else in_channels
        self.num_classes = num_classes
        self.num_heads = num_heads
        self.gradient_checkpointing = gradient_checkpointing

        from timm.layers import PatchEmbed  # imported where used, as in DiTBlock

        self.x_embedder = PatchEmbed(input_size, patch_size, in_channels, hidden_size, bias=True)
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.y_embedder = LabelEmbedder(num_classes, hidden_size, class_dropout_prob)
        # A frozen parameter, not a buffer, to keep the official state-dict key and parameter count.
        self.pos_embed = nn.Parameter(torch.zeros(1, grid_size**2, hidden_size), requires_grad=False)
        self.blocks = nn.ModuleList(
            DiTBlock(
                hidden_size,
                num_heads,
                mlp_ratio,
                build_attention(attention, hidden_size, num_heads, grid_size, index, vca_options, qk_norm, rope),
                norm,
                mlp,
            )
            for index in range(depth)
        )
        self.final_layer = FinalLayer(hidden_size, patch_size, self.out_channels, norm)
        self.initialize_weights()

    def initialize_weights(self) -> None:
        """Official DiT initialisation: xavier linears, N(0, 0.02) embeddings, zero adaLN and output (adaLN-Zero).

        VCA's own parameters (E±, λ vectors, RMSNorm, depthwise conv) and the gains of RMSNorm blocks and QK-norm
        (ones) keep the initialisation of their module.
        """

        def init_linear(module: nn.Module) -> None:
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)

        self.apply(init_linear)
        with torch.no_grad():
            grid_size = self.input_size // self.patch_size
            self.pos_embed.copy_(sincos_pos_embed_2d(self.pos_embed.shape[-1], grid_size, self.pos_embed.device))
        patch_weight = self.x_embedder.proj.weight
        nn.init.xavier_uniform_(patch_weight.view(patch_weight.shape[0], -1))
        nn.init.zeros_(self.x_embedder.proj.bias)
        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        zero_init = [block.adaLN_modulation[-1] for block in self.blocks]
        zero_init += [self.final_layer.adaLN_modulation[-1], self.final_layer.linear]
        for linear in zero_init:
            nn.init.zeros_(linear.weight)
            nn.init.zeros_(linear.bias)

    def unpatchify(self, x: Tensor) -> Tensor:
        """(B, N, p·p·out) tokens -> (B, out, H, W) image, in the official channel order."""
        p, c, grid = self.patch_size, self.out_channels, self.input_size // self.patch_size
        x = x.reshape(x.shape[0], grid, grid, p, p, c)  # (B, h, w, p, p, c)
        return torch.einsum("nhwpqc->nchpwq", x).reshape(x.shape[0], c, grid * p, grid * p)  # (B, c, H, W)

    def forward(
        self, x: Tensor, t: Tensor, y: Tensor, hidden_after: int | None = None
    ) -> Tensor | tuple[Tensor, Tensor]:
        """The prediction (B, out, H, W); with `hidden_after=k` also the tokens (B, N, C) after block k (1-based),
        which representation alignment (training.repa) trains towards an encoder's features."""
        x = self.x_embedder(x) + self.pos_embed  # (B, N, C)
        c = self.t_embedder(t) + self.y_embedder(y)  # (B, C)
        hidden = None
        for index, block in enumerate(self.blocks, start=1):
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, c, use_reentrant=False)  # (B, N, C)
            else:
                x = block(x, c)  # (B, N, C)
            if index == hidden_after:
                hidden = x  # (B, N, C)
        output = self.unpatchify(self.final_layer(x, c))  # (B, out, H, W)
        return output if hidden_after is None else (output, hidden)


#################################################################################
#                                 Model factory                                 #
#################################################################################

MODEL_SIZES = {"S": (12, 384, 6), "B": (12, 768, 12), "L": (24, 1024, 16), "XL": (28, 1152, 16)}  # depth, width, heads
PATCH_SIZES = (1, 2, 4, 8)  # 1: LightningDiT's XL/1 on 16x16 latents of an f16 autoencoder

# Model configs written before VCAOptions became one section held its fields at the top level.
LEGACY_VCA_KEYS = tuple(field.name for field in fields(VCAOptions))


def model_names(family: str) -> tuple[str, ...]:
    """The sixteen names of a family, e.g. "DiT-S/1" … "DiT-XL/8"."""
    return tuple(f"{family}-{size}/{patch}" for size in MODEL_SIZES for patch in PATCH_SIZES)


def all_model_names() -> tuple[str, ...]:
    """Every valid model name, DiT first."""
    return tuple(name for family in MODEL_FAMILIES for name in model_names(family))


def model_family(name: str) -> str:
    """ "DiT" or "SiT" for a valid model name such as "SiT-XL/2"; ValueError naming the valid names otherwise."""
    family = name.split("-", 1)[0] if isinstance(name, str) else None
    if family not in MODEL_FAMILIES or name not in model_names(family):
        raise ValueError(f"unknown model name {name!r}; valid names: {', '.join(all_model_names())}")
    return family


def name_size(name: str) -> tuple[tuple[int, int, int], int]:
    """((depth, width, heads), patch size) that a valid model name such as "SiT-XL/2" stands for."""
    size, patch = name.split("-", 1)[1].split("/")
    return MODEL_SIZES[size], int(patch)


def create_backbone(
    family: str,
    name: str,
    attention: str = "vca",
    input_size: int = 32,
    in_channels: int = 4,
    num_classes: int = 1000,
    learn_sigma: bool | None = None,
    class_dropout_prob: float = 0.1,
    vca: VCAOptions | dict | None = None,
    *,
    gradient_checkpointing: bool = False,
    depth: int | None = None,
    hidden_size: int | None = None,
    num_heads: int | None = None,
    mlp_ratio: float = 4.0,
    norm: str = "layernorm",
    mlp: str = "gelu",
    qk_norm: bool = False,
    rope: bool = False,
) -> DiT:
    """Build the model `name` of `family` ("DiT" or "SiT"); the result's `config` rebuilds it.

    attention: "vca" or "mhsa" (the official baseline). input_size: latent side. learn_sigma: None means the
    family's default (DiT True, SiT False). vca: the `VCAOptions` (contrast grid and ablation switches, see
    `dit_vca.attention`), or a dict of them; None means the defaults. depth, hidden_size, num_heads and
    mlp_ratio override the size given by the name (for tiny test and demo models). norm ("layernorm" |
    "rmsnorm"), mlp ("gelu" | "swiglu"), qk_norm and rope (in MHSA and in VCA's core) are the block options, DiT's by
    default; `dit_vca.model_options.recipe_options` gives a recipe's set (RECIPES).
    """
    if model_family(name) != family:
        raise ValueError(f"model name {name!r} is not a {family} name; valid names: {', '.join(model_names(family))}")
    (default_depth, default_width, default_heads), patch = name_size(name)
    vca_options = VCAOptions(**vca) if isinstance(vca, dict) else vca or VCAOptions()
    config = dict(
        name=name,
        attention=attention,
        input_size=input_size,
        in_channels=in_channels,
        num_classes=num_classes,
        learn_sigma=MODEL_FAMILIES[family].learn_sigma if learn_sigma is None else learn_sigma,
        class_dropout_prob=class_dropout_prob,
        vca=asdict(vca_options) if attention == "vca" else None,
        gradient_checkpointing=gradient_checkpointing,
        depth=default_depth if depth is None else depth,
        hidden_size=default_width if hidden_size is None else hidden_size,
        num_heads=default_heads if num_heads is None else num_heads,
        mlp_ratio=mlp_ratio,
        norm=norm,
        mlp=mlp,
        qk_norm=qk_norm,
        rope=rope,
    )
    model = DiT(
        input_size=input_size,
        patch_size=patch,
        in_channels=in_channels,
        hidden_size=config["hidden_size"],
        depth=config["depth"],
        num_heads=config["num_heads"],
        mlp_ratio=mlp_ratio,
        class_dropout_prob=class_dropout_prob,
        num_classes=num_classes,
        learn_sigma=config["learn_sigma"],
        attention=attention,
        vca_options=vca_options,
        gradient_checkpointing=gradient_checkpointing,
        norm=norm,
        mlp=mlp,
        qk_norm=qk_norm,
        rope=rope,
    )
    model.config = config
    return model


def create_model(name: str, *args, **kwargs) -> DiT:
    """Build a "DiT-{S,B,L,XL}/{2,4,8}" model (learn_sigma defaults to True); arguments as `create_backbone`."""
    return create_backbone("DiT", name, *args, **kwargs)


def build_model_from_config(config: dict) -> DiT:
    """Rebuild a DiT or SiT model from its `model.config` dict (dispatch on the "DiT-"/"SiT-" name prefix)."""
    config = current_model_config(config)
    return create_backbone(model_family(config.get("name")), **config)


def current_model_config(config: dict) -> dict:
    """A model config in today's layout: configs written before VCAOptions became one section ("vca") held its
    fields at the top level (exports of the first format)."""
    config = dict(config)
    legacy = {key: config.pop(key) for key in LEGACY_VCA_KEYS if key in config}
    if legacy:
        config["vca"] = legacy if config.get("attention", "vca") == "vca" else None
    return config

"""The DiT backbone (Peebles & Xie, 2023), shared by DiT and SiT, with MHSA or Visual-Contrast Attention.

With attention="mhsa" the parameter layout is the official one (key for key, shape for shape), so official
DiT checkpoints load with `load_state_dict`, and official SiT checkpoints into a SiT built with learn_sigma=True
(they carry the unused variance half). The method and the conventions: docs/VCA.md. LightningDiT's block options
(RMSNorm, SwiGLU, QK-norm, 2-D RoPE; their presets: `dit_vca.model_options.BLOCK_PRESETS`) are off by default; with
them the layout is LightningDiT's, up to the names of the SwiGLU matrices (generation.lightning). Every setting of
the network is one `ModelSpec` (dit_vca.model_spec), the backbone's one argument.
"""

import math
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .attention import build_attention, resolve_contrast_grid
from .model_spec import ModelSpec, model_family, model_names

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
    `spec` is the `ModelSpec` it was built from with every setting decided (`ModelSpec.resolved`): what an export
    records, and what rebuilds it.
    """

    def __init__(self, spec: ModelSpec):
        super().__init__()
        spec = spec.resolved()  # ValueError names a setting that builds no network
        grid_size = spec.input_size // spec.patch_size
        if spec.attention == "vca":
            resolve_contrast_grid(grid_size, spec.vca.contrast_grid)  # fail before building anything
        self.spec = spec
        self.patch_size = spec.patch_size
        self.out_channels = 2 * spec.in_channels if spec.learn_sigma else spec.in_channels

        from timm.layers import PatchEmbed  # imported where used, as in DiTBlock

        self.x_embedder = PatchEmbed(spec.input_size, spec.patch_size, spec.in_channels, spec.hidden_size, bias=True)
        self.t_embedder = TimestepEmbedder(spec.hidden_size)
        self.y_embedder = LabelEmbedder(spec.num_classes, spec.hidden_size, spec.class_dropout_prob)
        # A frozen parameter, not a buffer, to keep the official state-dict key and parameter count.
        self.pos_embed = nn.Parameter(torch.zeros(1, grid_size**2, spec.hidden_size), requires_grad=False)
        width, heads = spec.hidden_size, spec.num_heads
        self.blocks = nn.ModuleList(
            DiTBlock(
                width,
                heads,
                spec.mlp_ratio,
                build_attention(spec.attention, width, heads, grid_size, index, spec.vca, spec.qk_norm, spec.rope),
                spec.norm,
                spec.mlp,
            )
            for index in range(spec.depth)
        )
        self.final_layer = FinalLayer(spec.hidden_size, spec.patch_size, self.out_channels, spec.norm)
        self.initialize_weights()

    @property
    def in_channels(self) -> int:
        """The channels of the input and of the prediction: what guidance combines (samplers.guidance)."""
        return self.spec.in_channels

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
            grid_size = self.spec.input_size // self.patch_size
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
        p, c, grid = self.patch_size, self.out_channels, self.spec.input_size // self.patch_size
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
            if self.spec.gradient_checkpointing and torch.is_grad_enabled():
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


def create_model(name: str, **settings: Any) -> DiT:
    """A DiT: `DiT(ModelSpec(name, **settings))` for a "DiT-{S,B,L,XL}/{1,2,4,8}" name (learn_sigma defaults to
    True), e.g. `create_model("DiT-S/2", attention="mhsa", blocks="lightning")`."""
    return create_backbone("DiT", ModelSpec(name, **settings))


def create_backbone(family: str, spec: ModelSpec) -> DiT:
    """The backbone of `spec`, whose name must be one of `family` ("DiT" or "SiT")."""
    if model_family(spec.name) != family:
        raise ValueError(
            f"model name {spec.name!r} is not a {family} name; valid names: {', '.join(model_names(family))}"
        )
    return DiT(spec)

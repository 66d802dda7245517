"""A slow, literal Visual-Contrast Attention written line by line from docs/VCA.md.

One batch element and one head at a time, in float64, in the notation and step numbers of docs/VCA.md, with
adaptive average pooling, hand-written softmax and RMSNorm, and the two Stage-II softmaxes written out; with the
block options QK-norm (an RMSNorm of q and k, eps 1e-6) and 2-D RoPE (channel pairs turned as complex numbers,
tokens at their grid positions, contrast tokens at their pooling cells' centres) as docs/VCA.md states them. It
reads only the module's parameters and its documented switches, never its forward code, so it is an independent
check of `VisualContrastAttention`.
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from dit_vca.attention import VisualContrastAttention


def softmax_rows(scores: Tensor) -> Tensor:
    exp = torch.exp(scores - scores.max(dim=-1, keepdim=True).values)
    return exp / exp.sum(dim=-1, keepdim=True)


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-5) -> Tensor:
    return x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def rope_rotate(x: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
    """x (P, d) turned by 2-D RoPE at positions (rows, cols) (P,): channel pair m of the first half, read as the
    complex number x_2m + i·x_2m+1, times e^(i·row·ω_m), pair m of the second half times e^(i·col·ω_m),
    ω_m = 10000^(−m/(d/4))."""
    P, d = x.shape
    omega = 10000.0 ** (-torch.arange(d // 4, dtype=torch.float64) / (d // 4))  # (d/4,)
    angles = torch.cat([rows[:, None] * omega, cols[:, None] * omega], dim=1)  # (P, d/2)
    pairs = torch.view_as_complex(x.reshape(P, d // 2, 2).contiguous())
    return torch.view_as_real(pairs * torch.exp(1j * angles)).reshape(P, d)


def reference_vca(module: VisualContrastAttention, x: Tensor, block_index: int) -> Tensor:
    """VCA of tokens x (B, N, C) on a square grid, with the parameters of `module`, in float64."""
    params = {name: value.detach().double() for name, value in module.named_parameters()}
    options = module.options
    x = x.double()
    B, N, C = x.shape
    h = module.num_heads
    d = C // h
    H = math.isqrt(N)
    p = H // 2 if options.contrast_grid is None else options.contrast_grid
    n = p * p
    lam_init = 0.8 - 0.6 * math.exp(-0.3 * block_index)
    stages_differ = options.stage1_differential or options.stage2_differential  # else there is no E⁻

    def lam(prefix: str) -> Tensor:
        q1, k1, q2, k2 = (params[f"{prefix}.{name}"] for name in ("q1", "k1", "q2", "k2"))
        return torch.exp(q1 @ k1) - torch.exp(q2 @ k2) + lam_init

    qk_norm, rope = module.q_norm is not None, module.rope is not None
    r = H // p  # pooling cells of r×r tokens
    token_rows, token_cols = (torch.arange(N) // H).double(), (torch.arange(N) % H).double()
    centre_rows = (torch.arange(n) // p).double() * r + (r - 1) / 2  # a cell's centre: its first row + (r − 1)/2
    centre_cols = (torch.arange(n) % p).double() * r + (r - 1) / 2

    w_qkv, b_qkv = params["qkv.weight"], params["qkv.bias"]
    q_all = x @ w_qkv[:C].T + b_qkv[:C]  # (B, N, C)
    k_all = x @ w_qkv[C : 2 * C].T + b_qkv[C : 2 * C]
    v_all = x @ w_qkv[2 * C :].T + b_qkv[2 * C :]

    out = torch.zeros(B, N, C, dtype=torch.float64)
    for b in range(B):
        for head in range(h):
            cols = slice(head * d, (head + 1) * d)
            q, k, v = q_all[b, :, cols], k_all[b, :, cols], v_all[b, :, cols]  # (N, d) each
            if qk_norm:  # QK-norm: q and k normalised before anything reads them
                q = rms_norm(q, params["q_norm.weight"], eps=1e-6)
                k = rms_norm(k, params["k_norm.weight"], eps=1e-6)

            # 1. contrast tokens: adaptive average pooling of q on the H×H grid to p×p
            pooled = F.adaptive_avg_pool2d(q.T.reshape(d, H, H), p).reshape(d, n).T  # (n, d)
            if rope:  # the pooled content at its cell's centre; then queries and keys at their tokens
                pooled = rope_rotate(pooled, centre_rows, centre_cols)
                q, k = rope_rotate(q, token_rows, token_cols), rope_rotate(k, token_rows, token_cols)
            content = pooled if options.pooled_content else torch.zeros_like(pooled)
            # 2. positive and negative streams (the module stores E⁺, E⁻ as contrast_embed[:, :, 0], [:, :, 1])
            t_pos = content + params["contrast_embed"][0, head, 0]
            t_neg = content + params["contrast_embed"][0, head, 1] if stages_differ else None

            # 4. Stage I
            r_pos = softmax_rows(t_pos @ k.T / math.sqrt(d)) @ v  # R⁺, (n, d)
            if options.stage1_differential:
                r_neg = softmax_rows(t_neg @ k.T / math.sqrt(d)) @ v
                v_hat = (1 - lam_init) * rms_norm(r_pos - lam("lambda1") * r_neg, params["norm1.weight"])
            else:
                v_hat = r_pos

            # 5. Stage II
            if options.stage2_differential:
                if options.joint_softmax:
                    p_all = softmax_rows(torch.cat([q @ t_pos.T, q @ t_neg.T], dim=1) / math.sqrt(d))  # P, (N, 2n)
                    w = p_all[:, :n] - lam("lambda2") * p_all[:, n:]  # W = P⁺ − λ₂P⁻
                else:
                    p_pos = softmax_rows(q @ t_pos.T / math.sqrt(d))  # P⁺, (N, n)
                    p_neg = softmax_rows(q @ t_neg.T / math.sqrt(d))
                    w = p_pos - lam("lambda2") * p_neg
                out[b, :, cols] = (1 - lam_init) * rms_norm(w @ v_hat, params["norm2.weight"])  # Y
            else:
                out[b, :, cols] = softmax_rows(q @ t_pos.T / math.sqrt(d)) @ v_hat

    # 6. depthwise 3×3 convolution of v on the grid, then the output projection
    v_image = v_all.transpose(1, 2).reshape(B, C, H, H)
    local = F.conv2d(v_image, params["value_conv.weight"], params["value_conv.bias"], padding=1, groups=C)
    out = out + local.reshape(B, C, N).transpose(1, 2)
    return out @ params["proj.weight"].T + params["proj.bias"]  # (B, N, C)


def reference_mhsa(
    qkv_weight: Tensor, qkv_bias: Tensor, proj_weight: Tensor, proj_bias: Tensor, x: Tensor, num_heads: int
) -> Tensor:
    """softmax(QKᵀ/√d)V per head, concatenated and projected, in float64."""
    x = x.double()
    C = x.shape[-1]
    d = C // num_heads
    q, k, v = (
        x @ qkv_weight.double()[i * C : (i + 1) * C].T + qkv_bias.double()[i * C : (i + 1) * C] for i in range(3)
    )
    heads = [
        softmax_rows(q[..., s] @ k[..., s].transpose(1, 2) / math.sqrt(d)) @ v[..., s]
        for s in (slice(i * d, (i + 1) * d) for i in range(num_heads))
    ]
    return torch.cat(heads, dim=-1) @ proj_weight.double().T + proj_bias.double()

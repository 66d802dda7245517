"""The fused layer of Visual-Contrast Attention: from the input tokens to the output projection, one autograd node
with a hand-written backward.

The core maps the input tokens x of a VCA layer to its output: the qkv projection, λ₁ and λ₂ from their vectors,
both attention stages, the depthwise convolution of v and the output projection. Why one node of its own, and not
autograd over torch operations (VisualContrastAttention.reference_forward, the specification):
- Memory. Through autograd the readable forward stores every intermediate (the N×2n probabilities among them)
  and pays for layout copies in backward; the backward written here recomputes the probabilities and saves only
  x, the q, k, v the stages read, the value image of the convolution and the output projection's input (what
  MHSA on SDPA keeps, and one (B, N, C) tensor), or x and the projection's input alone with `recompute_qkv`; the
  Triton path adds what FlashAttention saves (its `saved_like`). Under `no_grad` nothing is kept.
- Host time. A small layer's time on a GPU is the time the host takes to launch it: the node costs one Python
  call, the parameters are cast to the compute dtype together (one launch) and kept for the backward, λ comes
  from its four vectors per stage in a few launches (tests/test_vca_triton.py counts them all).
- Two doors to one computation. Eager code calls a plain torch.autograd.Function (`_CoreFunction`): a custom
  operator costs ten times the host time per call through torch.library's Python dispatch. torch.compile, fake
  tensors, FlopCounterMode and any other dispatch mode see the custom operators dit_vca::vca_core and
  dit_vca::vca_core_backward instead: opaque to Dynamo, their fake kernels give the shapes, so
  `torch.compile(model, fullgraph=True)` keeps this core, its memory and its kernels, and compiles the code around
  it; there λ and the output projection are computed around the operator (`_traced_layer`), where Inductor fuses
  λ's element-wise operations and the projection's bias into the code beside them. Both doors run `_core_forward`
  and `_core_backward`.
- Fused attention kernels. Every SDPA call here and in the readable path takes 4-D (B, h, L, d) tensors of one
  dtype whose last dimension has stride 1: what PyTorch's dispatcher requires of the flash and
  memory-efficient kernels (see SDPA_FUSED_CONSTRAINTS).
- Two implementations of the attention stages, chosen by the layout's `triton` (VisualContrastAttention.kernel),
  each a module with the entry points `add_attention`, `attention_backward` and `saved_like`: dit_vca.vca_aten
  (ATen operations, the CPU default and the reference) and dit_vca.vca_triton (fused Triton kernels, the CUDA
  default). The projections, the convolution, λ and their gradients are here, shared.
- QK-norm and 2-D RoPE (the model options `qk_norm`, `rope`) apply inside the core, as a pre-step on q and k that
  both implementations share and whose backward is chained by hand (dit_vca.vca_qk).
- Mixed precision. The core computes in the dtype it is given (the autocast dtype, else x's): x and the
  parameters are cast to it once, in the forward; λ, QK-norm and RoPE compute in float32; parameter gradients
  that sum over B·h·N rows (λ, RMSNorm weights, E±, the biases) are summed in float32, so that a loss scaled for
  fp16 cannot overflow them; every gradient comes back in its input's dtype.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from types import ModuleType
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from dit_vca import vca_aten, vca_qk
from dit_vca.kernel_layout import KernelLayout
from dit_vca.vca_aten import sum_to_fp32
from dit_vca.vca_qk import RopeTables

# What PyTorch 2.14's SDPA dispatcher (aten/src/ATen/native/transformers/sdp_utils_cpp.h and
# cuda/sdp_utils.cpp) checks before it picks the flash or memory-efficient kernel for dense inputs; an input
# that fails any check falls back to the math kernel (the scores materialised, bf16 upcast):
SDPA_FUSED_CONSTRAINTS = (
    "query, key and value are 4-dimensional (check_tensor_shapes)",
    "same batch size and number of heads in dims 0 and 1 (check_batch_size_and_num_heads_dense)",
    "the last dimension of query, key and value has stride 1 (check_last_dim_stride_equals_1_dense)",
    "query, key and value share one dtype, fp16 or bf16 for flash (check_tensor_dtype)",
    "query, key and value share the head dimension, at most 256 for flash (check_head_dim_size_flash)",
    "no attention mask for flash, no dropout here, non-empty sequences (check_for_attn_mask, "
    "check_nonzero_sequence_lengths_dense)",
)

# Stage II as SDPA calls (softmax(q·Tᵀ/√d) against the values [V̂; −λ₂·V̂], or one call per softmax) or as the
# GEMM–softmax–GEMM of the backward's recomputation, per device type. The CPU keeps the GEMM form: measured
# faster there (`python -m bench.attention`, rows "vca-64" and "vca-64-sdpa2", see docs/benchmarks.md); on CUDA the
# SDPA form runs Stage II in the flash kernel (a GPU run has yet to confirm it is faster).
STAGE2_SDPA = {"cpu": False, "cuda": True}


def stage2_uses_sdpa(device_type: str) -> bool:
    return STAGE2_SDPA.get(device_type, False)


class CoreTensors(NamedTuple):
    """The layer's tensors as the core takes them, one argument each (autograd tracks only tensors passed as
    arguments); None where the layer has no such tensor. The λ vectors are those of DifferentialWeight: λ =
    exp(⟨q1, k1⟩) − exp(⟨q2, k2⟩) + λ_init per stage."""

    qkv_weight: Tensor
    qkv_bias: Tensor
    embed: Tensor  # E± (1, h, S, n, d)
    lambda1_q1: Tensor | None
    lambda1_k1: Tensor | None
    lambda1_q2: Tensor | None
    lambda1_k2: Tensor | None
    lambda2_q1: Tensor | None
    lambda2_k1: Tensor | None
    lambda2_q2: Tensor | None
    lambda2_k2: Tensor | None
    norm1: Tensor | None
    norm2: Tensor | None
    conv_weight: Tensor
    conv_bias: Tensor
    proj_weight: Tensor
    proj_bias: Tensor
    q_norm: Tensor | None  # QK-norm's gains (d,)
    k_norm: Tensor | None
    rope_cos: Tensor | None  # RoPE's tables (vca_qk.RopeTables): constants, no gradient
    rope_sin: Tensor | None
    contrast_cos: Tensor | None
    contrast_sin: Tensor | None
    # λ₁, λ₂ themselves (0-d), given instead of their vectors: torch.compile's door computes them around the operator
    lambda1: Tensor | None = None
    lambda2: Tensor | None = None

    def rope(self) -> RopeTables | None:
        return None if self.rope_cos is None else (self.rope_cos, self.rope_sin, self.contrast_cos, self.contrast_sin)

    def lambda_vectors(self) -> list[Tensor]:
        """The vectors of the differential stages, four per stage (q1, k1, q2, k2), stage 1 first."""
        return [t for t in self[LAMBDA_VECTORS] if t is not None]

    @property
    def projects(self) -> bool:
        """Whether the core ends with the output projection (torch.compile's door projects around the operator)."""
        return self.proj_weight is not None


# The positions of the λ vectors among the core's tensors, and the names of the RoPE tables (constants: no gradient).
LAMBDA_VECTORS = slice(3, 11)
ROPE_TABLES = ("rope_cos", "rope_sin", "contrast_cos", "contrast_sin")
PROJ_WEIGHT = CoreTensors._fields.index("proj_weight")


# The parameters the core computes with in its compute dtype, cast in the forward and kept for the backward (the
# others, λ's vectors, QK-norm's gains and RoPE's tables, compute in float32).
CAST = ("qkv_weight", "qkv_bias", "embed", "norm1", "norm2", "conv_weight", "conv_bias", "proj_weight", "proj_bias")


def vca_core(x: Tensor, tensors: CoreTensors, layout: KernelLayout, dtype: torch.dtype | None = None) -> Tensor:
    """The VCA layer on tokens x (B, N, C), computed in `dtype` (default x's): its output (B, N, C) in that dtype.
    Differentiable with respect to x and every tensor of `tensors` but the RoPE tables."""
    dtype = x.dtype if dtype is None else dtype
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        # torch.compile, fake tensors, FlopCounterMode and any other dispatch mode.
        return _traced_layer(x, tensors, layout, dtype)
    if torch.is_grad_enabled() and (x.requires_grad or any(t is not None and t.requires_grad for t in tensors)):
        return _CoreFunction.apply(x, layout, dtype, *tensors)
    return _core_forward(x, tensors, layout, dtype, keep=False)[0]  # inference: no node, nothing kept


def _traced_layer(x: Tensor, tensors: CoreTensors, layout: KernelLayout, dtype: torch.dtype) -> Tensor:
    """torch.compile's door: λ from its vectors and the output projection as traced operations around the opaque
    operator (Inductor fuses λ's few element-wise operations into one kernel, and the projection's bias into the
    code after it), the operator the rest of the core, given λ. The same functions compute them as the eager node's
    (`_lambdas`, the projection's addmm): the same numbers forward."""
    lambda1 = lambda2 = None
    if _differential(layout):
        lambda1, lambda2 = _stage_lambdas(_lambdas(tensors.lambda_vectors(), layout.lambda_init), layout)
    given = {name: None for name in CoreTensors._fields[LAMBDA_VECTORS]}
    core = tensors._replace(**given, proj_weight=None, proj_bias=None, lambda1=lambda1, lambda2=lambda2)
    present = [t is not None for t in core]
    out = _core_op(x, [t for t in core if t is not None], present, dtype, *layout.as_args())[0]  # (B, N, C)
    B, N, C = out.shape
    with _autocast_off(x.device.type):
        weight, bias = tensors.proj_weight.to(dtype), tensors.proj_bias.to(dtype)  # through autograd: traced casts
        return torch.addmm(bias, out.view(B * N, C), weight.T).view(B, N, C)  # (B, N, C)


# ----------------------------------------------------------------------------------------------------------------
# The forward and what it keeps
# ----------------------------------------------------------------------------------------------------------------


class _Kept(NamedTuple):
    """What the backward reads besides the core's inputs, all in the compute dtype but λ's (float32): x and the
    parameters as computed with (the inputs themselves where no cast was needed), the q, k, v the stages read
    and the value image (None under recompute_qkv), the output projection's input (None where the core does not
    project), λ with the terms' exponentials and stacked vectors (None without a differential stage, or where λ
    was given), and what the attention stages saved."""

    x: Tensor
    weights: dict[str, Tensor | None]  # CAST's names
    heads: Tensor | None
    value_image: Tensor | None
    result: Tensor | None
    lambdas: tuple[Tensor, Tensor, Tensor] | None
    saved: list[Tensor]

    def new_tensors(self, x: Tensor, tensors: CoreTensors) -> list[Tensor]:
        """The tensors made by the forward, in a fixed order (`unpack` reads them back): the inputs are not among
        them (an operator's outputs never alias its inputs, and the backward has them anyway)."""
        casts = [self.x] if self.x is not x else []
        casts += [cast for name, cast in self.weights.items() if cast is not getattr(tensors, name)]
        made = [t for t in (self.heads, self.value_image, self.result) if t is not None]
        return [*casts, *made, *(self.lambdas or ()), *self.saved]

    @staticmethod
    def unpack(
        made: Sequence[Tensor], x: Tensor | None, tensors: CoreTensors, layout: KernelLayout, dtype: torch.dtype
    ) -> _Kept:
        """The inverse of `new_tensors`, from the inputs (x None: it was cast, its copy is in `made`)."""
        made = iter(made)
        x = next(made) if x is None else x
        weights = {}
        for name in CAST:
            t = getattr(tensors, name)
            weights[name] = next(made) if t is not None and t.dtype != dtype else t
        heads, value_image = (None, None) if layout.recompute_qkv else (next(made), next(made))
        result = next(made) if tensors.projects else None
        lambdas = (next(made), next(made), next(made)) if tensors.lambda_vectors() else None
        return _Kept(x, weights, heads, value_image, result, lambdas, list(made))


def _differential(layout: KernelLayout) -> bool:
    return layout.stage1_differential or layout.stage2_differential


def _core_forward(
    x: Tensor, tensors: CoreTensors, layout: KernelLayout, dtype: torch.dtype, keep: bool = True
) -> tuple[Tensor, _Kept | None]:
    """(the layer's output (B, N, C) in `dtype`, what the backward reads or None when `keep` is off). λ from its
    vectors, or given (`tensors.lambda1`, `lambda2`); the output projection where `tensors` has it, else the
    output is its input."""
    B, N, C = x.shape
    with _autocast_off(x.device.type):
        x_in, *cast = _in_dtype(dtype, x, *(getattr(tensors, name) for name in CAST))
        weights = dict(zip(CAST, cast))
        vectors = tensors.lambda_vectors()
        lambdas = _lambdas(vectors, layout.lambda_init) if vectors else None
        lambda1, lambda2 = _stage_lambdas(lambdas, layout) if vectors else (tensors.lambda1, tensors.lambda2)
        qkv = torch.addmm(weights["qkv_bias"], x_in.reshape(B * N, C), weights["qkv_weight"].T)  # (B·N, 3C)
        heads = _heads(qkv, B, N, layout)  # (3, B, h, N, d)
        value_image = _value_image(qkv, B, N, layout.grid_size)  # (B, C, H, W), channels-last
        local = F.conv2d(value_image, weights["conv_weight"], weights["conv_bias"], padding=1, groups=C)
        result = local.permute(0, 2, 3, 1).reshape(B, N, C).contiguous()  # (B, N, C); a view when channels-last
        attended, pooled = _prepared(heads, tensors, layout)  # q̃, k̃, v; T at the cells' centres
        saved = _attention(layout).add_attention(
            result, attended, pooled, weights["embed"], lambda1, lambda2, weights["norm1"], weights["norm2"], layout
        )
        out = result
        if tensors.projects:
            out = torch.addmm(weights["proj_bias"], result.view(B * N, C), weights["proj_weight"].T).view(B, N, C)
    if not keep:
        return out, None
    kept_heads, kept_image = (None, None) if layout.recompute_qkv else (heads, value_image)
    kept_result = result if tensors.projects else None
    return out, _Kept(x_in, weights, kept_heads, kept_image, kept_result, lambdas, saved)


def _in_dtype(dtype: torch.dtype, *tensors: Tensor | None) -> list[Tensor | None]:
    """The tensors in `dtype`: those already in it as they are, the others cast together, in one launch on CUDA
    (torch._foreach_copy_ into tensors laid out as theirs)."""
    sources = [t for t in tensors if t is not None and t.dtype != dtype]
    if not sources:
        return list(tensors)
    copies = [torch.empty_like(t, dtype=dtype) for t in sources]
    torch._foreach_copy_(copies, sources)
    copied = iter(copies)
    return [next(copied) if t is not None and t.dtype != dtype else t for t in tensors]


def _lambdas(vectors: list[Tensor], init: float) -> tuple[Tensor, Tensor, Tensor]:
    """λ of each differential stage, exp(⟨q1, k1⟩) − exp(⟨q2, k2⟩) + λ_init, from its vectors (four per stage), in
    float32: (λ (S,), the terms' exponentials (S, 2) and the vectors stacked as (S, term, 3, d), q, k, q again,
    both for the backward: the repeated q makes (k, q), the swapped pair the gradient multiplies, a view).
    Element-wise products and sums, not a GEMM: TF32 would round the dot products."""
    pairs = [vectors[i : i + 2] for i in range(0, len(vectors), 2)]  # (q, k) of each term
    stacked = torch.stack([v for q, k in pairs for v in (q, k, q)]).view(-1, 2, 3, vectors[0].shape[-1])
    stacked = stacked.to(torch.promote_types(stacked.dtype, torch.float32))  # (S, 2, 3, d)
    exps = (stacked[:, :, 0] * stacked[:, :, 1]).sum(-1).exp_()  # (S, 2)
    return torch.sub(exps[:, 0], exps[:, 1]).add_(init), exps, stacked


def _stage_lambdas(lambdas: tuple, layout: KernelLayout) -> tuple[Tensor | None, Tensor | None]:
    """λ₁ and λ₂ of `_lambdas`' result as 0-d float32 tensors (None where the stage is not differential)."""
    values = iter(lambdas[0])
    lambda1 = next(values) if layout.stage1_differential else None
    lambda2 = next(values) if layout.stage2_differential else None
    return lambda1, lambda2


def _lambdas_backward(grads: list[Tensor], exps: Tensor, stacked: Tensor) -> Tensor:
    """The gradients of the λ vectors, (S, term, q|k, d), from dλ of each stage (0-d float32 tensors):
    d⟨q, k⟩/dq = k and d⟨q, k⟩/dk = q, each times ±dλ·exp(⟨q, k⟩)."""
    grad = torch.stack(grads) if len(grads) > 1 else grads[0].view(1)  # (S,)
    scale = exps * grad[:, None]  # (S, 2)
    scale[:, 1].neg_()  # the second term is subtracted
    return stacked[:, :, 1:] * scale[..., None, None]  # (k, q) · scale: (dq, dk)


def _heads(qkv: Tensor, B: int, N: int, layout: KernelLayout) -> Tensor:
    """q, k, v of the qkv GEMM's output (B·N, 3C) as (3, B, h, N, d), what the attention stages read."""
    h = layout.num_heads
    heads = qkv.view(B, N, 3, h, qkv.shape[1] // (3 * h)).permute(2, 0, 3, 1, 4)  # (3, B, h, N, d), a view
    if layout.triton:  # the kernels read q, k, v through its strides: no head-major copy
        return heads
    return heads.contiguous()  # the ATen path computes on head-major (G, N, d) matrices: batched GEMMs and SDPA


def _value_image(qkv: Tensor, B: int, N: int, grid_size: int) -> Tensor:
    """v of the qkv GEMM's output (B·N, 3C) as one channels-last image (B, C, H, W) of all heads, copied once: the
    depthwise convolution's input in the forward and, kept, in the backward."""
    C = qkv.shape[1] // 3
    image = qkv.new_empty(B, N, C)  # (B, N, C): a channels-last image's memory
    image.copy_(qkv.view(B, N, 3 * C)[:, :, 2 * C :])
    return image.view(B, grid_size, grid_size, C).permute(0, 3, 1, 2)  # (B, C, H, W), channels-last


def _prepared(heads: Tensor, tensors: CoreTensors, layout: KernelLayout) -> tuple[Tensor, Tensor | None]:
    """What the attention stages read: q, k, v `heads` as they are, or after the pre-step (dit_vca.vca_qk)."""
    rope = tensors.rope()
    if tensors.q_norm is None and rope is None:
        return heads, None
    return vca_qk.prepare(heads, tensors.q_norm, tensors.k_norm, rope, layout)


def _attention(layout: KernelLayout) -> ModuleType:
    """The module that implements the attention stages: dit_vca.vca_triton or dit_vca.vca_aten."""
    if layout.triton:
        from dit_vca import vca_triton  # imported on first use: importing triton costs a second

        return vca_triton
    return vca_aten


@torch.compiler.assume_constant_result
def autocast_exists(device_type: str) -> bool:
    """Whether autocast exists on `device_type` (it does not on the meta device, for one). A constant to
    torch.compile, since it never changes in a process: Dynamo in torch 2.11 cannot trace
    torch.amp.is_autocast_available, and `train.compile=true` (fullgraph) stopped there on an H200."""
    return torch.amp.is_autocast_available(device_type)


def _autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """A context with autocast disabled on `device_type`, where it is enabled (nothing to do elsewhere)."""
    if autocast_exists(device_type) and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


# ----------------------------------------------------------------------------------------------------------------
# The backward
# ----------------------------------------------------------------------------------------------------------------


def _core_backward(
    grad: Tensor, x_dtype: torch.dtype, tensors: CoreTensors, kept: _Kept, layout: KernelLayout
) -> list[Tensor | None]:
    """The gradients of x (in `x_dtype`) and of every tensor of `tensors` (None for an absent one and for the
    RoPE tables), each in its input's dtype and layout: computed in the compute dtype, parameter sums in
    float32; the projections and the convolution here, the attention stages in dit_vca.vca_aten or on the
    Triton kernels (dit_vca.vca_triton), QK-norm and RoPE in dit_vca.vca_qk."""
    x, weights = kept.x, kept.weights
    B, N, C = x.shape
    with _autocast_off(x.device.type):
        grad = grad.to(x.dtype).reshape(B * N, C)  # (B·N, C)
        grad_proj_weight = grad_proj_bias = None
        grad_result = grad  # (B·N, C): the gradient of the conv + attention output
        if tensors.projects:
            grad_proj_weight = grad.T @ kept.result.view(B * N, C)  # (C, C)
            grad_proj_bias = sum_to_fp32(grad, 0)
            grad_result = grad @ weights["proj_weight"]
        heads, value_image = kept.heads, kept.value_image
        if heads is None:  # recompute_qkv
            qkv = torch.addmm(weights["qkv_bias"], x.view(B * N, C), weights["qkv_weight"].T)  # (B·N, 3C)
            heads, value_image = _heads(qkv, B, N, layout), _value_image(qkv, B, N, layout.grid_size)

        # Depthwise convolution of v (its bias gradient, a sum over B·N rows, in float32).
        H = layout.grid_size
        grad_image = grad_result.view(B, H, H, C).permute(0, 3, 1, 2)  # (B, C, H, W), channels-last view
        grad_local, grad_conv_weight, _ = torch.ops.aten.convolution_backward(
            grad_image, value_image, weights["conv_weight"], None, [1, 1], [1, 1], [1, 1], False, [0, 0], C,
            [True, True, False],
        )  # fmt: skip
        grad_conv_bias = sum_to_fp32(grad_result, 0)  # (C,)

        lambda1, lambda2 = (tensors.lambda1, tensors.lambda2)  # given, or None without a differential stage
        if kept.lambdas is not None:
            lambda1, lambda2 = _stage_lambdas(kept.lambdas, layout)
        attended, pooled = _prepared(heads, tensors, layout)  # what the stages read in forward
        grad_qkv, grad_embed, grad_lambda1, grad_lambda2, grad_norm1, grad_norm2, grad_pooled = _attention(
            layout
        ).attention_backward(
            grad_result.view(B, N, C), attended, pooled, kept.saved, weights["embed"], lambda1, lambda2,
            weights["norm1"], weights["norm2"], grad_local, layout,
        )  # fmt: skip
        grad_gains = (None, None)  # of QK-norm: g_q, g_k
        if attended is not heads:  # dq̃, dk̃ back to dq, dk
            grad_gains = vca_qk.prepare_backward(
                grad_qkv, heads, grad_pooled, tensors.q_norm, tensors.k_norm, tensors.rope(), layout
            )

        # The qkv projection (the weight's gradient a GEMM in the compute dtype, as nn.Linear's under autocast).
        grad_x = (grad_qkv @ weights["qkv_weight"]).view(B, N, C)
        grad_qkv_weight = grad_qkv.T @ x.view(B * N, C)  # (3C, C)
        grad_qkv_bias = sum_to_fp32(grad_qkv, 0)

        grad_vectors, grad_lambdas = [None] * 8, (grad_lambda1, grad_lambda2)  # of λ's vectors, or of λ given
        if kept.lambdas is not None:
            grad_lambdas = (None, None)
            _, exps, stacked = kept.lambdas
            present = [g for g in (grad_lambda1, grad_lambda2) if g is not None]
            computed = iter(_lambdas_backward(present, exps, stacked).view(-1, stacked.shape[-1]).unbind(0))  # (4S, d)
            vectors = tensors[LAMBDA_VECTORS]
            grad_vectors = [None if t is None else next(computed) for t in vectors]

    grads = [
        grad_x, grad_qkv_weight, grad_qkv_bias, grad_embed, *grad_vectors, grad_norm1, grad_norm2, grad_conv_weight,
        grad_conv_bias, grad_proj_weight, grad_proj_bias, *grad_gains, None, None, None, None, *grad_lambdas,
    ]  # fmt: skip
    return _like_inputs(grads, x_dtype, tensors)


def _like_inputs(grads: list[Tensor | None], x_dtype: torch.dtype, tensors: CoreTensors) -> list[Tensor | None]:
    """Each gradient in its input's dtype (x's: x_dtype) and the convolution's weight gradient in its weight's
    strides, those that differ fixed together, in one launch on CUDA (torch._foreach_copy_). The weight gradient
    comes out channels-last ((9, 1, 3, 1) for a (C, 1, 3, 3) weight whose strides are (9, 9, 3, 1)): DDP would warn
    that the gradient's strides do not match its bucket view and copy it at every step, and a compiled graph would
    be told strides the kernel does not produce; where only a dimension of size one differs (that one) it is the
    same memory, a view with the weight's strides. Every other gradient comes out of a GEMM, a sum or a kernel
    contiguous, as its parameter is."""
    targets = [x_dtype, *(None if t is None else t.dtype for t in tensors)]
    fixes = [
        index for index, (grad, dtype) in enumerate(zip(grads, targets)) if grad is not None and grad.dtype != dtype
    ]
    conv = 1 + CoreTensors._fields.index("conv_weight")
    weight, grad = tensors.conv_weight, grads[conv]
    if grad.stride() != weight.stride() and conv not in fixes:
        if _same_memory(grad, weight.stride()):
            grads[conv] = grad.as_strided(weight.shape, weight.stride())
        else:
            fixes.append(conv)
    if fixes:
        shapes = [(grads[i].shape, grads[i].stride()) if i != conv else (weight.shape, weight.stride()) for i in fixes]
        copies = [
            grads[0].new_empty_strided(shape, stride, dtype=targets[i]) for i, (shape, stride) in zip(fixes, shapes)
        ]
        torch._foreach_copy_(copies, [grads[i] for i in fixes])
        for index, copy in zip(fixes, copies):
            grads[index] = copy
    return grads


def _same_memory(t: Tensor, stride: tuple[int, ...]) -> bool:
    """Whether `t` with `stride` instead of its own strides addresses the same elements: they differ only along
    dimensions of size one."""
    return all(a == b or size == 1 for a, b, size in zip(t.stride(), stride, t.shape))


class _CoreFunction(torch.autograd.Function):
    """The eager door: `_core_forward` and `_core_backward` as one autograd node (see the module docstring)."""

    @staticmethod
    def forward(ctx, x: Tensor, layout: KernelLayout, dtype: torch.dtype, *tensors: Tensor | None) -> Tensor:
        inputs = CoreTensors(*tensors)
        out, kept = _core_forward(x, inputs, layout, dtype)
        ctx.layout, ctx.dtype, ctx.x_dtype, ctx.count = layout, dtype, x.dtype, len(tensors)
        x_kept = x if kept.x is x else None  # a cast x is among the new tensors; the input itself is not kept
        ctx.x_kept = x_kept is not None
        ctx.save_for_backward(x_kept, *tensors, *kept.new_tensors(x, inputs))
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, *rest = ctx.saved_tensors
        tensors = CoreTensors(*rest[: ctx.count])
        kept = _Kept.unpack(rest[ctx.count :], x if ctx.x_kept else None, tensors, ctx.layout, ctx.dtype)
        grad_x, *grads = _core_backward(grad, ctx.x_dtype, tensors, kept, ctx.layout)
        return grad_x, None, None, *grads


# ----------------------------------------------------------------------------------------------------------------
# The operators (torch.compile's door)
# ----------------------------------------------------------------------------------------------------------------


def _core_tensors(tensors: Sequence[Tensor], present: Sequence[bool]) -> CoreTensors:
    """CoreTensors from the operators' arguments: the tensors there are, and which fields they fill (an optional
    tensor inside a list argument would hide the list's tensors from autograd)."""
    given = iter(tensors)
    return CoreTensors(*(next(given) if here else None for here in present))


@torch.library.custom_op("dit_vca::vca_core", mutates_args=())
def _core_op(
    x: Tensor,
    tensors: list[Tensor],
    present: list[bool],
    dtype: torch.dtype,
    num_heads: int,
    grid_size: int,
    contrast_grid: int,
    joint_softmax: bool,
    stage1_differential: bool,
    stage2_differential: bool,
    pooled_content: bool,
    lambda_init: float,
    eps: float,
    recompute_qkv: bool,
    stage2_sdpa: bool,
    triton: bool,
    qk_norm_eps: float | None,
) -> tuple[Tensor, list[Tensor]]:
    """(the layer's output (B, N, C) in `dtype`, the tensors the forward made for the backward (_Kept.new_tensors),
    returned so that the backward keeps them instead of recomputing them)."""
    layout = KernelLayout(num_heads, grid_size, contrast_grid, joint_softmax, stage1_differential,
                          stage2_differential, pooled_content, lambda_init, eps, recompute_qkv, stage2_sdpa, triton,
                          qk_norm_eps)  # fmt: skip
    inputs = _core_tensors(tensors, present)
    out, kept = _core_forward(x, inputs, layout, dtype)
    return out, kept.new_tensors(x, inputs)


@_core_op.register_fake
def _core_op_fake(x, tensors, present, dtype, *layout_args):
    """The shapes of `_core_forward`'s output and kept tensors, from the same helpers on empty tensors."""
    layout = KernelLayout(*layout_args)
    inputs = _core_tensors(tensors, present)
    B, N, C = x.shape
    x_in, *cast = (None if t is None else (t if t.dtype == dtype else torch.empty_like(t, dtype=dtype))
                   for t in (x, *(getattr(inputs, name) for name in CAST)))  # fmt: skip
    qkv = x.new_empty(B * N, 3 * C, dtype=dtype)
    heads = _heads(qkv, B, N, layout)
    value_image = _value_image(qkv, B, N, layout.grid_size)
    result = x.new_empty(B, N, C, dtype=dtype) if inputs.projects else None
    lambdas = None
    vectors = inputs.lambda_vectors()
    if vectors:
        stages, d = len(vectors) // 4, vectors[0].shape[-1]
        wide = torch.promote_types(vectors[0].dtype, torch.float32)
        lambdas = (x.new_empty(stages, dtype=wide), x.new_empty(stages, 2, dtype=wide),
                   x.new_empty(stages, 2, 3, d, dtype=wide))  # fmt: skip
    if layout.recompute_qkv:
        heads = value_image = None
    saved = _attention(layout).saved_like(_heads(qkv, B, N, layout), layout)
    kept = _Kept(x_in, dict(zip(CAST, cast)), heads, value_image, result, lambdas, saved)
    return x.new_empty(B, N, C, dtype=dtype), kept.new_tensors(x, inputs)


@torch.library.custom_op("dit_vca::vca_core_backward", mutates_args=())
def _core_backward_op(
    grad: Tensor,
    x: Tensor | None,
    tensors: list[Tensor],
    present: list[bool],
    made: list[Tensor],
    x_dtype: torch.dtype,
    dtype: torch.dtype,
    num_heads: int,
    grid_size: int,
    contrast_grid: int,
    joint_softmax: bool,
    stage1_differential: bool,
    stage2_differential: bool,
    pooled_content: bool,
    lambda_init: float,
    eps: float,
    recompute_qkv: bool,
    stage2_sdpa: bool,
    triton: bool,
    qk_norm_eps: float | None,
) -> list[Tensor]:
    """The gradients of x and of every tensor of `tensors` (an empty tensor where there is none), each in its
    input's dtype, the λ vectors' stacked as one (V, d) tensor (an operator's outputs never alias, and the
    backward computes them as views of one): `_backward` hands them out. `x` is the input when the forward
    computed with it (else None: its cast copy is in `made`)."""
    layout = KernelLayout(num_heads, grid_size, contrast_grid, joint_softmax, stage1_differential,
                          stage2_differential, pooled_content, lambda_init, eps, recompute_qkv, stage2_sdpa, triton,
                          qk_norm_eps)  # fmt: skip
    inputs = _core_tensors(tensors, present)
    kept = _Kept.unpack(made, x, inputs, layout, dtype)
    grad_x, *grads = _core_backward(grad, x_dtype, inputs, kept, layout)
    vectors = [g for g in grads[LAMBDA_VECTORS] if g is not None]
    stacked = torch.stack(vectors) if vectors else grad.new_empty(0)
    rest = [*grads[: LAMBDA_VECTORS.start], stacked, *grads[LAMBDA_VECTORS.stop :]]
    return [grad_x, *(grad.new_empty(0) if g is None else g for g in rest)]


@_core_backward_op.register_fake
def _core_backward_op_fake(grad, x, tensors, present, made, x_dtype, dtype, *layout_args):
    inputs = _core_tensors(tensors, present)
    grads = [None if t is None or name in ROPE_TABLES else torch.empty_like(t) for name, t in inputs._asdict().items()]
    vectors = [t for t in inputs[LAMBDA_VECTORS] if t is not None]
    stacked = grad.new_empty(len(vectors), vectors[0].shape[-1], dtype=vectors[0].dtype) if vectors else None
    rest = [*grads[: LAMBDA_VECTORS.start], stacked, *grads[LAMBDA_VECTORS.stop :]]
    return [grad.new_empty(grad.shape, dtype=x_dtype), *(grad.new_empty(0) if g is None else g for g in rest)]


def _setup_context(ctx, inputs: tuple, output: tuple) -> None:
    x, tensors, present, dtype, *layout = inputs
    _, made = output
    ctx.layout, ctx.dtype, ctx.x_dtype, ctx.present = layout, dtype, x.dtype, present
    ctx.mark_non_differentiable(*made)
    ctx.set_materialize_grads(False)  # no zero-filled gradients for them: only the output has one
    ctx.x_kept = x.dtype == dtype  # else its cast copy is the first of `made`
    ctx.save_for_backward(x if ctx.x_kept else None, *tensors, *made)


def _backward(ctx, grad: Tensor, _grad_made: list[Tensor] | None):
    x, *rest = ctx.saved_tensors
    count = sum(ctx.present)
    tensors, made = rest[:count], rest[count:]
    inputs = _core_tensors(tensors, ctx.present)
    grad_x, *grads = _core_backward_op(grad, x, tensors, ctx.present, made, ctx.x_dtype, ctx.dtype, *ctx.layout)
    start = LAMBDA_VECTORS.start
    vectors = iter(grads[start].unbind(0))
    grads = [*grads[:start], *(None if t is None else next(vectors) for t in inputs[LAMBDA_VECTORS]),
             *grads[start + 1 :]]  # fmt: skip
    fields = inputs._asdict().items()
    grads = [None if name in ROPE_TABLES else g for (name, t), g in zip(fields, grads) if t is not None]
    return (grad_x, grads, None, None, *(None for _ in ctx.layout))


_core_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------------------------
# FLOPs, for torch.utils.flop_counter (which does not look inside a custom operator)
# ----------------------------------------------------------------------------------------------------------------


def _attention_macs(x_shape, layout: KernelLayout, projects: bool) -> dict[str, int]:
    """Multiply-adds of the core's products per part, from the shape (B, N, C) of its input: the qkv GEMM, the
    GEMM-like products of the two stages over all B·h heads (Stage II as the SDPA calls or the GEMMs of
    `layout.stage2_sdpa`), the 3×3 depthwise convolution and, where the core `projects`, the output GEMM.
    Element-wise work (λ among it) is not counted, as FlopCounterMode counts none."""
    B, N, C = x_shape
    n, m1, m2 = layout.contrast_grid**2, layout.stage1_rows, layout.stage2_cols
    if layout.triton:  # scores, then one value product for a joint softmax, one per stream for two
        stage2 = (m2 + (m2 if layout.stage2_differential and not layout.joint_softmax else n)) * N * C * B
    else:  # scores and values of every query: SDPA calls or GEMMs
        stage2 = (2 * m2 if layout.stage2_sdpa else m2 + n) * N * C * B
    return {
        "qkv": 3 * B * N * C * C,
        "stage1": 2 * m1 * N * C * B,
        "stage2": stage2,
        "conv": 9 * B * N * C,
        "proj": B * N * C * C if projects else 0,
    }


@register_flop_formula(torch.ops.dit_vca.vca_core)
def _core_flops(x_shape, tensors_shape, present, dtype, *layout_args, out_shape=None, **kwargs) -> int:
    return 2 * sum(_attention_macs(x_shape, KernelLayout(*layout_args), present[PROJ_WEIGHT]).values())


@register_flop_formula(torch.ops.dit_vca.vca_core_backward)
def _core_backward_flops(grad_shape, x_shape, tensors_shape, present, made_shape, x_dtype, dtype, *layout_args,
                         out_shape=None, **kwargs) -> int:  # fmt: skip
    """The products of _core_backward: on the ATen path the recomputation of both stages in matmul form (Stage
    I's scores of m1 rows and values of n rows, Stage II's scores and values) and two products per forward
    product (the gradients of both operands); on the Triton path what its two backward kernels multiply (Stage
    II: scores, dq and dT per stream, dW and dV̂; Stage I: scores, dP, dk, dv and dT, see
    vca_triton.tile_products); then the convolution's and the projections' gradients (and the qkv GEMM again
    with recompute_qkv)."""
    layout = KernelLayout(*layout_args)
    B, N, C = grad_shape
    n, m1, m2 = layout.contrast_grid**2, layout.stage1_rows, layout.stage2_cols
    if layout.triton:
        attention = (3 * m2 + 2 * n + 5 * m1) * N * C * B
    else:
        attention = 3 * (m1 + n + m2 + n) * N * C * B
    qkv = (3 if layout.recompute_qkv else 2) * 3 * B * N * C * C
    projection = 2 * B * N * C * C if present[PROJ_WEIGHT] else 0
    return 2 * (attention + 2 * 9 * B * N * C + qkv + projection)

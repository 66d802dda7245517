"""The launch plan of VCA's Triton core: which kernels one layer launches, with which grids and tiles, and what each
launch reads, writes and multiplies. One function, `launch_plan`, answers for a shape and the switches; the
launchers (dit_vca.vca_triton) take their grids and block sizes from it, the tests count its tile products against
the interpreter and hold its grids to the GPU's size, and the roofline (`python -m bench.roofline`) turns its bytes
and FLOPs into times.

Two paths (docs/VCA.md, "The Triton kernels"):
- per head (dit_vca.vca_triton_per_head): one program per (image, head), one kernel forward and one backward, when a
  head's n contrast tokens fit one block (n ≤ the per-head kernels' BLOCK_C) and the B·h programs fill the GPU
  (≥ `PROGRAMS_PER_SM` per multiprocessor) or walk at most `MAX_TRIPS` tiles each;
- split (dit_vca.vca_triton_split): otherwise. A head's keys (Stage I) and queries (Stage II's backward) are split
  over enough programs to fill the GPU, each writing partial results that a later kernel combines in a fixed order
  (Stage I's forward by log-sum-exps); the pooling runs parallel over windows and tokens.
Both finish the backward with `sum_partials_kernel`, the fixed-order sum of the per-program partial gradients. No
kernel uses an atomic operation: results are bitwise the same from run to run.

Bytes are unique bytes of global memory (each tensor a launch reads or writes counted once: a tile read again by
the same program is taken to come from L2), FLOPs are 2 × the multiply-adds of the tile products on padded tiles
(block sizes and the head's two column pieces D0 + D1).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from dit_vca.vca_triton_configs import CONFIGS, TileConfig

DEFAULT_MULTIPROCESSORS = 132  # an H100 SXM or H200: the plan's GPU where none is at hand
PROGRAMS_PER_SM = 2  # a launch fills the GPU with ≥ 2 programs per multiprocessor ...
MAX_TRIPS = 16  # ... or keeps each program's serial loop at ≤ 16 trips
FLOAT32 = 4


def next_power_of_2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def head_pieces(d: int) -> tuple[int, int]:
    """(D0, D1): a head's two column pieces, powers of two ≥ 16 (tl.dot's smallest) with D0 + D1 ≥ d: halves for
    a power of two, else the largest power of two below d and the rest rounded up (72 = 64 + 16, 40 = 32 + 16)."""
    if d <= 16:
        return 16, 16
    if d & (d - 1) == 0:
        return d // 2, d // 2
    first = next_power_of_2(d) // 2
    return first, max(16, next_power_of_2(d - first))


@dataclass(frozen=True)
class CoreShape:
    """What a plan depends on: the tokens (B, N = H², h heads of d channels), the contrast grid p (n = p²), the
    switches, whether a given T replaces the pool of q (with RoPE), the precision, the dtype's size in bytes, the
    GPU's multiprocessors and its platform (target, Triton version)."""

    B: int
    N: int
    h: int
    d: int
    H: int
    p: int
    joint_softmax: bool
    stage1_differential: bool
    stage2_differential: bool
    pooled_content: bool
    given_content: bool = False
    precision: str = "bf16"
    itemsize: int = 2
    multiprocessors: int = DEFAULT_MULTIPROCESSORS
    platform: tuple[str | None, str] = (None, "")

    @property
    def n(self) -> int:
        return self.p * self.p

    @property
    def r(self) -> int:
        return self.H // self.p

    @property
    def G(self) -> int:
        return self.B * self.h

    @property
    def C(self) -> int:
        return self.h * self.d

    @property
    def width(self) -> int:  # D0 + D1
        return sum(head_pieces(self.d))

    @property
    def S(self) -> int:  # streams: T⁺ and T⁻, or T⁺ alone
        return 2 if self.stage1_differential or self.stage2_differential else 1

    @property
    def M1(self) -> int:  # streams Stage I reads
        return 2 if self.stage1_differential else 1

    @property
    def M2(self) -> int:  # streams Stage II reads
        return 2 if self.stage2_differential else 1

    @property
    def two_softmaxes(self) -> bool:
        return self.stage2_differential and not self.joint_softmax

    @property
    def pools_q(self) -> bool:  # T is the pool of q, pooled (and its gradient spread) by the kernels
        return self.pooled_content and not self.given_content

    @property
    def wanted_programs(self) -> int:
        return PROGRAMS_PER_SM * self.multiprocessors


@dataclass(frozen=True)
class Launch:
    """One kernel launch: its grid, the serial loop trips of its longest program, its unique bytes read and
    written, its tile products (multiply-adds), and its constexpr tile sizes and configuration."""

    kernel: str
    grid: tuple[int, ...]
    trips: int
    bytes_read: int
    bytes_written: int
    tile_products: int
    blocks: dict[str, int] = field(default_factory=dict)
    config: TileConfig | None = None

    @property
    def programs(self) -> int:
        return math.prod(self.grid)

    @property
    def flops(self) -> int:
        return 2 * self.tile_products

    def as_row(self) -> dict:
        return {
            "kernel": self.kernel,
            "grid": list(self.grid),
            "programs": self.programs,
            "trips": self.trips,
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "flops": self.flops,
            "blocks": dict(self.blocks),
            "config": self.config.name if self.config else None,
        }


@dataclass(frozen=True)
class Plan:
    path: str  # "per_head" or "split"
    forward: tuple[Launch, ...]
    backward: tuple[Launch, ...]
    partial_rows: tuple[int, int]  # rows of the partial dλ₁ and d norm1, dλ₂ and d norm2 (0: not differential)
    embed_rows: int  # rows of dE±'s partials per head: B, or B' < B where a per-head program runs several images
    tiles_per_split: dict[str, int] = field(default_factory=dict)  # the split kernels' key or query tiles per split

    def launch(self, kernel: str) -> Launch:
        return next(launch for launch in (*self.forward, *self.backward) if launch.kernel == kernel)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _config(kernel: str, shape: CoreShape) -> TileConfig:
    return CONFIGS[kernel].choose(shape.platform, shape.precision, shape.d)


def contrast_block(shape: CoreShape, bound: int) -> int:
    """The contrast tokens per block: all n (a power of two ≥ 16) where they fit `bound`, else `bound`."""
    return min(bound, max(16, next_power_of_2(shape.n)))


def per_head_fits(shape: CoreShape) -> bool:
    """Whether the per-head kernels take this shape: a head's contrast tokens fit the forward's block, and the
    programs fill the GPU or each walks at most MAX_TRIPS tiles."""
    forward = _config("per_head_forward_kernel", shape)
    if shape.n > forward.blocks["BLOCK_C"]:
        return False
    pools = shape.pooled_content  # as if T were pooled here: the choice must not depend on a given T (saved_like)
    trips = max(_per_head_forward_trips(shape, forward, pools), _per_head_backward_trips(shape, pools))
    return shape.G >= shape.wanted_programs or trips <= MAX_TRIPS


def _per_head_forward_trips(shape: CoreShape, config: TileConfig, pools: bool) -> int:
    """Loop trips of a per-head forward program: the pooling's window offsets, Stage I's key tiles, Stage II's
    query tiles."""
    pooling = shape.r**2 if pools else 0
    return pooling + cdiv(shape.N, config.blocks["BLOCK_N"]) + cdiv(shape.N, config.blocks["BLOCK_M"])


def _per_head_backward_trips(shape: CoreShape, pools: bool) -> int:
    """Loop trips of one head in a per-head backward program (a program runs ⌈B·h / programs⌉ heads): per block of
    contrast tokens the pooling's window offsets, Stage I's key tiles twice (recomputed, then backward) and Stage
    II's query tiles twice, the combine, the norm's and the streams' backward; then the pooling's share of dq."""
    config = _config("per_head_backward_kernel", shape)
    block_c = contrast_block(shape, config.blocks["BLOCK_C"])
    blocks, rows = cdiv(shape.n, block_c), cdiv(shape.M1 * shape.n, block_c)  # of n; of the m1 rows of Stage I
    keys, queries = cdiv(shape.N, config.blocks["BLOCK_N"]), cdiv(shape.N, config.blocks["BLOCK_M"])
    pooling = shape.r**2 if pools else 0
    tokens = cdiv(shape.N, config.blocks["BLOCK_T"]) if pools else 0
    return blocks * (pooling + 2 * queries + 4) + rows * 2 * keys + tokens


def backward_scratch(shape: CoreShape) -> tuple[int, int]:
    """Elements of one per-head backward program's scratch: in the core's dtype T± (S·n rows of d), V̂ (n), O (O⁺
    and O⁻ for two softmaxes: K2·N); in float32, in this order, Stage I's partial reads and their max and sum (m1·d,
    2·m1; then dR± and δ±, then dT), R± and their lse (m1·d, m1; then Stage I's dT±), O's lse (K2·N), Stage II's dT±
    and dV̂ ((m2 + n)·d)."""
    n, d, m1, m2 = shape.n, shape.d, shape.M1 * shape.n, shape.M2 * shape.n
    outs = (2 if shape.two_softmaxes else 1) * shape.N
    return (shape.S * n + n + outs) * d, 2 * m1 * d + 3 * m1 + outs + (m2 + n) * d


def launch_plan(shape: CoreShape, path: str | None = None) -> Plan:
    """The launches of one forward and backward of the core for `shape`, on the path the shape takes (or on
    `path`, "per_head" or "split", where it is forced: the tests run both)."""
    if path is None:
        path = "per_head" if per_head_fits(shape) else "split"
    concrete = all(type(size) is int for size in (shape.B, shape.N, shape.h, shape.d))  # not torch.compile's
    # symbolic sizes (dynamic shapes through the fake kernel), which cannot key a cache
    return _planned(shape, path) if concrete else _built(shape, path)


def _built(shape: CoreShape, path: str) -> Plan:
    return _per_head_plan(shape) if path == "per_head" else _split_plan(shape)


# A shape's plan on a path, built once: the core reads it at every forward and backward (building it costs 30-50 µs of
# host time, measured on a CPU, where a small layer's whole host path on a GPU should take a few hundred), and a plan
# is never changed once built.
_planned = functools.cache(_built)


# ----------------------------------------------------------------------------------------------------------------
# The per-head path
# ----------------------------------------------------------------------------------------------------------------


def _stage1_forward_products(shape: CoreShape, block_c: int, block_n: int) -> int:
    """Stage I's online softmax of a block of contrast rows against a key tile: scores and the product with v."""
    return 2 * block_c * block_n * shape.width


def _stage2_forward_products(shape: CoreShape, block_m: int, block_c: int) -> int:
    """Stage II on a tile of queries and a block of contrast columns: scores per stream, then one product with V̂
    (W·V̂) or one per stream (two softmaxes)."""
    return (shape.M2 + (2 if shape.two_softmaxes else 1)) * block_m * block_c * shape.width


def _stage2_backward_products(shape: CoreShape, block_m: int, block_c: int) -> int:
    """Stage II's backward on a tile of queries and a block of columns, one stream at a time: dW, the scores, dq,
    dT and its share of dV̂ per stream."""
    return 5 * shape.M2 * block_m * block_c * shape.width


def _stage1_backward_products(shape: CoreShape, block_c: int, block_n: int) -> int:
    """Stage I's backward of a block of contrast rows against a key tile: scores, dv, dP, dk and dT."""
    return 5 * block_c * block_n * shape.width


def _head_bytes(shape: CoreShape) -> int:
    """One (B, h, N, d) tensor in the core's dtype: q, k, v, Y, dY, ... of every head."""
    return shape.G * shape.N * shape.d * shape.itemsize


def _per_head_plan(shape: CoreShape) -> Plan:
    G, N, n, d, e = shape.G, shape.N, shape.n, shape.d, shape.itemsize
    head = _head_bytes(shape)
    given = G * n * d * e if shape.given_content else 0
    embed = shape.h * shape.S * n * d * e
    params = 2 * (d + 1) * e

    config = _config("per_head_forward_kernel", shape)
    block_n, block_m = config.blocks["BLOCK_N"], config.blocks["BLOCK_M"]
    blocks = {**config.blocks, "BLOCK_C": contrast_block(shape, config.blocks["BLOCK_C"])}
    block_c = blocks["BLOCK_C"]
    products = cdiv(N, block_n) * shape.M1 * _stage1_forward_products(shape, block_c, block_n)  # T⁺, T⁻ per tile
    products += cdiv(N, block_m) * _stage2_forward_products(shape, block_m, block_c)
    forward = Launch("per_head_forward_kernel", (G,), _per_head_forward_trips(shape, config, shape.pools_q),
                     4 * head + given + embed + params, head, G * products, blocks, config)  # fmt: skip

    # The backward: a program per head until the GPU is full, then each program loops over images of its head (B'
    # programs per head: their dE± partials are B' rows per head, not B).
    config = _config("per_head_backward_kernel", shape)
    block_n, block_m = config.blocks["BLOCK_N"], config.blocks["BLOCK_M"]
    blocks = {**config.blocks, "BLOCK_C": contrast_block(shape, config.blocks["BLOCK_C"])}
    block_c = blocks["BLOCK_C"]
    images = min(shape.B, cdiv(shape.wanted_programs, shape.h))  # B'
    programs = images * shape.h
    pairs_k, pairs_q = cdiv(shape.M1 * n, block_c) * cdiv(N, block_n), cdiv(n, block_c) * cdiv(N, block_m)
    products = pairs_k * (_stage1_forward_products(shape, block_c, block_n) +
                          _stage1_backward_products(shape, block_c, block_n))  # fmt: skip
    products += pairs_q * (_stage2_forward_products(shape, block_m, block_c) +
                           _stage2_backward_products(shape, block_m, block_c))  # fmt: skip
    in_dtype, in_floats = backward_scratch(shape)
    read = 5 * head + given + embed + params  # q, k, v, dY, the convolution's share of dv
    written = 3 * head + programs * shape.S * n * d * FLOAT32  # dq, dk, dv; each program's dE±
    written += programs * (d + 1) * FLOAT32 * (shape.stage1_differential + shape.stage2_differential)
    written += G * n * d * FLOAT32 if shape.given_content else 0
    written += programs * (in_dtype * e + in_floats * FLOAT32)  # the scratch, once (if it leaves L2)
    trips = cdiv(shape.B, images) * _per_head_backward_trips(shape, shape.pools_q)
    backward = Launch("per_head_backward_kernel", (programs,), trips, read, written, G * products, blocks, config)
    sums = _sum_launch(shape, images, programs, programs)
    return Plan("per_head", (forward,), (backward, sums), _partial_rows(shape, programs, programs), images)


def _partial_rows(shape: CoreShape, rows1: int, rows2: int) -> tuple[int, int]:
    return rows1 if shape.stage1_differential else 0, rows2 if shape.stage2_differential else 0


def _sum_launch(shape: CoreShape, images: int, rows1: int, rows2: int) -> Launch:
    """sum_partials_kernel: dE± over `images` rows of partials per head, dλ and the norm weights' gradients over
    `rows1` (`rows2`) rows of partials."""
    config = _config("sum_partials_kernel", shape)
    block_r, block_w, block_p = (config.blocks[k] for k in ("BLOCK_R", "BLOCK_W", "BLOCK_P"))
    embed_width = shape.h * shape.S * shape.n * shape.d
    rows1, rows2 = _partial_rows(shape, rows1, rows2)
    embed_programs = cdiv(embed_width, block_w)
    trips = max(cdiv(images, block_r), cdiv(rows1, block_p), cdiv(rows2, block_p))
    read = (images * embed_width + (rows1 + rows2) * (shape.d + 1)) * FLOAT32
    written = (embed_width + 2 * (shape.d + 1)) * FLOAT32
    blocks = {"BLOCK_R": block_r, "BLOCK_W": block_w, "BLOCK_P": block_p, "BLOCK_D": next_power_of_2(shape.d + 1)}
    return Launch("sum_partials_kernel", (embed_programs + 2,), trips, read, written, 0, blocks, config)


# ----------------------------------------------------------------------------------------------------------------
# The split path
# ----------------------------------------------------------------------------------------------------------------


def splits(shape: CoreShape, tiles: int) -> tuple[int, int]:
    """(splits, tiles per split) of a head's `tiles` tiles: at least enough splits that the B·h heads fill the GPU
    (where the head has that many tiles), none empty."""
    wanted = min(tiles, max(1, cdiv(shape.wanted_programs, shape.G)))
    per_split = max(1, tiles // wanted)  # rounded down: ≥ `wanted` splits
    return cdiv(tiles, per_split), per_split


def rows_per_program(shape: CoreShape, trips: int) -> int:
    """Contrast tokens per program of the element-wise kernels that loop over `trips` partials: 32, or fewer where
    the loop is long, until the launch fills the GPU (a power of two ≥ 2)."""
    rows = min(32, max(2, next_power_of_2(shape.n)))
    while trips > MAX_TRIPS and rows > 2 and shape.G * cdiv(shape.n, rows) < shape.wanted_programs:
        rows //= 2
    return rows


def _split_plan(shape: CoreShape) -> Plan:
    G, N, n, d, e, width = shape.G, shape.N, shape.n, shape.d, shape.itemsize, shape.width
    m1, m2 = shape.M1 * n, shape.M2 * n
    head = _head_bytes(shape)
    outs = 2 if shape.two_softmaxes else 1  # O (O⁺, O⁻) saved, and their lse
    streams = G * shape.S * n * d * e
    embed = shape.h * shape.S * n * d * e
    params = 2 * (d + 1) * e
    forward, backward, split_counts = [], [], {}

    # Steps 1-2: one program per contrast token, BLOCK_T tokens of its window per trip.
    config = _config("pool_kernel", shape)
    block_r = next_power_of_2(shape.r)
    block_t = max(config.blocks["BLOCK_T"], block_r)
    pooled = (head if shape.pools_q else 0) + (G * n * d * e if shape.given_content else 0)
    forward.append(Launch("pool_kernel", (G, n), cdiv(shape.r * block_r, block_t) if shape.pools_q else 0,
                          pooled + embed, streams, 0, {"BLOCK_R": block_r, "BLOCK_T": block_t}, config))  # fmt: skip

    # Step 4: Stage I over key splits, each block of contrast tokens; then the log-sum-exp combine and V̂.
    config = _config("stage1_partial_forward_kernel", shape)
    block_c, block_n = contrast_block(shape, config.blocks["BLOCK_C"]), config.blocks["BLOCK_N"]
    key_splits, per_split = splits(shape, cdiv(N, block_n))
    split_counts["stage1_partial_forward_kernel"] = per_split
    blocks_c = cdiv(m1, block_c)  # the m1 rows of both streams
    partial = G * key_splits * m1 * (width + 2) * FLOAT32
    products = G * cdiv(N, block_n) * blocks_c * _stage1_forward_products(shape, block_c, block_n)  # every tile once
    forward.append(Launch("stage1_partial_forward_kernel", (G, key_splits), per_split * blocks_c,
                          G * m1 * d * e + 2 * head, partial, products,
                          {**config.blocks, "BLOCK_C": block_c}, config))  # fmt: skip
    config = _config("stage1_combine_kernel", shape)
    block_j = rows_per_program(shape, key_splits)
    saved1 = G * m1 * (d + 1) * FLOAT32 + G * n * d * e  # R±, their lse; V̂
    forward.append(Launch("stage1_combine_kernel", (G, cdiv(n, block_j)), key_splits, partial + params, saved1, 0,
                          {"BLOCK_J": block_j}, config))  # fmt: skip

    # Step 5: Stage II, one tile of queries per program over the blocks of contrast columns.
    config = _config("stage2_forward_kernel", shape)
    block_m, block_c = config.blocks["BLOCK_M"], contrast_block(shape, config.blocks["BLOCK_C"])
    blocks_c = cdiv(n, block_c)
    per_block = _stage2_forward_products(shape, block_m, block_c)
    saved2 = outs * (head + G * N * FLOAT32)
    forward.append(Launch("stage2_forward_kernel", (G, cdiv(N, block_m)), blocks_c,
                          2 * head + streams + G * n * d * e + params, head + saved2,
                          G * cdiv(N, block_m) * blocks_c * per_block, {"BLOCK_M": block_m, "BLOCK_C": block_c},
                          config))  # fmt: skip

    # Backward, Stage II over query splits: dq, and partial dT±, dV̂, dλ₂, d norm2 per split.
    config = _config("stage2_backward_kernel", shape)
    block_m, block_c = config.blocks["BLOCK_M"], contrast_block(shape, config.blocks["BLOCK_C"])
    blocks_c = cdiv(n, block_c)
    query_splits, per_split = splits(shape, cdiv(N, block_m))
    split_counts["stage2_backward_kernel"] = per_split
    per_pair = _stage2_backward_products(shape, block_m, block_c)
    partial2 = G * query_splits * (m2 + n) * d * FLOAT32
    lam_rows2 = _partial_rows(shape, 0, G * query_splits)[1]
    backward.append(Launch("stage2_backward_kernel", (G, query_splits), per_split * blocks_c,
                           2 * head + saved2 + streams + G * n * d * e + params,
                           head + partial2 + lam_rows2 * (d + 1) * FLOAT32,
                           G * cdiv(N, block_m) * blocks_c * per_pair,
                           {**config.blocks, "BLOCK_C": block_c}, config))  # fmt: skip

    # Stage I's norm backward (dV̂ summed over the query splits), then Stage I over key splits.
    config = _config("stage1_norm_backward_kernel", shape)
    block_j = rows_per_program(shape, query_splits)
    lam_rows1 = _partial_rows(shape, G * cdiv(n, block_j), 0)[0]
    grad_reads = G * m1 * (d + 1) * FLOAT32  # dR±, δ±
    backward.append(Launch("stage1_norm_backward_kernel", (G, cdiv(n, block_j)), query_splits,
                           G * query_splits * n * d * FLOAT32 + G * m1 * d * FLOAT32 + params,
                           grad_reads + lam_rows1 * (d + 1) * FLOAT32, 0, {"BLOCK_J": block_j}, config))  # fmt: skip
    config = _config("stage1_backward_kernel", shape)
    block_c, block_n = contrast_block(shape, config.blocks["BLOCK_C"]), config.blocks["BLOCK_N"]
    blocks_c = cdiv(m1, block_c)  # the m1 rows of both streams
    key_splits, per_split = splits(shape, cdiv(N, block_n))
    split_counts["stage1_backward_kernel"] = per_split
    partial1 = G * key_splits * m1 * d * FLOAT32
    backward.append(Launch("stage1_backward_kernel", (G, key_splits), per_split * blocks_c,
                           G * m1 * d * e + grad_reads + G * m1 * FLOAT32 + 3 * head, 2 * head + partial1,
                           G * cdiv(N, block_n) * blocks_c * _stage1_backward_products(shape, block_c, block_n),
                           {**config.blocks, "BLOCK_C": block_c}, config))  # fmt: skip

    # Steps 1-2, backward: each image's dE± and dT from the partials; dT through the pooling to dq.
    config = _config("streams_backward_kernel", shape)
    block_j = rows_per_program(shape, key_splits + query_splits)
    grad_content = G * n * d * FLOAT32 if shape.pooled_content else 0
    backward.append(Launch("streams_backward_kernel", (G, cdiv(n, block_j)), key_splits + query_splits,
                           partial1 + G * query_splits * m2 * d * FLOAT32, G * shape.S * n * d * FLOAT32 + grad_content,
                           0, {"BLOCK_J": block_j}, config))  # fmt: skip
    if shape.pools_q:
        config = _config("pool_backward_kernel", shape)
        block_t = config.blocks["BLOCK_T"]
        backward.append(Launch("pool_backward_kernel", (G, cdiv(N, block_t)), 1, head + grad_content, head, 0,
                               {"BLOCK_T": block_t}, config))  # fmt: skip
    backward.append(_sum_launch(shape, shape.B, lam_rows1, lam_rows2))
    return Plan("split", tuple(forward), tuple(backward), (lam_rows1, lam_rows2), shape.B, split_counts)

"""Packed (variable-length) encoding through timm blocks.

Instead of padding every sequence to the longest, the batch's tokens are
concatenated into one ``(T, D)`` tensor with cumulative sequence offsets. Every
part of a block except attention works on single tokens (norms, qkv, projection,
MLP, layer scale), so those run on the ``T`` real tokens with no padding; only the
attention kernel needs to know which tokens belong to which image. The block's own
modules are used, so the result equals the padded path.

Attention kernels share torch's varlen signature
``kernel(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale)`` on ``(T, H, hd)``:

* CUDA: torch's varlen (FlashAttention) kernel, :func:`varlen_kernel`;
* elsewhere: :func:`padded_sdpa_kernel`, which scatters the packed q/k/v into a
  padded ``(B, H, L, hd)`` layout with a key-padding mask, runs
  ``F.scaled_dot_product_attention`` and gathers the real rows back. Its scatter
  and gather indices are built once per forward pass (the kernel is a closure over
  them), not once per block; sequences are grouped by length (:func:`length_groups`)
  so that attention, the only padded step, pads each group to its own longest
  sequence. On the CPU the model also encodes large batches in chunks of similar
  length (:func:`token_chunks`) to keep each chunk's activations in cache.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from functools import lru_cache

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import DropPath

Kernel = Callable[..., torch.Tensor]


@lru_cache(maxsize=1)
def _torch_varlen() -> tuple[Kernel | None, bool]:
    """torch's ``varlen_attn`` (``None`` before torch 2.9) and whether it takes
    ``scale`` (torch >= 2.10); looked up once, not on every forward pass."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, False
    return varlen_attn, "scale" in inspect.signature(varlen_attn).parameters


def varlen_kernel(device: torch.device) -> Kernel | None:
    """torch's varlen (FlashAttention) kernel on CUDA, else ``None`` (torch has no CPU
    varlen kernel).

    FlashAttention computes in half precision only, so float32 attention (a CUDA
    forward outside autocast: threshold calibration, timing an fp32 model) takes
    :func:`padded_sdpa_kernel` instead, its indices built once per forward pass.
    """
    varlen_attn, takes_scale = _torch_varlen()
    if device.type != "cuda" or varlen_attn is None:
        return None
    fallback: dict[int, Kernel] = {}

    def kernel(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None):
        default_scale = scale is None or math.isclose(scale, q.shape[-1] ** -0.5)
        if q.dtype in (torch.float16, torch.bfloat16) and (takes_scale or default_scale):
            extra = {"scale": scale} if takes_scale else {}
            return varlen_attn(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, **extra)
        if id(cu_seq_q) not in fallback:
            fallback[id(cu_seq_q)] = padded_sdpa_kernel(cu_seq_q)
        return fallback[id(cu_seq_q)](q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale)

    return kernel


#: Per-group cost of one more attention call, in the units of :func:`length_groups`
#: (query-key pairs): that of one 64-token sequence. Splitting a group pays when it
#: saves more padded pairs than this.
GROUP_OVERHEAD_PAIRS = 64 * 64


def length_groups(lengths: list[int], overhead: int = GROUP_OVERHEAD_PAIRS) -> list[int]:
    """Sizes of the groups, in descending-length order, that minimise padded attention work.

    Padding a group of ``n`` sequences to its longest ``L`` costs ``n * L**2``
    query-key pairs, plus ``overhead`` per group (one more kernel call). Groups are
    runs of the sorted lengths; sequences of equal length stay together. Exact
    dynamic programme over the distinct lengths.
    """
    values: list[int] = []
    counts: list[int] = []
    for length in sorted(lengths, reverse=True):
        if values and values[-1] == length:
            counts[-1] += 1
        else:
            values.append(length)
            counts.append(1)
    cum = np.cumsum([0] + counts, dtype=np.float64)
    square = np.asarray(values, dtype=np.float64) ** 2
    # best[i]: cost of grouping the first i distinct lengths; a group over distinct
    # lengths j..i-1 is padded to values[j] (the longest)
    best = np.zeros(len(values) + 1)
    cut = [0] * (len(values) + 1)
    for i in range(1, len(values) + 1):
        costs = best[:i] + (cum[i] - cum[:i]) * square[:i] + overhead
        j = int(costs.argmin())
        best[i], cut[i] = costs[j], j
    sizes = []
    i = len(values)
    while i > 0:
        sizes.append(int(cum[i] - cum[cut[i]]))
        i = cut[i]
    return sizes[::-1]


#: Packed tokens per chunk on the CPU: a chunk's activations (MLP hidden layer
#: included, ~8 MiB at width 768) stay in cache through a block, where a whole
#: large batch's would stream from memory in every element-wise op.
CPU_CHUNK_TOKENS = 2048


def token_chunks(lengths: torch.Tensor, max_tokens: int | None = None) -> list[torch.Tensor]:
    """Image indices in chunks of at most ``max_tokens`` (default
    :data:`CPU_CHUNK_TOKENS`) tokens, at least one image each; images sorted by
    length so that each chunk's attention pads little."""
    max_tokens = max_tokens or CPU_CHUNK_TOKENS
    order = torch.argsort(lengths, descending=True, stable=True)
    chunks: list[list[int]] = []
    filled = max_tokens
    for i, n in zip(order.tolist(), lengths[order].tolist()):
        if filled + n > max_tokens:
            chunks.append([])
            filled = 0
        chunks[-1].append(i)
        filled += n
    return [torch.tensor(c, dtype=torch.long, device=lengths.device) for c in chunks]


def sorted_chunks(lengths: list[int], max_rows: int | None = None) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """Contiguous runs of sequences of descending ``lengths`` packed one after another,
    each of at most ``max_rows`` rows (default :data:`CPU_CHUNK_TOKENS`; at least one
    sequence): ``(first row, end row, groups)``, ``groups`` being :func:`grouped_kernel`'s
    ``(sequences, length)`` per distinct length in the run."""
    max_rows = max_rows or CPU_CHUNK_TOKENS
    chunks: list[tuple[int, int, list[tuple[int, int]]]] = []
    start = row = 0
    groups: list[tuple[int, int]] = []
    for length in lengths:
        if groups and row + length - start > max_rows:
            chunks.append((start, row, groups))
            start, groups = row, []
        if groups and groups[-1][1] == length:
            groups[-1] = (groups[-1][0] + 1, length)
        else:
            groups.append((1, length))
        row += length
    if groups:
        chunks.append((start, row, groups))
    return chunks


#: Up to this many sequences, the CPU kernel's fused form (``qkv_attention``) runs one
#: attention call per sequence on views of the packed rows: a few more calls, but no
#: copy into a padded layout and back, and no padding.
PER_IMAGE_SEQUENCES = 16


def _padded_layout(
    cu: torch.Tensor, groups: int | None
) -> tuple[list[tuple[int, int, int, torch.Tensor | None]], torch.Tensor, int]:
    """The padded layout of packed sequences at offsets ``cu`` (:func:`padded_sdpa_kernel`'s):
    per group ``(first padded row, images, padded length, key mask or None)``, the padded
    row of every packed token, and the padded rows in all."""
    device = cu.device
    lengths = cu[1:] - cu[:-1]
    batch = lengths.numel()
    total = int(cu[-1])
    # image index and position within its image of every packed token
    seq = torch.repeat_interleave(torch.arange(batch, device=device), lengths, output_size=total)
    pos = torch.arange(total, device=device) - cu[:-1][seq]
    order = torch.argsort(lengths, descending=True, stable=True)
    if groups is None:
        split = torch.split(order, length_groups(lengths.tolist()))
    else:
        split = torch.tensor_split(order, min(max(groups, 1), batch))
    # per group: (first row in the padded buffer, images, padded length, key mask)
    layout: list[tuple[int, int, int, torch.Tensor | None]] = []
    row_of_image = torch.empty(batch, dtype=torch.long, device=device)  # padded row of each image's slot 0
    row = 0
    for idx in split:
        n = idx.numel()
        if n == 0:
            continue
        group_lengths = lengths[idx]
        longest = int(group_lengths.max())
        if longest == 0:
            continue  # empty dummy sequences of a fixed-shape batch hold no rows
        row_of_image[idx] = row + torch.arange(n, device=device) * longest
        mask = torch.arange(longest, device=device) < group_lengths[:, None]
        layout.append((row, n, longest, None if bool(mask.all()) else mask[:, None, None, :]))
        row += n * longest
    rows = row
    slot = row_of_image[seq] + pos  # padded row of every packed token
    return layout, slot, rows


def padded_sdpa_kernel(cu_seqlens: torch.Tensor, groups: int | None = None) -> Kernel:
    """A varlen-signature attention kernel for devices without one (CPU).

    ``cu_seqlens`` (``(B + 1,)`` cumulative offsets) fixes the layout: the images are
    sorted by length and split into groups of similar length, chosen by
    :func:`length_groups` (``groups=None``) or ``groups`` of equal count; each group's
    q/k/v are padded to that group's longest sequence, with the padding keys masked
    (every query row keeps at least its own valid keys, so no row is fully masked).
    The kernel checks that it is called with the same offsets.
    """
    cu = cu_seqlens.to(torch.long)
    batch = cu.numel() - 1
    layout, slot, rows = _padded_layout(cu, groups)

    buffers: dict[tuple, torch.Tensor] = {}

    def scatter(t: torch.Tensor, which: int) -> torch.Tensor:
        """Packed ``(T, H, hd)`` -> padded rows ``(rows, H * hd)``, zeros in the padding."""
        flat = t.reshape(t.shape[0], -1)  # 2-D row copies are the fast case of index_copy_
        if torch.is_grad_enabled() and t.requires_grad:
            # autograd saves the attention inputs: a fresh buffer per call
            return flat.new_zeros(rows, flat.shape[1]).index_copy_(0, slot, flat)
        # no autograd: one zeroed buffer per forward, reused by every block (the
        # real rows are overwritten, the padding rows stay zero)
        key = (which, flat.dtype, flat.shape[1])
        if key not in buffers:
            buffers[key] = flat.new_zeros(rows, flat.shape[1])
        return buffers[key].index_copy_(0, slot, flat)

    def kernel(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None):
        if cu_seq_q is not cu_seqlens and not torch.equal(cu_seq_q, cu_seqlens):
            raise ValueError("padded_sdpa_kernel was built for other sequence offsets")
        heads, head_dim = q.shape[1], q.shape[2]
        qb, kb, vb = scatter(q, 0), scatter(k, 1), scatter(v, 2)
        outs = []
        for start, n, longest, mask in layout:
            # this group's n sequences of `longest` rows, as (n, heads, longest, head_dim) views
            q_, k_, v_ = (
                t[start : start + n * longest].view(n, longest, heads, head_dim).transpose(1, 2) for t in (qb, kb, vb)
            )
            res = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, scale=scale)
            outs.append(res.transpose(1, 2).reshape(n * longest, heads * head_dim))  # a view for SDPA's CPU output
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out.index_select(0, slot).view(-1, heads, head_dim)

    def qkv_kernel(qkv: torch.Tensor, heads: int, head_dim: int, scale: float | None = None) -> torch.Tensor:
        """Attention from the packed ``qkv`` projection ``(T, 3 * H * hd)`` itself, q, k
        and v as strided views of it (as in timm's own ``Attention``): up to
        :data:`PER_IMAGE_SEQUENCES` sequences each attends on its own rows in place;
        more are copied once into the padded layout."""
        if per_image is not None:
            # few sequences: attend each in place, its rows of the packed qkv as views;
            # no scatter, no padding, and the outputs concatenate back in packed order
            outs = []
            for start, end in per_image:
                q, k, v = qkv[start:end].view(1, end - start, 3, heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
                res = F.scaled_dot_product_attention(q, k, v, scale=scale)
                outs.append(res.transpose(1, 2).reshape(end - start, heads * head_dim))
            return outs[0] if len(outs) == 1 else torch.cat(outs)
        buf = scatter(qkv, 3)
        outs = []
        for start, n, longest, mask in layout:
            q, k, v = (
                buf[start : start + n * longest].view(n, longest, 3, heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
            )
            res = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
            outs.append(res.transpose(1, 2).reshape(n * longest, heads * head_dim))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out.index_select(0, slot)

    per_image = None
    if batch <= PER_IMAGE_SEQUENCES:
        bounds = cu.tolist()
        per_image = [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    kernel.padded_rows = rows  # type: ignore[attr-defined]  # attention slots incl. padding
    kernel.qkv_attention = qkv_kernel  # type: ignore[attr-defined]
    return kernel


def grouped_kernel(groups: list[tuple[int, int]]) -> Kernel:
    """A varlen-signature attention kernel for packed rows that hold groups of
    equal-length sequences, each group's rows together: ``groups`` lists ``(sequences,
    length)`` in row order. Each group attends as one ``(n, H, L, hd)`` view of its
    rows: no scatter, no padding, one attention call per group (the policy's context
    blocks on every level's nodes, :meth:`SplitViT._levels_context_features`)."""
    bounds = []
    start = 0
    for n, length in groups:
        bounds.append((start, n, length))
        start += n * length

    def attend_groups(q, k, v, scale):
        outs = []
        for first, n, length in bounds:
            rows = slice(first, first + n * length)
            q_, k_, v_ = (t[rows].view(n, length, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
            res = F.scaled_dot_product_attention(q_, k_, v_, scale=scale)
            outs.append(res.transpose(1, 2).reshape(n * length, -1))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def kernel(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None):
        return attend_groups(q, k, v, scale).view(q.shape)

    def qkv_kernel(qkv: torch.Tensor, heads: int, head_dim: int, scale: float | None = None) -> torch.Tensor:
        """Attention from the packed ``qkv`` projection, q, k and v as strided views of it."""
        q, k, v = qkv.view(qkv.shape[0], 3, heads, head_dim).unbind(1)
        return attend_groups(q, k, v, scale)

    kernel.qkv_attention = qkv_kernel  # type: ignore[attr-defined]
    return kernel


def reference_kernel(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None):
    """Per-sequence scaled-dot-product attention with varlen_attn's signature (a
    slow, obviously correct kernel for tests)."""
    out = torch.empty_like(q)
    bounds = cu_seq_q.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))  # (H, L, hd)
        out[start:end] = F.scaled_dot_product_attention(qs, ks, vs, scale=scale).transpose(0, 1)
    return out


def supports_packing(block: nn.Module) -> bool:
    """True for timm's standard pre-norm ``Block`` with the standard ``Attention``."""
    attn = getattr(block, "attn", None)
    needed = ("norm1", "ls1", "drop_path1", "norm2", "mlp", "ls2", "drop_path2")
    return (
        attn is not None
        and all(hasattr(block, n) for n in needed)
        and all(hasattr(attn, n) for n in ("qkv", "q_norm", "k_norm", "proj", "num_heads", "head_dim", "scale"))
        and getattr(attn, "gate", None) is None
    )


class PackedBatch:
    """A batch of variable-length sequences packed into ``(T, D)``.

    Built from the sequence lengths the host already knows (the model reads them
    in its one host synchronisation), so packing reads nothing back from the device:
    every index is computed on the device with sizes known on the host.

    Attributes:
        keep: ``(B, S)`` bool, the real slots of the padded layout (valid slots first in each row).
        cu_seqlens: int32 cumulative offsets ``(B + 1,)`` (plus one per dummy sequence).
        max_len: longest sequence (a static bound with ``capacity``).
        seq_ids: ``(T,)`` image index of every packed token (per-image drop path).
        total: ``T``, packed rows, dummy rows included.
    """

    def __init__(self, keep: torch.Tensor, lengths: list[int] | None = None, capacity: int | None = None) -> None:
        self.keep = keep
        self.batch, slots = keep.shape
        device = keep.device
        if lengths is None:
            lengths = keep.sum(1).tolist()  # a host read; the model passes the lengths it knows
        real = sum(lengths)
        lengths_t = keep.sum(1)
        cu = torch.zeros(self.batch + 1, dtype=torch.int32, device=device)
        cu[1:] = torch.cumsum(lengths_t, 0)
        self.max_len = max(lengths)
        # slot of every real packed token in the (B * S) padded layout: valid slots lead each row
        seq = torch.repeat_interleave(torch.arange(self.batch, device=device), lengths_t, output_size=real)
        pos = torch.arange(real, device=device) - cu[:-1].to(torch.long)[seq]
        self.index = seq * slots + pos
        self.real = real
        self.total = real
        if capacity is not None:
            # fixed shapes: pad to ``capacity`` rows with dummy sequences of at most ``slots``
            # tokens each, a fixed count of them, so T, cu_seqlens and max_len never change
            if capacity < real:
                raise ValueError(f"token bucket capacity {capacity} < {real} packed tokens")
            # B dummies of at most S rows hold any padding up to B * S rows
            bounds = torch.clamp(torch.arange(1, self.batch + 1, device=device) * slots, max=capacity - real) + real
            cu = torch.cat([cu, bounds.to(torch.int32)])
            seq = torch.cat([seq, torch.full((capacity - real,), self.batch, dtype=seq.dtype, device=device)])
            self.max_len = slots
            self.total = capacity
        self.cu_seqlens = cu
        self.seq_ids = seq

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, S, D)`` -> ``(T, D)`` (zeros in the dummy rows)."""
        packed = x.reshape(-1, x.shape[-1]).index_select(0, self.index)
        if self.total > self.real:
            packed = torch.cat([packed, packed.new_zeros(self.total - self.real, packed.shape[-1])])
        return packed

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """``(T, D)`` -> ``(B, S, D)`` with zeros in the padding slots."""
        out = packed.new_zeros(self.batch * self.keep.shape[1], packed.shape[-1])
        out.index_copy_(0, self.index, packed[: self.real])
        return out.view(self.batch, self.keep.shape[1], -1)


def bucket_capacity(real: int, batch: int, slots: int, buckets: int) -> int:
    """The fixed packed size for ``real`` tokens: the smallest of ``buckets`` evenly
    spaced sizes up to ``batch * slots`` (every sequence full) that holds them."""
    full = batch * slots
    step = -(-full // buckets)
    return min(full, -(-real // step) * step)


def masked_kernel(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None):
    """Varlen attention as one SDPA call with a block-diagonal mask over the packed
    tokens: no host reads and fixed shapes (a stand-in for CUDA's varlen kernel in
    tests of the device path; ``T x T`` memory, so small batches only)."""
    total = q.shape[0]
    seq = torch.searchsorted(cu_seq_q[1:].contiguous(), torch.arange(total, device=q.device), right=True)
    mask = seq[:, None] == seq[None, :]
    qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)[0].transpose(0, 1)


def _drop_path(module: nn.Module, x: torch.Tensor, batch: PackedBatch | None) -> torch.Tensor:
    """Stochastic depth per image, not per packed token (timm's ``DropPath`` would
    treat each of the ``T`` rows as a sample). ``batch=None``: inference only."""
    if batch is not None and isinstance(module, DropPath) and module.training and module.drop_prob > 0.0:
        keep_prob = 1.0 - module.drop_prob
        # same draw as timm's drop_path on (B, N, D): one Bernoulli per image (and one
        # for the dummy rows of a fixed-shape batch)
        mask = x.new_empty(batch.batch + (batch.total > batch.real), 1, 1).bernoulli_(keep_prob).view(-1)
        if module.scale_by_keep and keep_prob > 0.0:
            mask.div_(keep_prob)
        return x * mask[batch.seq_ids].unsqueeze(-1)
    return module(x)


def packed_attention(attn: nn.Module, x: torch.Tensor, batch: PackedBatch | None, kernel: Kernel) -> torch.Tensor:
    """timm ``Attention.forward`` on packed tokens ``(T, D)``."""
    out = attend(attn, attn.qkv(x), batch, kernel)
    out = attn.norm(out) if hasattr(attn, "norm") else out
    return attn.proj_drop(attn.proj(out))


def attend(attn: nn.Module, qkv: torch.Tensor, batch: PackedBatch | None, kernel: Kernel) -> torch.Tensor:
    """The attention kernel on the packed ``qkv`` projection ``(T, 3 * D)``: ``(T, D)``
    (``batch=None``: a kernel that knows its own layout, :func:`grouped_kernel`)."""
    total = qkv.shape[0]
    fused = getattr(kernel, "qkv_attention", None)
    if fused is not None and isinstance(attn.q_norm, nn.Identity) and isinstance(attn.k_norm, nn.Identity):
        return fused(qkv, attn.num_heads, attn.head_dim, scale=attn.scale)
    q, k, v = qkv.reshape(total, 3, attn.num_heads, attn.head_dim).unbind(1)
    q, k = attn.q_norm(q), attn.k_norm(k)
    cu, longest = (batch.cu_seqlens, batch.max_len) if batch is not None else (None, None)
    out = kernel(q, k, v, cu, cu, longest, longest, scale=attn.scale)
    return out.reshape(total, attn.num_heads * attn.head_dim)


def packed_block(block: nn.Module, x: torch.Tensor, batch: PackedBatch | None, kernel: Kernel) -> torch.Tensor:
    """timm ``Block.forward`` on packed tokens ``(T, D)`` (``batch=None``: in inference,
    with a kernel that knows its own layout)."""
    x = x + _drop_path(block.drop_path1, block.ls1(packed_attention(block.attn, block.norm1(x), batch, kernel)), batch)
    return x + _drop_path(block.drop_path2, block.ls2(block.mlp(block.norm2(x))), batch)


class CompiledBlock:
    """A timm ``Block``'s per-token work under ``torch.compile``, for inference.

    Two compiled pieces around the attention kernel: norm and qkv projection before
    it; projection, residuals, norm and MLP after it. The kernel stays eager: its
    offsets change with every batch. With fixed packed shapes (``token_buckets``) each
    piece compiles once per bucket, and ``mode="reduce-overhead"`` replays them as
    CUDA graphs.
    """

    def __init__(self, block: nn.Module, **options) -> None:
        self.block = block
        self.before = torch.compile(self._before, **options)
        self.after = torch.compile(self._after, **options)

    def _before(self, x: torch.Tensor) -> torch.Tensor:
        return self.block.attn.qkv(self.block.norm1(x))

    def _after(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        block, attn = self.block, self.block.attn
        out = attn.norm(attended) if hasattr(attn, "norm") else attended
        x = x + block.ls1(attn.proj(out))
        return x + block.ls2(block.mlp(block.norm2(x)))

    def __call__(self, x: torch.Tensor, batch: PackedBatch, kernel: Kernel) -> torch.Tensor:
        return self.after(x, attend(self.block.attn, self.before(x), batch, kernel))

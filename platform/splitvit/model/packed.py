"""Packed (variable-length) attention through timm blocks, for CUDA.

Instead of padding every sequence to the longest, the batch's tokens are
concatenated into one ``(T, D)`` tensor with cumulative sequence offsets, and each
block's attention runs torch's varlen (FlashAttention) kernel, so no work is spent
on padding. Everything except the attention kernel is the block's own modules
(norms, qkv, projection, MLP, layer scale), so the result equals the padded path.

``packed_kernel(device)`` returns the kernel where torch offers one (CUDA) and
``None`` elsewhere; callers then fall back to padding with a key mask.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

Kernel = Callable[..., torch.Tensor]


def packed_kernel(device: torch.device) -> Kernel | None:
    """torch's varlen attention on CUDA, else ``None`` (no packed kernel on CPU)."""
    if device.type != "cuda":
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def reference_kernel(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None):
    """Per-sequence scaled-dot-product attention with varlen_attn's signature (for
    checking the packing on machines without the CUDA kernel)."""
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


def packed_attention(attn: nn.Module, x: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int, kernel: Kernel) -> torch.Tensor:
    """timm ``Attention.forward`` on packed tokens ``(T, D)``."""
    total = x.shape[0]
    q, k, v = attn.qkv(x).reshape(total, 3, attn.num_heads, attn.head_dim).unbind(1)
    q, k = attn.q_norm(q), attn.k_norm(k)
    out = kernel(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, scale=attn.scale)
    out = out.reshape(total, attn.num_heads * attn.head_dim)
    out = attn.norm(out) if hasattr(attn, "norm") else out
    return attn.proj_drop(attn.proj(out))


def packed_block(block: nn.Module, x: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int, kernel: Kernel) -> torch.Tensor:
    """timm ``Block.forward`` on packed tokens ``(T, D)``."""
    x = x + block.drop_path1(block.ls1(packed_attention(block.attn, block.norm1(x), cu_seqlens, max_len, kernel)))
    return x + block.drop_path2(block.ls2(block.mlp(block.norm2(x))))


def pack(x: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(B, S, D)`` and a ``(B, S)`` keep mask (valid slots first in each row) ->
    packed ``(T, D)``, int32 cumulative offsets ``(B + 1,)``, longest length."""
    lengths = keep.sum(1)
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=x.device)
    cu[1:] = torch.cumsum(lengths, 0)
    return x[keep], cu, int(lengths.max())


def unpack(packed: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack`: zeros in the padding slots."""
    out = packed.new_zeros(*keep.shape, packed.shape[-1])
    out[keep] = packed
    return out

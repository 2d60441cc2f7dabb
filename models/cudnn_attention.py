"""cuDNN flash attention over packed documents, as cuDNN expresses them: each row's documents
as segment offsets and lengths (its packed layout) with the causal mask inside each segment,
never a [T, S] mask or bias.

cuDNN's packed layout takes a static number of segments per row, ``max_documents``; its
softmax statistics are kept per segment slot ([B * max_documents, heads, T] float32), so
the slots cost memory and are not unbounded. A row holding more documents than that has its
last ones share the last slot: they see each other, as documents do in pretraining without a
document mask (Megatron's default), and a row never sees another row.

The call runs per device (``models.sharding.per_device``): rows split as ``batch`` maps them,
heads as ``heads`` and ``kv_heads`` do. JAX's cuDNN attention has a custom partitioner that
cannot place it in a partly manual region (the trainer's data shard_map on a mesh with fsdp
or tensor axes), and a per-device call needs none.
"""
from __future__ import annotations

import math

import jax.numpy as jnp

from models.sharding import per_device

Q_AXES = ("batch", None, "heads", None)  # [B, T, N, H]: the whole sequence on every device
KV_AXES = ("batch", None, "kv_heads", None)
ROW_AXES = ("batch", None)


def segment_layout(segment_ids_BxL, max_documents: int):
    """(offsets [B, M + 1], lengths [B, M]) of each row's documents (M = ``max_documents``),
    as cuDNN's packed layout takes them: the first index and the length of the j-th document,
    -1 past a row's last. A document is a run of equal segment ids; the documents after the
    M-th share the M-th slot."""
    b, length = segment_ids_BxL.shape
    starts = jnp.concatenate([jnp.ones((b, 1), bool),
                              segment_ids_BxL[:, 1:] != segment_ids_BxL[:, :-1]], axis=1)
    slot = jnp.minimum(jnp.cumsum(starts, axis=1) - 1, max_documents - 1)  # [B, L]
    lengths = jnp.sum(slot[:, :, None] == jnp.arange(max_documents), axis=1, dtype=jnp.int32)
    first = jnp.cumsum(lengths, axis=1, dtype=jnp.int32) - lengths
    used = lengths > 0  # slots fill from the left, so the used ones come first
    offsets = jnp.where(used, first, -1)
    offsets = jnp.concatenate([offsets, jnp.full((b, 1), -1, jnp.int32)], axis=1)
    return offsets, jnp.where(used, lengths, -1)


def _local_attention(q, k, v, segment_ids, max_documents: int):
    from jax._src.cudnn.fused_attention_stablehlo import MaskType
    from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_attention

    scale = 1.0 / math.sqrt(q.shape[-1])
    if segment_ids is None:
        return cudnn_attention(q, k, v, scale=scale, mask_type=MaskType.CAUSAL, qkv_layout="BTNH")
    offsets, lengths = segment_layout(segment_ids, max_documents)
    return cudnn_attention(q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets,
                           kv_offsets=offsets, scale=scale, mask_type=MaskType.PADDING_CAUSAL,
                           qkv_layout="BTNH")


def cudnn_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, segment_ids_BxL, max_documents: int):
    """Causal attention within each document of each row (all of a row when segment_ids is
    None), by cuDNN's flash kernel; GPU only."""
    args = [q_BxTxNxH, k_BxSxKxH, v_BxSxKxH]
    axes = [Q_AXES, KV_AXES, KV_AXES]
    if segment_ids_BxL is not None:
        args.append(segment_ids_BxL)
        axes.append(ROW_AXES)

    def local(q, k, v, segment_ids=None):
        return _local_attention(q, k, v, segment_ids, max_documents)

    # Query heads split with their KV heads or not at all: a device holding a slice of the
    # query heads needs exactly the KV heads of their groups.
    return per_device(local, args, axes, Q_AXES, together=(("heads", "kv_heads"),))

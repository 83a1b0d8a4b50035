"""Anchors, draft blocks, labels and the DFlash attention mask (arXiv 2602.06036, Sec. 3).

One training sequence of S tokens becomes N draft blocks of ``block_size`` (Bs) slots each. Block b
starts at an *anchor* position a_b: its input is ``[x[a_b], MASK x (Bs - 1)]`` and slot k predicts
``x[a_b + k]`` (same position, no ``+1`` shift). Its queries attend to the target's context features
at positions strictly before the anchor (``kv < a_b``) and to its own block bidirectionally; they see
no other block. Both ``kv <= a_b`` and the ``+1`` label shift were real bugs in a public trainer
(training accuracy ~70%, serving acceptance ~1.0): the tests pin both.

Layout used everywhere in this package:

- Q axis (length ``N * Bs``): query ``q`` belongs to block ``q // Bs``, slot ``q % Bs``.
- KV axis (length ``S + N * Bs``): ``[context (S) | block_0 | ... | block_{N-1}]``.

Anchor tensors are always a pair ``anchors`` (int64 ``[B, N]``) and ``valid`` (bool ``[B, N]``);
``N`` is fixed to ``max_anchors`` so compiled code sees one shape. Invalid (padding) blocks see
nothing, produce zero attention output and get zero loss weight.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

#: flex_attention's default sparse tile (rows x columns of the Q x KV grid per BlockMask entry).
DEFAULT_TILE = 128


def sample_anchors(
    loss_mask: Tensor, max_anchors: int, *, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Sample up to ``max_anchors`` anchor positions per sequence, uniformly without replacement.

    A position ``a`` is a candidate when ``loss_mask[a]`` and ``loss_mask[a + 1]`` are both set, so
    every block has at least one supervised slot (slot 1 predicts ``x[a + 1]``).

    Args:
        loss_mask (Tensor): bool ``[B, S]``, True on tokens whose prediction is trained
            (assistant tokens).
        max_anchors (int): N, the number of blocks per sequence. The output always has N columns
            (fixed shape, no recompiles); sequences with fewer candidates get padding blocks.
        generator (torch.Generator, optional): RNG on ``loss_mask.device`` for reproducible draws.

    Returns:
        tuple[Tensor, Tensor]: ``anchors`` int64 ``[B, N]`` and ``valid`` bool ``[B, N]``. Per row the
        valid anchors come first, unique and sorted ascending (neighbouring blocks share BlockMask
        tiles); padding entries have anchor 0 and ``valid=False``.

    Raises:
        ValueError: ``loss_mask`` is not a 2-D bool tensor, or ``max_anchors < 1``.
    """
    if loss_mask.dtype != torch.bool or loss_mask.dim() != 2:
        raise ValueError(
            f"loss_mask must be a bool tensor [B, S], got {loss_mask.dtype} {tuple(loss_mask.shape)}; "
            "convert with loss_mask.bool()"
        )
    if max_anchors < 1:
        raise ValueError(f"max_anchors must be >= 1, got {max_anchors}")
    batch, seq_len = loss_mask.shape
    device = loss_mask.device
    if seq_len < 2:
        zeros = torch.zeros(batch, max_anchors, dtype=torch.long, device=device)
        return zeros, torch.zeros(batch, max_anchors, dtype=torch.bool, device=device)
    candidate = loss_mask[:, :-1] & loss_mask[:, 1:]  # [B, S-1]
    # Random keys in [0, 1) for candidates, 2 for the rest: the k smallest keys are a uniform
    # sample without replacement among candidates, taken in one batched topk.
    keys = torch.rand(candidate.shape, generator=generator, device=device)
    keys = keys.masked_fill(~candidate, 2.0)
    k = min(max_anchors, seq_len - 1)
    picked_keys, picked = keys.topk(k, dim=1, largest=False)
    picked_valid = picked_keys < 1.0
    # Sort valid anchors ascending and push padding to the end: padding sorts after every position.
    order_key = torch.where(picked_valid, picked, seq_len)
    order_key, _ = order_key.sort(dim=1)
    valid = order_key < seq_len
    anchors = torch.where(valid, order_key, 0)
    if k < max_anchors:
        pad = max_anchors - k
        anchors = torch.nn.functional.pad(anchors, (0, pad), value=0)
        valid = torch.nn.functional.pad(valid, (0, pad), value=False)
    return anchors, valid


def draft_input_ids(input_ids: Tensor, anchors: Tensor, valid: Tensor, block_size: int, mask_token_id: int) -> Tensor:
    """Token ids of the draft blocks: ``[x[a_b], MASK x (Bs - 1)]`` for every block b.

    Args:
        input_ids (Tensor): int64 ``[B, S]``.
        anchors (Tensor): int64 ``[B, N]`` from :func:`sample_anchors`.
        valid (Tensor): bool ``[B, N]``.
        block_size (int): Bs.
        mask_token_id (int): an existing row of the target embedding (never resize it for this).

    Returns:
        Tensor: int64 ``[B, N * Bs]``; padding blocks are all ``mask_token_id``. Embed with the
        target's frozen ``embed_tokens``.
    """
    _check_anchors(anchors, valid, input_ids.shape[0])
    batch, num_blocks = anchors.shape
    first = torch.gather(input_ids, 1, anchors).masked_fill(~valid, mask_token_id)
    ids = torch.full((batch, num_blocks, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    ids[:, :, 0] = first
    return ids.view(batch, num_blocks * block_size)


def draft_position_ids(anchors: Tensor, block_size: int) -> Tensor:
    """RoPE positions of the draft slots: slot k of the block anchored at a is at ``a + k``.

    Args:
        anchors (Tensor): int64 ``[B, N]``.
        block_size (int): Bs.

    Returns:
        Tensor: int64 ``[B, N * Bs]``. (Context token j sits at position j.)
    """
    offsets = torch.arange(block_size, device=anchors.device)
    return (anchors[:, :, None] + offsets).flatten(1)


def build_labels(
    input_ids: Tensor, loss_mask: Tensor, anchors: Tensor, valid: Tensor, block_size: int
) -> tuple[Tensor, Tensor]:
    """Targets of every draft slot: slot k of block b predicts ``x[a_b + k]`` (no ``+1`` shift).

    Args:
        input_ids (Tensor): int64 ``[B, S]``.
        loss_mask (Tensor): bool ``[B, S]``.
        anchors (Tensor): int64 ``[B, N]``.
        valid (Tensor): bool ``[B, N]``.
        block_size (int): Bs.

    Returns:
        tuple[Tensor, Tensor]: ``labels`` int64 ``[B, N, Bs]`` and ``label_mask`` bool ``[B, N, Bs]``.
        ``label_mask`` is False for slot 0 (the anchor is given, not predicted), for padding blocks,
        for ``a_b + k >= S`` and where ``loss_mask[a_b + k]`` is False; ``labels`` is 0 there.
    """
    _check_anchors(anchors, valid, input_ids.shape[0])
    batch, seq_len = input_ids.shape
    positions = draft_position_ids(anchors, block_size).view(batch, -1, block_size)
    inside = positions < seq_len
    flat = positions.clamp(max=seq_len - 1).flatten(1)
    labels = torch.gather(input_ids, 1, flat).view_as(positions)
    supervised = torch.gather(loss_mask, 1, flat).view_as(positions)
    not_anchor = torch.arange(block_size, device=anchors.device) > 0
    label_mask = valid[:, :, None] & inside & supervised & not_anchor
    return labels.masked_fill(~label_mask, 0), label_mask


def dflash_mask_mod(
    anchors: Tensor, valid: Tensor, context_len: int, block_size: int
) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """The DFlash ``mask_mod`` for flex_attention: True where query ``q`` may attend to key ``kv``.

    Query q is slot ``q % Bs`` of block ``b = q // Bs``. It sees context key ``kv < S`` iff
    ``kv < anchors[batch, b]`` (strict: the anchor's own target hidden state is not yet known at
    inference), and draft key ``kv >= S`` iff it belongs to block b; nothing if ``valid[batch, b]``
    is False. Elementwise with broadcasting, so it also evaluates on index grids
    (:func:`dense_attention_mask`).

    Args:
        anchors (Tensor): int64 ``[B, N]``.
        valid (Tensor): bool ``[B, N]``.
        context_len (int): S, the number of context keys before the draft blocks. A Python int:
            a new S is a new compiled graph, so pad sequences to a fixed length or a few buckets.
        block_size (int): Bs.

    Returns:
        Callable: ``mask_mod(batch, head, q_idx, kv_idx) -> bool Tensor``; ``head`` is ignored
        (the mask is shared by all heads, BlockMask ``H=None``).
    """
    last_block = anchors.shape[1] - 1

    def mask_mod(batch: Tensor, head: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        # Clamp: flex may evaluate padded query rows of the last tile; never index past N.
        block = torch.clamp(q_idx // block_size, max=last_block)
        in_context = kv_idx < context_len
        sees_context = in_context & (kv_idx < anchors[batch, block])
        sees_own_block = ~in_context & ((kv_idx - context_len) // block_size == block)
        return valid[batch, block] & (sees_context | sees_own_block)

    return mask_mod


def dense_attention_mask(anchors: Tensor, valid: Tensor, context_len: int, block_size: int) -> Tensor:
    """The DFlash mask as a dense bool tensor for SDPA (CPU and small cases only).

    Evaluates :func:`dflash_mask_mod` on the full grid, so it costs ``B * N*Bs * (S + N*Bs)``
    bytes: fine for tests and CPU runs, not for long-context GPU training (use
    :func:`build_block_mask`).

    Returns:
        Tensor: bool ``[B, 1, N * Bs, S + N * Bs]``, True = attend. Rows of padding blocks are all
        False (torch SDPA returns zeros for them on CPU; the drafter zeroes them explicitly too).
    """
    batch, num_blocks = anchors.shape
    q_len = num_blocks * block_size
    device = anchors.device
    mask_mod = dflash_mask_mod(anchors, valid, context_len, block_size)
    b = torch.arange(batch, device=device).view(batch, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    q = torch.arange(q_len, device=device).view(1, 1, q_len, 1)
    kv = torch.arange(context_len + q_len, device=device).view(1, 1, 1, -1)
    return mask_mod(b, h, q, kv)


def build_block_mask(
    anchors: Tensor,
    valid: Tensor,
    context_len: int,
    block_size: int,
    *,
    tile: int | tuple[int, int] = DEFAULT_TILE,
) -> BlockMask:
    """The DFlash BlockMask (``H=None``), built from tile indices without a dense Q x KV grid.

    Choice: ``BlockMask.from_kv_blocks`` on tile-level "any"/"all" tables computed in closed form
    from the anchors, rather than ``create_block_mask``. ``create_block_mask`` evaluates the
    ``mask_mod`` on every (q, kv) pair (B * N*Bs * (S + N*Bs) booleans, ~100 MB per sample at S=4k,
    N=512, Bs=16, unless compiled); the closed form costs O(B * N*Bs * #kv-tiles) and has no
    compile step, so it runs on any device, outside the compiled training step. Tests check it
    equals ``create_block_mask`` tile for tile.

    Tile (qt, kt) is *full* (mask_mod skipped) when every pair in it is visible: a tile wholly
    inside the context whose rows are all valid and have ``anchor >= tile end``, or a tile wholly
    inside the one draft block that all its rows belong to. It is *partial* (mask_mod applied) when
    some but not all pairs are visible. Tiles crossing the Q or KV end are never full.

    Args:
        anchors (Tensor): int64 ``[B, N]``, valid entries sorted ascending per row (sorting is
            what keeps the mask sparse; correctness does not depend on it).
        valid (Tensor): bool ``[B, N]``.
        context_len (int): S.
        block_size (int): Bs.
        tile (int | tuple[int, int]): BlockMask tile (Q rows, KV columns); flex's default is 128.

    Returns:
        BlockMask: for ``Q_LEN = N * Bs`` and ``KV_LEN = S + N * Bs``, batch B, one head row
        (broadcast over heads), with :func:`dflash_mask_mod` attached.
    """
    _check_anchors(anchors, valid, anchors.shape[0])
    q_tile, kv_tile = (tile, tile) if isinstance(tile, int) else tile
    batch, num_blocks = anchors.shape
    device = anchors.device
    q_len = num_blocks * block_size
    kv_len = context_len + q_len
    num_q_tiles = -(-q_len // q_tile)
    num_kv_tiles = -(-kv_len // kv_tile)

    # Per query row (padded to whole tiles): its block, validity and visible context [0, ctx_end).
    rows = torch.arange(num_q_tiles * q_tile, device=device)
    real_row = rows < q_len
    block = torch.clamp(rows // block_size, max=num_blocks - 1)
    row_valid = valid[:, block] & real_row  # [B, Rq]
    ctx_end = torch.where(row_valid, anchors[:, block], 0).view(batch, num_q_tiles, q_tile)
    row_valid_t = row_valid.view(batch, num_q_tiles, q_tile)

    kv_start = torch.arange(num_kv_tiles, device=device) * kv_tile  # [Tk]
    kv_end = kv_start + kv_tile

    # Context part: rows see [0, ctx_end); tile columns [kv_start, min(kv_end, S)).
    ctx_any = (kv_start < context_len) & (ctx_end.amax(-1, keepdim=True) > kv_start)
    q_tile_whole = (torch.arange(num_q_tiles, device=device) + 1) * q_tile <= q_len  # [Tq]
    all_rows_valid = row_valid_t.all(-1, keepdim=True) & q_tile_whole[:, None]
    ctx_full = all_rows_valid & (kv_end <= context_len) & (ctx_end.amin(-1, keepdim=True) >= kv_end)

    # Own-block part: row r sees draft keys [S + blk*Bs, S + (blk+1)*Bs), i.e. kv tiles first..last.
    own_first = (context_len + block * block_size) // kv_tile  # [Rq]
    own_last = (context_len + (block + 1) * block_size - 1) // kv_tile
    own_count = torch.zeros(batch, num_q_tiles, num_kv_tiles, dtype=torch.int32, device=device)
    for step in range(-(-block_size // kv_tile) + 1):  # tiles one block can touch
        tile_idx = torch.minimum(own_first + step, own_last).view(1, num_q_tiles, q_tile)
        own_count.scatter_add_(2, tile_idx.expand(batch, -1, -1), row_valid_t.to(torch.int32))
    own_any = own_count > 0
    # Full only if every row of the q tile is in one block b and the kv tile lies inside block b.
    block_t = block.view(num_q_tiles, q_tile)
    one_block = block_t.amin(-1) == block_t.amax(-1)  # [Tq]
    own_start = context_len + block_t[:, 0] * block_size
    own_full = (
        all_rows_valid
        & one_block[:, None]
        & (kv_start >= own_start[:, None])
        & (kv_end <= (own_start + block_size)[:, None])
        & (kv_end <= kv_len)
    )

    full = ctx_full | own_full
    partial = (ctx_any | own_any) & ~full
    return BlockMask.from_kv_blocks(
        *_to_indices(partial),
        *_to_indices(full),
        BLOCK_SIZE=(q_tile, kv_tile),
        mask_mod=dflash_mask_mod(anchors, valid, context_len, block_size),
        seq_lengths=(q_len, kv_len),
    )


def _to_indices(tiles: Tensor) -> tuple[Tensor, Tensor]:
    """bool ``[B, Tq, Tk]`` tile table -> (num_blocks int32 ``[B, 1, Tq]``, indices ``[B, 1, Tq, Tk]``)."""
    counts = tiles.sum(-1, dtype=torch.int32)
    # Stable descending sort puts the selected kv tiles first, in increasing kv order.
    indices = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True)
    return counts[:, None], indices.to(torch.int32)[:, None]


def _check_anchors(anchors: Tensor, valid: Tensor, batch: int) -> None:
    if anchors.dtype != torch.long or valid.dtype != torch.bool or anchors.shape != valid.shape:
        raise ValueError(
            "anchors must be int64 [B, N] and valid bool [B, N] of the same shape, got "
            f"{anchors.dtype} {tuple(anchors.shape)} and {valid.dtype} {tuple(valid.shape)}; "
            "use dflash.masks.sample_anchors"
        )
    if anchors.dim() != 2 or anchors.shape[0] != batch:
        raise ValueError(f"anchors must be [B={batch}, N], got {tuple(anchors.shape)}")

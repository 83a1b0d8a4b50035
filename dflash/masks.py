"""Anchors, draft blocks, labels and the DFlash attention mask (arXiv 2602.06036, Sec. 3).

One training sequence of S tokens becomes N draft blocks of ``block_size`` (Bs) slots each. Block b
starts at an *anchor* position a_b: its input is ``[x[a_b], MASK x (Bs - 1)]`` and slot k predicts
``x[a_b + k]`` (same position, no ``+1`` shift). Its queries attend to the target's context features
at positions strictly before the anchor (``kv < a_b``) and to its own block (bidirectionally, or
causally on causal layers, below); they see no other block. Both ``kv <= a_b`` and the ``+1``
label shift were real bugs in a public trainer (training accuracy ~70%, serving acceptance ~1.0):
the tests pin both.

Layout used everywhere in this package:

- Q axis (length ``N * Bs``): query ``q`` belongs to block ``q // Bs``, slot ``q % Bs``.
- KV axis (length ``S + N * Bs``): ``[context (S) | block_0 | ... | block_{N-1}]``.

Anchor tensors are always a pair ``anchors`` (int64 ``[B, N]``) and ``valid`` (bool ``[B, N]``);
``N`` is fixed to ``max_anchors`` so compiled code sees one shape. Invalid (padding) blocks see
nothing, produce zero attention output and get zero loss weight.

Packed rows (:mod:`dflash.data.packing`) hold several conversations, each a *document*, named by
``document_ids`` (int ``[B, S]``): a document is a maximal run of equal ids (packing writes 0, 1,
2, ... and -1 on padding). Every function here takes ``document_ids=None`` (one document per row,
the unpacked case) or the row's ids, and then keeps each document on its own as if the target had
seen it alone (speculators' DFlash packing does the same): anchors are drawn per document, a block
sees context of its anchor's document only (``start(a_b) <= kv < a_b``), a slot's label must lie in
the anchor's document, and draft positions come from the row's ``position_ids`` (restarting at 0 in
each document). :func:`document_causal_mask` and :func:`document_causal_block_mask` are the frozen
target's side of the same rule: causal attention within each document.

Sliding-window drafter layers (``sliding_window=W``, :mod:`dflash.drafter.modeling_dflash`) see less
context: slot k of the block anchored at a sits at position ``a + k`` and sees the W positions
ending there, so its context is ``max(start, a + k - W + 1) <= kv < a``; ``W >= Bs``, so it still
sees its block. That is what flash-attention's window gives the same slot at inference
(transformers, z-lab/dflash) and SpecForge's sliding DFlash mask, so a drafter is trained on the
context it is served with. Every function taking ``sliding_window`` treats None as full attention.

Causal layers (``causal=True``, :meth:`dflash.drafter.modeling_dflash.DFlashDraftConfig.layer_is_causal`:
the sliding layers of a config without ``is_causal``, as vLLM, SGLang, TensorRT-LLM and z-lab's
newer loader serve them) see their block causally: slot k sees slots ``0..k`` of its own block
instead of all of it; the context is the same. Every function taking ``causal`` treats False
(the default) as a bidirectional block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

#: flex_attention's default sparse tile (rows x columns of the Q x KV grid per BlockMask entry).
DEFAULT_TILE = 128


def document_starts(document_ids: Tensor) -> Tensor:
    """Position where each token's document starts (documents are maximal runs of equal ids).

    Args:
        document_ids (Tensor): int ``[B, S]``.

    Returns:
        Tensor: int64 ``[B, S]``; ``start[b, i] <= i`` and tokens i, j lie in the same document iff
        ``start[b, i] == start[b, j]``.
    """
    positions = torch.arange(document_ids.shape[1], device=document_ids.device)
    boundary = torch.ones_like(document_ids, dtype=torch.bool)
    boundary[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return torch.where(boundary, positions, 0).cummax(dim=1).values


def sample_anchors(
    loss_mask: Tensor,
    max_anchors: int,
    *,
    document_ids: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Sample up to ``max_anchors`` anchor positions per row, uniformly without replacement within
    each document, the row's budget shared max-min fairly by its documents.

    A position ``a`` is a candidate when ``loss_mask[a]`` and ``loss_mask[a + 1]`` are both set and
    lie in the same document, so every block has at least one supervised slot (slot 1 predicts
    ``x[a + 1]``) of its own document.

    Fair share (max-min fairness, "equal split with leftovers redistributed"): a document with
    ``c_d`` candidates gets ``q_d = min(c_d, t)`` anchors, t the largest integer with
    ``sum_d min(c_d, t) <= max_anchors``; the ``max_anchors - sum_d q_d`` slots left over go one
    each to documents with ``c_d > t``, picked uniformly at random. So a short conversation keeps all
    of its candidates, as it would alone in an unpacked row capped at ``max_anchors``, and long ones
    split the rest evenly; ``sum_d q_d = min(max_anchors, sum_d c_d)``. (Speculators instead gives
    every document ``num_anchors`` slots, a shape that varies with the document count.) With one
    document per row this is a uniform sample of ``min(max_anchors, c)`` candidates.

    Args:
        loss_mask (Tensor): bool ``[B, S]``, True on tokens whose prediction is trained
            (assistant tokens).
        max_anchors (int): N, the number of blocks per row. The output always has N columns
            (fixed shape, no recompiles); rows with fewer candidates get padding blocks.
        document_ids (Tensor, optional): int ``[B, S]`` (module docstring); None = one document.
        generator (torch.Generator, optional): RNG on ``loss_mask.device`` for reproducible draws.

    Returns:
        tuple[Tensor, Tensor]: ``anchors`` int64 ``[B, N]`` and ``valid`` bool ``[B, N]``. Per row the
        valid anchors come first, unique and sorted ascending (neighbouring blocks share BlockMask
        tiles); padding entries have anchor 0 and ``valid=False``.

    Raises:
        ValueError: ``loss_mask`` is not a 2-D bool tensor, ``document_ids`` is not an integer tensor
            of its shape, or ``max_anchors < 1``.
    """
    if loss_mask.dtype != torch.bool or loss_mask.dim() != 2:
        raise ValueError(
            f"loss_mask must be a bool tensor [B, S], got {loss_mask.dtype} {tuple(loss_mask.shape)}; "
            "convert with loss_mask.bool()"
        )
    if max_anchors < 1:
        raise ValueError(f"max_anchors must be >= 1, got {max_anchors}")
    _check_documents(document_ids, loss_mask.shape)
    batch, seq_len = loss_mask.shape
    device = loss_mask.device
    if seq_len < 2:
        zeros = torch.zeros(batch, max_anchors, dtype=torch.long, device=device)
        return zeros, torch.zeros(batch, max_anchors, dtype=torch.bool, device=device)
    candidate = loss_mask[:, :-1] & loss_mask[:, 1:]  # [B, S-1]
    if document_ids is None:
        doc = torch.zeros(candidate.shape, dtype=torch.long, device=device)
    else:
        candidate &= document_ids[:, :-1] == document_ids[:, 1:]
        doc = document_starts(document_ids)[:, :-1]  # a document is named by its start position
    # One draw per row, so a row's anchors do not depend on how rows are split into micro-batches.
    noise = torch.rand(batch, 2 * seq_len - 1, generator=generator, device=device)
    counts = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
    counts.scatter_add_(1, doc, candidate.long())
    quota = _max_min_fair_share(counts, max_anchors, noise[:, seq_len - 1 :])  # [B, S], per document start

    # Uniform sample without replacement per document: order candidates by (document, random key)
    # and keep the first quota[d] of each document. Non-candidates get key 2, after every candidate.
    keys = noise[:, : seq_len - 1].masked_fill(~candidate, 2.0)
    order = (doc.double() * 4 + keys.double()).argsort(dim=1)
    sorted_doc = doc.gather(1, order)
    columns = torch.arange(seq_len - 1, device=device)
    first_of_doc = torch.ones_like(sorted_doc, dtype=torch.bool)
    first_of_doc[:, 1:] = sorted_doc[:, 1:] != sorted_doc[:, :-1]
    rank_in_doc = columns - torch.where(first_of_doc, columns, 0).cummax(dim=1).values
    picked = candidate.gather(1, order) & (rank_in_doc < quota.gather(1, sorted_doc))

    # Sort the picked positions ascending and push the rest to the end (they sort after every position).
    k = min(max_anchors, seq_len - 1)
    order_key = torch.where(picked, order, seq_len).sort(dim=1).values[:, :k]
    valid = order_key < seq_len
    anchors = torch.where(valid, order_key, 0)
    if k < max_anchors:
        pad = max_anchors - k
        anchors = torch.nn.functional.pad(anchors, (0, pad), value=0)
        valid = torch.nn.functional.pad(valid, (0, pad), value=False)
    return anchors, valid


def _max_min_fair_share(counts: Tensor, budget: int, noise: Tensor) -> Tensor:
    """Integer max-min fair split of ``budget`` slots over documents with ``counts`` candidates.

    ``counts`` int64 ``[B, D]`` (0 for unused slots) -> quota int64 ``[B, D]``, see
    :func:`sample_anchors`; ``noise`` uniform ``[B, D]`` picks who gets the leftovers. The threshold
    t is found by a fixed-length binary search (no host sync).
    """
    lo = torch.zeros(counts.shape[0], dtype=torch.long, device=counts.device)
    hi = counts.amax(dim=1)
    for _ in range(int(counts.shape[1]).bit_length() + 1):  # hi <= D + 1 at the start
        mid = (lo + hi + 1) // 2
        fits = torch.minimum(counts, mid[:, None]).sum(dim=1) <= budget
        lo, hi = torch.where(fits, mid, lo), torch.where(fits, hi, mid - 1)
    base = torch.minimum(counts, lo[:, None])
    left = budget - base.sum(dim=1, keepdim=True)
    eligible = counts > lo[:, None]  # fewer of them than `left` only when every document is saturated
    keys = noise.masked_fill(~eligible, 2.0)
    rank = torch.empty_like(counts).scatter_(
        1, keys.argsort(dim=1), torch.arange(counts.shape[1], device=counts.device).expand_as(counts)
    )
    return base + (eligible & (rank < left)).long()


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


def draft_position_ids(anchors: Tensor, block_size: int, position_ids: Tensor | None = None) -> Tensor:
    """RoPE positions of the draft slots: slot k of the block anchored at a is at ``pos[a] + k``.

    Args:
        anchors (Tensor): int64 ``[B, N]``.
        block_size (int): Bs.
        position_ids (Tensor, optional): int64 ``[B, S]``, the context tokens' positions (restarting
            at 0 in each packed document); None means context token j sits at position j.

    Returns:
        Tensor: int64 ``[B, N * Bs]``: the positions the slots would have in their conversation run
        alone, continuing the anchor's.
    """
    start = anchors if position_ids is None else position_ids.gather(1, anchors)
    offsets = torch.arange(block_size, device=anchors.device)
    return (start[:, :, None] + offsets).flatten(1)


def previous_positions(anchors: Tensor, block_size: int, seq_len: int) -> Tensor:
    """int64 ``[B, N, Bs]``: position ``a + k - 1`` for slot k of the block anchored at a, the token
    (or the target's next-token distribution) before the slot; clamped to ``[0, seq_len)`` (slot 0,
    never predicted, and blocks past the row's end read a valid position that nothing uses)."""
    offsets = torch.arange(-1, block_size - 1, device=anchors.device)
    return (anchors[:, :, None] + offsets).clamp(0, seq_len - 1)


def build_labels(
    input_ids: Tensor,
    loss_mask: Tensor,
    anchors: Tensor,
    valid: Tensor,
    block_size: int,
    document_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Targets of every draft slot: slot k of block b predicts ``x[a_b + k]`` (no ``+1`` shift).

    Args:
        input_ids (Tensor): int64 ``[B, S]``.
        loss_mask (Tensor): bool ``[B, S]``.
        anchors (Tensor): int64 ``[B, N]``.
        valid (Tensor): bool ``[B, N]``.
        block_size (int): Bs.
        document_ids (Tensor, optional): int ``[B, S]``; None = one document per row.

    Returns:
        tuple[Tensor, Tensor]: ``labels`` int64 ``[B, N, Bs]`` and ``label_mask`` bool ``[B, N, Bs]``.
        ``label_mask`` is False for slot 0 (the anchor is given, not predicted), for padding blocks,
        for ``a_b + k >= S``, where ``loss_mask[a_b + k]`` is False and where ``a_b + k`` lies in
        another document than ``a_b`` (the next conversation of a packed row); ``labels`` is 0 there.
    """
    _check_anchors(anchors, valid, input_ids.shape[0])
    _check_documents(document_ids, input_ids.shape)
    batch, seq_len = input_ids.shape
    positions = (anchors[:, :, None] + torch.arange(block_size, device=anchors.device)).view(batch, -1)
    inside = (positions < seq_len).view(batch, -1, block_size)
    flat = positions.clamp(max=seq_len - 1)
    labels = torch.gather(input_ids, 1, flat).view_as(inside)
    supervised = torch.gather(loss_mask, 1, flat).view_as(inside)
    not_anchor = torch.arange(block_size, device=anchors.device) > 0
    label_mask = valid[:, :, None] & inside & supervised & not_anchor
    if document_ids is not None:
        starts = document_starts(document_ids)
        same_document = starts.gather(1, flat).view_as(inside) == starts.gather(1, anchors)[:, :, None]
        label_mask &= same_document
    return labels.masked_fill(~label_mask, 0), label_mask


def visible_context(anchors: Tensor, valid: Tensor, document_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The context positions each block sees: ``[start, end)`` with ``end = a_b`` and ``start`` the
    first position of the anchor's document (0 without documents); both 0 for padding blocks.

    Args:
        anchors (Tensor): int64 ``[B, N]``.
        valid (Tensor): bool ``[B, N]``.
        document_ids (Tensor, optional): int ``[B, S]``.

    Returns:
        tuple[Tensor, Tensor]: ``start``, ``end`` int64 ``[B, N]``. ``end - start`` context keys per
        block; :func:`visible_pairs` counts them for the FLOP estimate.
    """
    start = torch.zeros_like(anchors) if document_ids is None else document_starts(document_ids).gather(1, anchors)
    return torch.where(valid, start, 0), torch.where(valid, anchors, 0)


def visible_pairs(
    anchors: Tensor,
    valid: Tensor,
    block_size: int,
    document_ids: Tensor | None = None,
    sliding_window: int | None = None,
    *,
    causal: bool = False,
) -> Tensor:
    """Visible (query, key) pairs of the DFlash mask of one layer: over the valid blocks and their
    slots, the slot's context keys (``end_b - start_b``, fewer within a ``sliding_window``) plus
    the keys of its own block it sees (Bs; ``k + 1`` for slot k of a ``causal`` layer).

    Returns:
        Tensor: int64 scalar on ``anchors.device`` (no host sync), for attention FLOPs / MFU.
    """
    context_start, end = _slot_context(anchors, valid, block_size, document_ids, sliding_window)
    return (
        ((end - context_start).clamp(min=0) + _own_block_keys(block_size, causal, anchors.device)) * valid[:, :, None]
    ).sum()


def _own_block_keys(block_size: int, causal: bool, device) -> Tensor:
    """Keys of its own block each slot sees, int64 ``[Bs]``: all Bs, or ``k + 1`` for slot k when causal."""
    slots = torch.arange(block_size, device=device)
    return slots + 1 if causal else torch.full_like(slots, block_size)


def _slot_context(
    anchors: Tensor, valid: Tensor, block_size: int, document_ids: Tensor | None, sliding_window: int | None
) -> tuple[Tensor, Tensor]:
    """``[lo, end)`` context interval of every slot, int64 ``[B, N, Bs]`` each (empty when ``lo >= end``)."""
    start, end = visible_context(anchors, valid, document_ids)
    start, end = start[:, :, None].expand(-1, -1, block_size), end[:, :, None].expand(-1, -1, block_size)
    if sliding_window is not None:
        slots = torch.arange(block_size, device=anchors.device)
        start = torch.maximum(start, anchors[:, :, None] + slots - sliding_window + 1)
    return start, end


def dflash_mask_mod(
    anchors: Tensor,
    valid: Tensor,
    context_len: int,
    block_size: int,
    document_ids: Tensor | None = None,
    sliding_window: int | None = None,
    *,
    causal: bool = False,
) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """The DFlash ``mask_mod`` for flex_attention: True where query ``q`` may attend to key ``kv``.

    Query q is slot ``q % Bs`` of block ``b = q // Bs``. It sees context key ``kv < S`` iff
    ``start_b <= kv < anchors[batch, b]`` (strict: the anchor's own target hidden state is not yet
    known at inference; ``start_b`` is the first position of the anchor's document, 0 without
    documents), and draft key ``kv >= S`` iff it belongs to block b; nothing if ``valid[batch, b]``
    is False. With ``sliding_window`` W, slot k also needs ``kv > anchors[batch, b] + k - W``;
    with ``causal``, slot k sees slots ``0..k`` of its block only (module docstring). Elementwise
    with broadcasting, so it also evaluates on index grids (:func:`dense_attention_mask`).

    Args:
        anchors (Tensor): int64 ``[B, N]``.
        valid (Tensor): bool ``[B, N]``.
        context_len (int): S, the number of context keys before the draft blocks. A Python int:
            a new S is a new compiled graph, so pad sequences to a fixed length or a few buckets.
        block_size (int): Bs.
        document_ids (Tensor, optional): int ``[B, S]``; None = one document per row. Either way the
            mask_mod has the same structure (one compiled graph).
        sliding_window (int, optional): W of a sliding-window layer (``>= block_size``); None =
            full attention. A Python int, fixed for a run (a constant of the compiled graph).
        causal (bool): the block is seen causally (a constant of the compiled graph, fixed per
            layer type).

    Returns:
        Callable: ``mask_mod(batch, head, q_idx, kv_idx) -> bool Tensor``; ``head`` is ignored
        (the mask is shared by all heads, BlockMask ``H=None``).

    Raises:
        ValueError: ``sliding_window < block_size``.
    """
    _check_window(sliding_window, block_size)
    last_block = anchors.shape[1] - 1
    context_start, _ = visible_context(anchors, valid, document_ids)

    def mask_mod(batch: Tensor, head: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        # Clamp: flex may evaluate padded query rows of the last tile; never index past N.
        block = torch.clamp(q_idx // block_size, max=last_block)
        in_context = kv_idx < context_len
        anchor = anchors[batch, block]
        sees_context = in_context & (kv_idx < anchor) & (kv_idx >= context_start[batch, block])
        if sliding_window is not None:
            sees_context = sees_context & (kv_idx > anchor + q_idx % block_size - sliding_window)
        sees_own_block = ~in_context & ((kv_idx - context_len) // block_size == block)
        if causal:
            sees_own_block = sees_own_block & ((kv_idx - context_len) % block_size <= q_idx % block_size)
        return valid[batch, block] & (sees_context | sees_own_block)

    return mask_mod


def _check_window(sliding_window: int | None, block_size: int) -> None:
    if sliding_window is not None and sliding_window < block_size:
        raise ValueError(
            f"sliding_window {sliding_window} is smaller than block_size {block_size}: a draft token must see its "
            "whole block (engines disagree on the window's right bound there); use a window >= block_size"
        )


def dense_attention_mask(
    anchors: Tensor,
    valid: Tensor,
    context_len: int,
    block_size: int,
    document_ids: Tensor | None = None,
    sliding_window: int | None = None,
    *,
    causal: bool = False,
) -> Tensor:
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
    mask_mod = dflash_mask_mod(anchors, valid, context_len, block_size, document_ids, sliding_window, causal=causal)
    return _evaluate_on_grid(mask_mod, batch, q_len, context_len + q_len, anchors.device)


def build_block_mask(
    anchors: Tensor,
    valid: Tensor,
    context_len: int,
    block_size: int,
    document_ids: Tensor | None = None,
    sliding_window: int | None = None,
    *,
    causal: bool = False,
    tile: int | tuple[int, int] = DEFAULT_TILE,
) -> BlockMask:
    """The DFlash BlockMask (``H=None``), built from tile indices without a dense Q x KV grid.

    Choice: ``BlockMask.from_kv_blocks`` on tile tables computed in closed form from the anchors,
    rather than ``create_block_mask``. ``create_block_mask`` evaluates the ``mask_mod`` on every
    (q, kv) pair (B * N*Bs * (S + N*Bs) booleans, ~100 MB per sample at S=4k, N=512, Bs=16, unless
    compiled); the closed form (:func:`interval_block_mask`, each query row sees its slot's context
    interval ``[start_b, a_b)``, cut to the window with ``sliding_window``, and its own block, up to
    its own slot when ``causal``) costs
    O(B * N*Bs + B * #q-tiles * #kv-tiles) and has no compile step, so it runs on any device,
    outside the compiled training step. Tests check it equals ``create_block_mask`` tile for tile,
    with and without documents and windows.

    Args:
        anchors (Tensor): int64 ``[B, N]``, valid entries sorted ascending per row (sorting is
            what keeps the mask sparse; correctness does not depend on it).
        valid (Tensor): bool ``[B, N]``.
        context_len (int): S.
        block_size (int): Bs.
        document_ids (Tensor, optional): int ``[B, S]``; None = one document per row.
        sliding_window (int, optional): W of a sliding-window layer; None = full attention.
        causal (bool): slot k sees slots ``0..k`` of its block (module docstring).
        tile (int | tuple[int, int]): BlockMask tile (Q rows, KV columns); flex's default is 128.

    Returns:
        BlockMask: for ``Q_LEN = N * Bs`` and ``KV_LEN = S + N * Bs``, batch B, one head row
        (broadcast over heads), with :func:`dflash_mask_mod` attached.

    Raises:
        ValueError: ``sliding_window < block_size``, or malformed anchors / document ids.
    """
    _check_anchors(anchors, valid, anchors.shape[0])
    _check_documents(document_ids, (anchors.shape[0], context_len))
    mask_mod = dflash_mask_mod(anchors, valid, context_len, block_size, document_ids, sliding_window, causal=causal)
    batch, num_blocks = anchors.shape
    q_len = num_blocks * block_size
    block = torch.arange(q_len, device=anchors.device) // block_size
    row_valid = valid[:, block]  # [B, Q]
    start, end = _slot_context(anchors, valid, block_size, document_ids, sliding_window)
    own_start = torch.where(row_valid, context_len + block * block_size, 0)
    own_end = torch.where(
        row_valid, own_start + _own_block_keys(block_size, causal, anchors.device).repeat(num_blocks), 0
    )
    return interval_block_mask(
        [(start.reshape(batch, q_len), end.reshape(batch, q_len)), (own_start, own_end)],
        kv_len=context_len + q_len,
        mask_mod=mask_mod,
        tile=tile,
    )


def document_causal_mask(document_ids: Tensor, *, window: int | None = None) -> Tensor:
    """The frozen target's mask for packed rows: token q sees tokens ``start(q) <= kv <= q`` of its
    own document (causal within each conversation, nothing across), and with ``window`` only the
    last ``window`` of those (``q - kv < window``: a sliding-window layer, as transformers'
    ``sliding_window`` counts it).

    Padding (a run of -1 ids) is a document of its own, so its rows are never empty (SDPA kernels
    may return NaN for a query that sees nothing) and real tokens never see it.

    Args:
        document_ids (Tensor): int ``[B, S]``.
        window (int, optional): tokens a query sees, itself included; None: its whole document.

    Returns:
        Tensor: bool ``[B, 1, S, S]``, True = attend: the 4-D mask HF's "sdpa" backend takes as is.
        It costs ``B * S * S`` bytes (256 MiB at B=4, S=8192) and makes SDPA run its masked kernel
        over the whole S x S grid; :func:`document_causal_block_mask` skips the hidden tiles instead.
    """
    _check_documents(document_ids, document_ids.shape)
    batch, seq_len = document_ids.shape
    mask_mod = _document_causal_mask_mod(document_starts(document_ids), window)
    return _evaluate_on_grid(mask_mod, batch, seq_len, seq_len, document_ids.device)


def document_causal_block_mask(
    document_ids: Tensor, *, window: int | None = None, tile: int | tuple[int, int] = DEFAULT_TILE
) -> BlockMask:
    """:func:`document_causal_mask` as a BlockMask (``H=None``) for HF's "flex_attention" backend,
    built in closed form (one interval ``[max(start(q), q - window + 1), q]`` per query row, no
    dense grid). Tiles that cross documents (or lie behind the window) are skipped, so attention
    costs ~``sum_d len_d^2 / 2`` per row instead of ``S^2 / 2``.

    Args:
        document_ids (Tensor): int ``[B, S]``.
        window (int, optional): see :func:`document_causal_mask`.
        tile (int | tuple[int, int]): BlockMask tile (Q rows, KV columns).

    Returns:
        BlockMask: ``Q_LEN = KV_LEN = S``, batch B, one head row.
    """
    _check_documents(document_ids, document_ids.shape)
    starts = document_starts(document_ids)
    ends = torch.arange(1, document_ids.shape[1] + 1, device=document_ids.device).expand_as(starts)
    lows = starts if window is None else torch.maximum(starts, ends - window)
    return interval_block_mask(
        [(lows, ends)], kv_len=document_ids.shape[1], mask_mod=_document_causal_mask_mod(starts, window), tile=tile
    )


def _document_causal_mask_mod(starts: Tensor, window: int | None) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    last = starts.shape[1] - 1

    def mask_mod(batch: Tensor, head: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        # Clamp: flex may evaluate padded query rows of the last tile.
        return (kv_idx <= q_idx) & (kv_idx >= starts[batch, torch.clamp(q_idx, max=last)])

    def windowed_mask_mod(batch: Tensor, head: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return mask_mod(batch, head, q_idx, kv_idx) & (q_idx - kv_idx < window)

    return mask_mod if window is None else windowed_mask_mod


def _evaluate_on_grid(mask_mod: Callable, batch: int, q_len: int, kv_len: int, device: torch.device) -> Tensor:
    b = torch.arange(batch, device=device).view(batch, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    q = torch.arange(q_len, device=device).view(1, 1, q_len, 1)
    kv = torch.arange(kv_len, device=device).view(1, 1, 1, kv_len)
    return mask_mod(b, h, q, kv)


def interval_block_mask(
    intervals: Sequence[tuple[Tensor, Tensor]],
    *,
    kv_len: int,
    mask_mod: Callable,
    tile: int | tuple[int, int] = DEFAULT_TILE,
) -> BlockMask:
    """A BlockMask for masks where each query row sees a union of key intervals, in closed form.

    Query row r of batch b sees the keys ``[lo_i[b, r], hi_i[b, r])`` of every interval i (empty
    when ``lo >= hi``); ``mask_mod`` must say the same elementwise. A tile is *partial* (mask_mod
    applied) when some row of it sees some key of it, *full* (mask_mod skipped) when one interval of
    every row covers the whole tile. The intervals of a row must not touch (a tile covered only by
    two adjacent intervals together is marked partial, which is correct but slower; the DFlash
    context interval ends before S and the own-block interval starts at S or later). Tiles crossing
    the Q or KV end are never full, as in ``create_block_mask``.

    Cost: O(B * Q) to scatter each row's first/last kv tile into a per-tile difference table, plus
    O(B * #q-tiles * #kv-tiles); no Q x KV grid.

    Args:
        intervals: pairs ``(lo, hi)`` of int64 ``[B, Q]`` tensors.
        kv_len (int): KV_LEN.
        mask_mod (Callable): the elementwise mask attached to the BlockMask.
        tile (int | tuple[int, int]): BlockMask tile (Q rows, KV columns).

    Returns:
        BlockMask: ``Q_LEN = Q``, ``KV_LEN = kv_len``, batch B, one head row.
    """
    q_tile, kv_tile = (tile, tile) if isinstance(tile, int) else tile
    batch, q_len = intervals[0][0].shape
    device = intervals[0][0].device
    num_q_tiles, num_kv_tiles = -(-q_len // q_tile), -(-kv_len // kv_tile)
    kv_start = torch.arange(num_kv_tiles, device=device) * kv_tile
    kv_end = kv_start + kv_tile
    pad = num_q_tiles * q_tile - q_len  # padded query rows see nothing

    # Difference table over kv tiles: +1 at a row's first tile, -1 after its last; the running sum
    # counts rows of the q tile that touch each kv tile.
    touched = torch.zeros(batch, num_q_tiles, num_kv_tiles + 1, dtype=torch.int32, device=device)
    full = torch.zeros(batch, num_q_tiles, num_kv_tiles, dtype=torch.bool, device=device)
    for lo, hi in intervals:
        lo = torch.nn.functional.pad(lo, (0, pad)).view(batch, num_q_tiles, q_tile)
        hi = torch.nn.functional.pad(hi, (0, pad)).view(batch, num_q_tiles, q_tile)
        nonempty = (lo < hi).to(torch.int32)
        touched.scatter_add_(2, torch.where(lo < hi, lo // kv_tile, 0), nonempty)
        touched.scatter_add_(2, torch.where(lo < hi, (hi - 1) // kv_tile + 1, 0), -nonempty)
        # An empty row (lo >= hi) can never satisfy lo <= tile start < tile end <= hi.
        full |= (lo.amax(-1, keepdim=True) <= kv_start) & (hi.amin(-1, keepdim=True) >= kv_end)
    full &= kv_end <= kv_len
    partial = (touched.cumsum(-1)[..., :num_kv_tiles] > 0) & ~full
    return BlockMask.from_kv_blocks(
        *_to_indices(partial),
        *_to_indices(full),
        BLOCK_SIZE=(q_tile, kv_tile),
        mask_mod=mask_mod,
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


def _check_documents(document_ids: Tensor | None, shape) -> None:
    if document_ids is None:
        return
    if document_ids.dtype.is_floating_point or document_ids.dtype == torch.bool or document_ids.is_complex():
        raise ValueError(
            f"document_ids must be an integer tensor [B, S], got {document_ids.dtype}; use Batch.document_ids"
        )
    if tuple(document_ids.shape) != tuple(shape):
        raise ValueError(
            f"document_ids has shape {tuple(document_ids.shape)}, expected [B, S] = {tuple(shape)} "
            "(one id per context token)"
        )

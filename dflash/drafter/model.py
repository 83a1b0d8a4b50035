"""The DFlash drafter as the trainer and ``dflash eval`` use it (arXiv 2602.06036, Sec. 3).

The architecture, its config and the checkpoint layout live in :mod:`dflash.drafter.modeling_dflash`, the
self-contained file every checkpoint carries for ``trust_remote_code`` loading. This module adds
what training and evaluation need on top: the config built from a target's
(:func:`create_drafter_config`) and a model whose forward takes anchors (N draft blocks per
sequence) and builds the DFlash mask (``dflash.masks``). RoPE puts context token j at position
``p_j`` (j, or its position within its conversation in a packed row) and slot k of a block anchored
at a at ``p_a + k``; the mask decides visibility.

Shape legend: B batch, S context length, N blocks, Bs block size, Q = N*Bs draft tokens, K tapped
layers, H hidden size, V vocabulary.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

from dflash import masks
from dflash.config import TrainConfig, parse_layer_types
from dflash.drafter import modeling_dflash
from dflash.drafter.files import WEIGHTS_NAME, check_tensors, read_drafter_config
from dflash.drafter.hf_config import drafter_rope_parameters
from dflash.drafter.modeling_dflash import DFlashDraftConfig
from dflash.target_model.taps import default_target_layer_ids, max_captured_layers

logger = logging.getLogger(__name__)


def create_drafter_config(
    target_config: PretrainedConfig,
    num_draft_layers: int,
    *,
    block_size: int = modeling_dflash.DEFAULT_BLOCK_SIZE,
    num_captured_layers: int = modeling_dflash.DEFAULT_TAPS,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int,
    num_attention_heads: int | None = None,
    num_key_value_heads: int | None = None,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    is_causal: bool | None = None,
    arch: str = "dflash",
) -> DFlashDraftConfig:
    """Drafter config for a target (Qwen3, Llama, Qwen3.5/3.6 configs), in the target's geometry
    unless told otherwise.

    Copies hidden size, activation, max positions, RMSNorm eps and vocabulary size from
    ``target_config``, and attention/KV heads, head_dim and intermediate size where the arguments
    leave them None. RoPE is the target's type, base and scaling without its partial-rotary and
    M-RoPE fields (:func:`dflash.drafter.hf_config.drafter_rope_parameters`): the drafter rotates all of
    head_dim. ``dflash.run.drafter_shape`` chooses the arguments (the published shape for Qwen3.5/3.6).

    Args:
        target_config (PretrainedConfig): the target's (text) config.
        num_draft_layers (int): drafter decoder layers (``num_hidden_layers`` of the result).
        block_size (int): Bs (a config's default, :data:`~dflash.drafter.modeling_dflash.DEFAULT_BLOCK_SIZE`:
            the published drafters'; ``dflash train``'s rule picks its own, :mod:`dflash.run.drafter_shape`).
        num_captured_layers (int): layers to tap when ``target_layer_ids`` is None; clipped (with
            a warning) to what a small target allows, see :func:`max_captured_layers`.
        target_layer_ids (list[int], optional): explicit tapped layers, overriding the formula.
        mask_token_id (int): existing target vocabulary id for the mask slots (Qwen3: 151669,
            Qwen3.5/3.6: 248070).
        num_attention_heads, num_key_value_heads, head_dim, intermediate_size (int, optional):
            the drafter's attention and MLP geometry; None = the target's.
        layer_types (list[str], optional): ``full_attention`` / ``sliding_attention`` per drafter
            layer; None = all full attention.
        sliding_window (int, optional): window of the sliding layers in tokens (>= block_size).
        is_causal (bool, optional): causality within the draft block (:class:`DFlashDraftConfig`);
            None = the engines' rule for a config without it: sliding layers causal, full
            layers bidirectional; for DFlash2 False, as its published configs say.
        arch (str): ``"dflash"`` or ``"dflash2"`` (the conv and selector fields of
            :data:`dflash.drafter.modeling_dflash.DFLASH2_DEFAULTS`).

    Returns:
        DFlashDraftConfig

    Raises:
        ValueError: ``num_draft_layers < 1``, a window without sliding layers, no
            ``intermediate_size`` given for a target without one (mixture of experts), or an invalid
            field (see :class:`DFlashDraftConfig`).
    """
    if num_draft_layers < 1:
        raise ValueError(f"num_draft_layers must be >= 1, got {num_draft_layers}")
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    num_target_layers = text.num_hidden_layers
    if target_layer_ids is None:
        captured = min(num_captured_layers, max_captured_layers(num_target_layers))
        if captured != num_captured_layers:
            logger.warning(
                "target has %d layers: tapping %d layers instead of %d",
                num_target_layers,
                captured,
                num_captured_layers,
            )
        target_layer_ids = default_target_layer_ids(num_target_layers, captured)
    target_heads = text.num_attention_heads
    intermediate_size = intermediate_size or getattr(text, "intermediate_size", None)
    if intermediate_size is None:
        raise ValueError(
            f"intermediate_size: the target ({text.model_type}) has no single MLP width to copy (a mixture of "
            "experts?); give the drafter's (dflash train: --draft-intermediate-size)"
        )
    layer_types = list(layer_types or [modeling_dflash.FULL_ATTENTION] * num_draft_layers)
    sliding = modeling_dflash.SLIDING_ATTENTION in layer_types
    if sliding_window is not None and not sliding:
        raise ValueError(f"sliding_window {sliding_window}: no drafter layer is sliding_attention {layer_types}")
    if arch not in ("dflash", "dflash2"):
        raise ValueError(f"arch must be 'dflash' or 'dflash2', got {arch!r}")
    dflash_config = {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)}
    if arch == "dflash2":
        dflash_config |= modeling_dflash.DFLASH2_DEFAULTS
        is_causal = False if is_causal is None else is_causal
    return DFlashDraftConfig(
        hidden_size=text.hidden_size,
        num_attention_heads=num_attention_heads or target_heads,
        num_key_value_heads=num_key_value_heads or getattr(text, "num_key_value_heads", None) or target_heads,
        head_dim=head_dim or getattr(text, "head_dim", None) or text.hidden_size // target_heads,
        intermediate_size=intermediate_size,
        layer_types=layer_types,
        use_sliding_window=sliding,
        sliding_window=sliding_window if sliding else None,
        max_window_layers=num_draft_layers,
        hidden_act=getattr(text, "hidden_act", "silu"),
        rope_parameters=drafter_rope_parameters(text.to_dict()),
        max_position_embeddings=text.max_position_embeddings,
        rms_norm_eps=text.rms_norm_eps,
        vocab_size=text.vocab_size,
        num_hidden_layers=num_draft_layers,
        block_size=block_size,
        num_target_layers=num_target_layers,
        dflash_config=dflash_config,
        is_causal=is_causal,
        tie_word_embeddings=False,
        use_cache=False,
    )


def drafter_config(
    config: TrainConfig,
    target_config,
    *,
    target_layer_ids: list[int],
    mask_token_id: int,
    is_causal: bool | None = None,
):
    """The config of a new drafter of a resolved ``config`` (:func:`resolve_drafter_shape`) for a
    target (what ``dflash train`` builds without ``--init-from``).

    Args:
        config (TrainConfig): resolved.
        target_config (PretrainedConfig): the target's config (multimodal ones: the text config is used).
        target_layer_ids (list[int]): the layers the target taps.
        mask_token_id (int): the resolved mask token (:mod:`dflash.drafter.mask_token`).
        is_causal (bool, optional): causality within the draft block; None = the engines' rule for
            a config without it (sliding layers causal), the published drafters'.

    Returns:
        DFlashDraftConfig
    """
    return create_drafter_config(
        target_config,
        config.num_draft_layers,
        block_size=config.block_size,
        target_layer_ids=target_layer_ids,
        mask_token_id=mask_token_id,
        num_attention_heads=config.draft_heads,
        num_key_value_heads=config.draft_kv_heads,
        head_dim=config.draft_head_dim,
        intermediate_size=config.draft_intermediate_size,
        layer_types=parse_layer_types(config.draft_layer_types) if config.draft_layer_types else None,
        sliding_window=config.draft_sliding_window,
        is_causal=is_causal,
        arch=config.arch or "dflash",
    )


class AnchoredDrafter(modeling_dflash.DFlashDraftModel):
    """The DFlash drafter with the training forward (N anchored blocks) and the decoding step.

    Same modules, weights and config as :class:`dflash.drafter.modeling_dflash.DFlashDraftModel` (what
    ``trust_remote_code`` loads from a checkpoint, and what a saved ``config.json`` names); only
    :meth:`forward` differs: it takes block anchors and builds the DFlash mask. Pick the attention
    backend with transformers' usual switch: ``from_pretrained(..., attn_implementation=...)``,
    ``AnchoredDrafter._from_config(config, attn_implementation=...)`` or
    ``model.set_attn_implementation(...)``; one of
    :data:`dflash.drafter.modeling_dflash.SUPPORTED_ATTENTION`. Use "flex_attention" on GPU (BlockMask,
    compiles); "sdpa" on CPU (torch 2.13 has no CPU flex_attention backward). Both give the same result.

    Args:
        config (DFlashDraftConfig)
    """

    main_input_name = "draft_embeds"

    def save_pretrained(self, save_directory, **kwargs) -> None:
        """``PreTrainedModel.save_pretrained``, with ``architectures`` naming the served class
        (``DFlashDraftModel``, or ``DFlash2DraftModel``: what vLLM, SGLang and the drafter's
        ``auto_map`` load) rather than this subclass, whose name transformers writes."""
        super().save_pretrained(save_directory, **kwargs)
        self.config.architectures = [modeling_dflash.DFLASH2 if self.config.is_dflash2 else modeling_dflash.DFLASH]
        self.config.save_pretrained(save_directory)

    def build_attention_mask(
        self, anchors: Tensor, valid: Tensor, context_len: int, document_ids: Tensor | None = None
    ) -> dict:
        """The DFlash masks of this drafter's layer types, in the form the configured backend takes.

        Returns ``{layer type: mask}`` for each type in ``config.layer_types`` (sliding layers get
        their window, causal ones their causal block, :mod:`dflash.masks`): a
        :class:`~torch.nn.attention.flex_attention.BlockMask` for "flex_attention" (see
        :func:`dflash.masks.build_block_mask`) or a dense bool ``[B, 1, Q, S + Q]`` tensor for
        "sdpa". ``document_ids`` (int ``[B, S]``, packed rows) limits each block to its anchor's
        document. The trainer calls this outside its compiled step and passes the result to
        :meth:`forward`, so the compiled step sees one structure.
        """
        impl = self._attention_backend()
        build = masks.build_block_mask if impl == "flex_attention" else masks.dense_attention_mask
        config = self.config
        return {
            kind: build(
                anchors,
                valid,
                context_len,
                config.block_size,
                document_ids,
                config.window_of(kind),
                causal=config.layer_is_causal(kind),
            )
            for kind in dict.fromkeys(config.layer_types)
        }

    def attention_pairs(self, anchors: Tensor, valid: Tensor, document_ids: Tensor | None = None) -> Tensor:
        """Visible (query, key) pairs summed over the drafter's layers (each with its window and
        causality), for the FLOP estimate (:func:`dflash.masks.visible_pairs`); an int64 device
        scalar, no host sync."""
        config = self.config
        pairs = {
            kind: masks.visible_pairs(
                anchors,
                valid,
                config.block_size,
                document_ids,
                config.window_of(kind),
                causal=config.layer_is_causal(kind),
            )
            for kind in set(config.layer_types)
        }
        return sum(pairs[kind] for kind in self.config.layer_types)

    def forward(
        self,
        draft_embeds: Tensor,
        target_hidden: Tensor,
        anchors: Tensor,
        valid: Tensor | None = None,
        attention_mask=None,
        position_ids: Tensor | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """Drafter hidden states for N draft blocks of one training batch.

        Args:
            draft_embeds (Tensor): ``[B, N*Bs, H]``, the target's ``embed_tokens`` applied to
                :func:`dflash.masks.draft_input_ids` (floating dtype of the drafter); the drafter
                multiplies them by ``dflash_config.input_embedding_scale`` when the config sets one.
            target_hidden (Tensor): ``[B, S, K*H]``, the K tapped target layers concatenated on the
                feature axis in ``target_layer_ids`` order (HF ``hidden_states[k + 1]`` for id k).
            anchors (Tensor): int64 ``[B, N]`` block anchors (:func:`dflash.masks.sample_anchors`).
            valid (Tensor, optional): bool ``[B, N]``; None means all valid.
            attention_mask (dict, optional): from :meth:`build_attention_mask`; built here when
                None (keep it outside ``torch.compile`` by passing it in).
            position_ids (Tensor, optional): int64 ``[B, S]``, RoPE positions of the context tokens
                (packed rows restart at 0 in each document); slot k of the block anchored at a sits
                at ``position_ids[a] + k``. None: context token j at position j.
            document_ids (Tensor, optional): int ``[B, S]``, only read to build the mask when
                ``attention_mask`` is None (:mod:`dflash.masks`).

        Returns:
            Tensor: ``[B, N*Bs, H]`` after the final norm; apply the target's ``lm_head`` and the
            config's logit transform (:mod:`dflash.train.loss` does it chunked). Rows of padding
            blocks carry no attention.

        Raises:
            ValueError: on mismatched shapes or an unsupported attention backend.
        """
        batch, q_len, hidden_size = draft_embeds.shape
        bs = self.config.block_size
        if valid is None:
            valid = torch.ones_like(anchors, dtype=torch.bool)
        if anchors.shape != (batch, q_len // bs) or q_len % bs:
            raise ValueError(
                f"draft_embeds [B, N*Bs] = {tuple(draft_embeds.shape[:2])} does not match anchors "
                f"{tuple(anchors.shape)} with block_size {bs}"
            )
        if attention_mask is None:
            attention_mask = self.build_attention_mask(anchors, valid, target_hidden.shape[1], document_ids)
        positions = masks.draft_position_ids(anchors, bs, position_ids)
        query_valid = valid.repeat_interleave(bs, dim=1)[:, :, None]
        return self._run(draft_embeds, target_hidden, positions, attention_mask, query_valid, position_ids)

    @torch.no_grad()
    def draft_block(
        self, target_hidden: Tensor, block_embeds: Tensor, lm_head: nn.Module, anchor_ids: Tensor
    ) -> Tensor:
        """Greedy draft of one block for speculative decoding (``dflash eval``).

        See :meth:`block_hidden` for what the inputs mean; this takes the draft logits of slots
        1..Bs-1 (``lm_head`` and the config's logit transform, :meth:`compute_logits`) and their
        argmax (DFlash), or walks the candidate selector's path from the anchor over each slot's
        top-K tokens (DFlash2, :meth:`CandidateSelector.walk`).

        Args:
            target_hidden (Tensor): ``[B, S, K*H]`` tapped target states of positions 0..S-1.
            block_embeds (Tensor): ``[B, Bs, H]``, ``embed_tokens([last_token, MASK x (Bs-1)])``.
            lm_head (nn.Module): the target's frozen LM head, ``[.., H] -> [.., V]``.
            anchor_ids (Tensor): int64 ``[B]``, ``last_token`` (what the DFlash2 path starts from).

        Returns:
            Tensor: int64 ``[B, Bs-1]``, the drafted tokens for positions S+1..S+Bs-1.
        """
        hidden = self.block_hidden(target_hidden, block_embeds)[:, 1:]
        logits = self.compute_logits(hidden, lm_head)
        if self.config.is_dflash2:
            return self.candidate_selector.walk(hidden, logits, anchor_ids)
        return logits.argmax(dim=-1)

    def block_hidden(self, target_hidden: Tensor, block_embeds: Tensor) -> Tensor:
        """Drafter hidden states of one block drafted after the whole context (inference form).

        The context is the whole verified prefix: ``target_hidden`` holds positions 0..S-1, i.e.
        every accepted token except the last one (whose target hidden state the verifier has not
        computed yet). That last accepted token is slot 0 of the block, at position S (the anchor),
        followed by Bs-1 mask tokens; all context is visible (``kv < S``). This is exactly what
        :meth:`forward` computes for a block anchored at S, so training and inference agree
        (``tests/unit/test_drafter_model.py`` checks it); sliding layers see the window before each slot
        and causal layers the block up to each slot, as in training. No KV cache: the context
        keys/values are recomputed on every call, O(S * layers) per step, acceptable for small
        drafters and short prompts.

        Args:
            target_hidden (Tensor): ``[B, S, K*H]`` tapped target states of positions 0..S-1.
            block_embeds (Tensor): ``[B, Bs, H]``, ``embed_tokens([last_token, MASK x (Bs-1)])``
                (scaled here by ``dflash_config.input_embedding_scale``, as in :meth:`forward`).

        Returns:
            Tensor: ``[B, Bs, H]`` after the final norm.

        Raises:
            ValueError: the block does not have ``block_size`` slots, or a feature-size mismatch.
        """
        batch, bs, _ = block_embeds.shape
        if bs != self.config.block_size:
            raise ValueError(f"block_embeds has {bs} slots, the drafter's block_size is {self.config.block_size}")
        context_len = target_hidden.shape[1]
        positions = torch.arange(context_len, context_len + bs, device=block_embeds.device).expand(batch, bs)
        # attention_mask=None: every draft slot sees all context (its window on sliding layers) and its
        # block (up to itself on causal layers).
        return self._run(block_embeds, target_hidden, positions, None, None)

    def _run(
        self, draft_embeds, target_hidden, positions, attention_mask, query_valid, context_positions=None
    ) -> Tensor:
        """Layers over ``draft_embeds`` [B, Q, H] (times the config's ``input_embedding_scale``) at
        RoPE ``positions`` [B, Q], attending to the fused ``target_hidden`` [B, S, K*H] at
        ``context_positions`` [B, S] (None: 0..S-1)."""
        scale = self.config.noise_embedding_scale
        if scale != 1.0:
            draft_embeds = draft_embeds * scale
        batch, context_len, _ = target_hidden.shape
        if context_positions is None:
            context_positions = torch.arange(context_len, device=positions.device).expand(batch, context_len)
        kv_positions = torch.cat([context_positions, positions], dim=1)
        return super().forward(draft_embeds, target_hidden, kv_positions, attention_mask, query_valid)


def architecture_name(config: DFlashDraftConfig) -> str:
    """``DFlash``, or ``DFlash2 (convolutions of k taps, selector top K)``, for the logs."""
    if not config.is_dflash2:
        return "DFlash"
    taps, top_k = config.dflash2_value("conv_kernel_size"), config.dflash2_value("selector_top_k")
    return f"DFlash2 (convolutions of {taps} taps, selector top {top_k})"


def load_drafter_dir(
    directory: str | Path, *, dtype: torch.dtype, device: torch.device | str = "cpu", attn_implementation: str = "sdpa"
):
    """The drafter of a directory, every weight loaded strictly (module docstring), as the
    trainer's :class:`AnchoredDrafter`.

    Args:
        directory: holds ``config.json`` and ``model.safetensors``.
        dtype (torch.dtype): of the parameters (the file's dtype is converted).
        device: where the model ends up.
        attn_implementation (str): "sdpa" or "flex_attention".

    Returns:
        AnchoredDrafter: in train mode (call ``.eval()`` to decode).

    Raises:
        CheckpointError: see :func:`read_drafter_config` and :func:`check_tensors`.
    """
    from safetensors.torch import load_file

    config = read_drafter_config(directory)
    check_tensors(directory, config)
    model = AnchoredDrafter._from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    model.load_state_dict(load_file(str(Path(directory) / WEIGHTS_NAME)), strict=True)
    return model.to(device)

"""The DFlash drafter as a transformers model (arXiv 2602.06036, Sec. 3; z-lab/dflash ``model.py``).

The drafter is a stack of Qwen3-style decoder layers with no embedding and no LM head of its own: it
embeds its draft blocks with the target's frozen ``embed_tokens`` and reads them out with the target's
frozen ``lm_head``. It is conditioned on K hidden states tapped from the target (``target_layer_ids``):
they are concatenated on the feature axis and fused once, ``hidden_norm(fc(x))``, into one context
sequence that every layer attends to. Queries come only from draft-block tokens; keys/values are the
same ``k_proj``/``v_proj`` over ``[context ; draft blocks]`` with ``k_norm`` on both; RoPE puts context
token j at position j and slot k of a block anchored at a at ``a + k``; the attention is non-causal and
the DFlash mask (``dflash.masks``) decides visibility.

Checkpoints use the z-lab layout that vLLM and SGLang load: a Qwen3 ``config.json`` (``model_type``
``qwen3``) plus ``architectures=["DFlashDraftModel"]``, top-level ``block_size`` and
``num_target_layers``, ``dflash_config={"mask_token_id", "target_layer_ids"}``; weights ``fc.weight``,
``hidden_norm.weight``, ``norm.weight`` and ``layers.{i}.…`` with no ``model.`` prefix.

Shape legend: B batch, S context length, N blocks, Bs block size, Q = N*Bs draft tokens, K tapped
layers, H hidden size, V vocabulary.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from huggingface_hub.dataclasses import strict
from torch import Tensor, nn
from transformers import PretrainedConfig, PreTrainedModel, Qwen3Config
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)

from dflash import masks
from dflash.layer_taps import default_target_layer_ids, max_captured_layers

logger = logging.getLogger(__name__)

#: Attention backends the drafter supports (keys of transformers' ``ALL_ATTENTION_FUNCTIONS``).
#: "flex_attention" takes a BlockMask (GPU training); "sdpa" a dense bool mask (CPU, small cases).
SUPPORTED_ATTENTION = ("flex_attention", "sdpa")

#: Mask token of Qwen3 tokenizers (an existing, untrained embedding row); the config default.
QWEN3_MASK_TOKEN_ID = 151669


@strict
class DFlashDraftConfig(Qwen3Config):
    r"""Config of a DFlash drafter: a Qwen3 config plus the DFlash fields vLLM/SGLang read.

    ``model_type`` stays ``"qwen3"`` (what z-lab checkpoints and vLLM's ``qwen3_dflash`` expect);
    ``num_hidden_layers`` is the number of *drafter* layers.

    Args:
        block_size (int): Bs, tokens per draft block (anchor + Bs-1 predictions); >= 2.
        num_target_layers (int): L, decoder layers of the target model.
        dflash_config (dict): ``{"mask_token_id": int, "target_layer_ids": list[int]}``; the mask
            token must be a row of the target embedding (``< vocab_size``), the ids in ``[0, L)``,
            distinct. None gives the Qwen3 defaults (mask 151669, the default ids for L).
        **kwargs: Qwen3Config fields (hidden_size, num_attention_heads, rope_parameters, ...).

    Raises:
        ValueError: naming the field that is out of range.
    """

    block_size: int = 16
    num_target_layers: int = 36
    dflash_config: dict | None = None

    def __post_init__(self, **kwargs):
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (anchor + predictions), got {self.block_size}")
        if self.num_target_layers < 1:
            raise ValueError(f"num_target_layers must be >= 1, got {self.num_target_layers}")
        if self.dflash_config is None:
            captured = min(5, max_captured_layers(self.num_target_layers))
            self.dflash_config = {
                "mask_token_id": QWEN3_MASK_TOKEN_ID,
                "target_layer_ids": default_target_layer_ids(self.num_target_layers, captured),
            }
        self._validate_dflash_config()
        if kwargs.get("architectures") is None and getattr(self, "architectures", None) is None:
            kwargs["architectures"] = ["DFlashDraftModel"]
        super().__post_init__(**kwargs)

    def _validate_dflash_config(self) -> None:
        missing = {"mask_token_id", "target_layer_ids"} - set(self.dflash_config)
        if missing:
            raise ValueError(f"dflash_config is missing {sorted(missing)}")
        mask_token_id = self.dflash_config["mask_token_id"]
        if not isinstance(mask_token_id, int) or not 0 <= mask_token_id < self.vocab_size:
            raise ValueError(
                f"dflash_config.mask_token_id must be an int in [0, vocab_size={self.vocab_size}), got "
                f"{mask_token_id!r}; use an existing token of the target vocabulary"
            )
        ids = self.dflash_config["target_layer_ids"]
        if (
            not isinstance(ids, list)
            or not ids
            or not all(isinstance(i, int) and 0 <= i < self.num_target_layers for i in ids)
            or len(set(ids)) != len(ids)
        ):
            raise ValueError(
                "dflash_config.target_layer_ids must be a non-empty list of distinct ints in "
                f"[0, num_target_layers={self.num_target_layers}), got {ids!r}"
            )

    @property
    def mask_token_id(self) -> int:
        """Token id that fills draft slots 1..Bs-1."""
        return self.dflash_config["mask_token_id"]

    @property
    def target_layer_ids(self) -> list[int]:
        """Tapped target layers: id k is HF ``hidden_states[k + 1]``."""
        return list(self.dflash_config["target_layer_ids"])


def create_drafter_config(
    target_config: PretrainedConfig,
    num_draft_layers: int,
    *,
    block_size: int = 16,
    num_captured_layers: int = 5,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int,
) -> DFlashDraftConfig:
    """Drafter config sized like the target (works for Qwen3 and Llama target configs).

    Copies hidden size, attention/KV heads, head_dim, intermediate size, activation, RoPE
    parameters, max positions, RMSNorm eps and vocabulary size from ``target_config``.

    Args:
        target_config (PretrainedConfig): the target's (text) config.
        num_draft_layers (int): drafter decoder layers (``num_hidden_layers`` of the result).
        block_size (int): Bs (16 in published drafters).
        num_captured_layers (int): layers to tap when ``target_layer_ids`` is None; clipped (with
            a warning) to what a small target allows, see :func:`max_captured_layers`.
        target_layer_ids (list[int], optional): explicit tapped layers, overriding the formula.
        mask_token_id (int): existing target vocabulary id for the mask slots (Qwen3: 151669,
            Qwen3.5/3.6: 248070).

    Returns:
        DFlashDraftConfig

    Raises:
        ValueError: ``num_draft_layers < 1`` or an invalid field (see :class:`DFlashDraftConfig`).
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
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return DFlashDraftConfig(
        hidden_size=text.hidden_size,
        num_attention_heads=heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        intermediate_size=text.intermediate_size,
        hidden_act=getattr(text, "hidden_act", "silu"),
        rope_parameters=dict(text.rope_parameters),
        max_position_embeddings=text.max_position_embeddings,
        rms_norm_eps=text.rms_norm_eps,
        vocab_size=text.vocab_size,
        num_hidden_layers=num_draft_layers,
        block_size=block_size,
        num_target_layers=num_target_layers,
        dflash_config={"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)},
        tie_word_embeddings=False,
        use_cache=False,
    )


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on ``x`` [B, heads, T, D] with ``cos``/``sin`` [B, T, D]."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + rotate_half(x) * sin


class DFlashAttention(nn.Module):
    """Queries from the draft tokens, keys/values over ``[context ; draft tokens]``, non-causal, GQA."""

    def __init__(self, config: DFlashDraftConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        # Read by transformers' sdpa_attention_forward: never add a causal mask of its own.
        self.is_causal = False
        hidden, q_dim, kv_dim = (
            config.hidden_size,
            config.num_attention_heads * self.head_dim,
            (config.num_key_value_heads * self.head_dim),
        )
        self.q_proj = nn.Linear(hidden, q_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(hidden, kv_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(hidden, kv_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_dim, hidden, bias=config.attention_bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden: Tensor,
        context: Tensor,
        rope_q: tuple[Tensor, Tensor],
        rope_kv: tuple[Tensor, Tensor],
        attention_mask,
    ) -> Tensor:
        """``hidden`` [B, Q, H] (normed), ``context`` [B, S, H] -> attention output [B, Q, H]."""
        batch, q_len, _ = hidden.shape
        kv_input = torch.cat([context, hidden], dim=1)
        q = self.q_norm(self.q_proj(hidden).view(batch, q_len, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_input).view(batch, kv_input.shape[1], -1, self.head_dim))
        v = self.v_proj(kv_input).view(batch, kv_input.shape[1], -1, self.head_dim)
        q = _rope(q, *rope_q)
        k = _rope(k.transpose(1, 2), *rope_kv)
        # DFlashDraftModel._run has already rejected backends outside SUPPORTED_ATTENTION.
        attention: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, None)
        out, _ = attention(self, q, k, v.transpose(1, 2), attention_mask, dropout=0.0, scaling=self.scaling)
        return self.o_proj(out.reshape(batch, q_len, -1))


class DFlashDecoderLayer(nn.Module):
    """Pre-norm Qwen3 block whose attention also reads the shared context features."""

    def __init__(self, config: DFlashDraftConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden, context, rope_q, rope_kv, attention_mask, query_valid) -> Tensor:
        attn = self.self_attn(self.input_layernorm(hidden), context, rope_q, rope_kv, attention_mask)
        if query_valid is not None:
            # Padding blocks see no key: flex and CPU SDPA return 0 there, but some GPU SDPA
            # kernels return NaN for an all-masked row, so zero them explicitly.
            attn = torch.where(query_valid, attn, 0.0)
        hidden = hidden + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DFlashDraftModel(PreTrainedModel):
    """The DFlash drafter (weights in the z-lab layout, see the module docstring).

    Pick the attention backend with transformers' usual switch: ``config._attn_implementation``,
    ``from_pretrained(..., attn_implementation=...)``, ``DFlashDraftModel._from_config(config,
    attn_implementation=...)`` or ``model.set_attn_implementation(...)``; one of
    :data:`SUPPORTED_ATTENTION`. Use "flex_attention" on GPU (BlockMask, compiles); "sdpa" on CPU
    (torch 2.13 has no CPU flex_attention backward). Both give the same result.

    Args:
        config (DFlashDraftConfig)
    """

    config_class = DFlashDraftConfig
    base_model_prefix = ""
    main_input_name = "draft_embeds"
    _no_split_modules = ["DFlashDecoderLayer"]
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True

    def __init__(self, config: DFlashDraftConfig):
        super().__init__(config)
        num_tapped = len(config.target_layer_ids)
        self.fc = nn.Linear(num_tapped * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.post_init()

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def build_attention_mask(self, anchors: Tensor, valid: Tensor, context_len: int):
        """The DFlash mask in the form the configured backend takes.

        Returns a :class:`~torch.nn.attention.flex_attention.BlockMask` for "flex_attention" (see
        :func:`dflash.masks.build_block_mask`) or a dense bool ``[B, 1, Q, S + Q]`` tensor for "sdpa".
        The trainer calls this outside its compiled step and passes the result to :meth:`forward`.
        """
        impl = self._attention_backend()
        if impl == "flex_attention":
            return masks.build_block_mask(anchors, valid, context_len, self.config.block_size)
        return masks.dense_attention_mask(anchors, valid, context_len, self.config.block_size)

    def forward(
        self,
        draft_embeds: Tensor,
        target_hidden: Tensor,
        anchors: Tensor,
        valid: Tensor | None = None,
        attention_mask=None,
    ) -> Tensor:
        """Drafter hidden states for N draft blocks of one training batch.

        Args:
            draft_embeds (Tensor): ``[B, N*Bs, H]``, the target's ``embed_tokens`` applied to
                :func:`dflash.masks.draft_input_ids` (floating dtype of the drafter).
            target_hidden (Tensor): ``[B, S, K*H]``, the K tapped target layers concatenated on the
                feature axis in ``target_layer_ids`` order (HF ``hidden_states[k + 1]`` for id k).
            anchors (Tensor): int64 ``[B, N]`` block anchors (:func:`dflash.masks.sample_anchors`).
            valid (Tensor, optional): bool ``[B, N]``; None means all valid.
            attention_mask (BlockMask | Tensor, optional): from :meth:`build_attention_mask`; built
                here when None (keep it outside ``torch.compile`` by passing it in).

        Returns:
            Tensor: ``[B, N*Bs, H]`` after the final norm; apply the target's ``lm_head``
            (:mod:`dflash.loss` does it chunked). Rows of padding blocks carry no attention.

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
            attention_mask = self.build_attention_mask(anchors, valid, target_hidden.shape[1])
        positions = masks.draft_position_ids(anchors, bs)
        query_valid = valid.repeat_interleave(bs, dim=1)[:, :, None]
        return self._run(draft_embeds, target_hidden, positions, attention_mask, query_valid)

    @torch.no_grad()
    def draft_block(self, target_hidden: Tensor, block_embeds: Tensor, lm_head: nn.Module) -> Tensor:
        """Greedy draft of one block for speculative decoding (``dflash eval``).

        See :meth:`block_hidden` for what the inputs mean; this applies ``lm_head`` to slots
        1..Bs-1 and takes the argmax.

        Args:
            target_hidden (Tensor): ``[B, S, K*H]`` tapped target states of positions 0..S-1.
            block_embeds (Tensor): ``[B, Bs, H]``, ``embed_tokens([last_token, MASK x (Bs-1)])``.
            lm_head (nn.Module): the target's frozen LM head, ``[.., H] -> [.., V]``.

        Returns:
            Tensor: int64 ``[B, Bs-1]``, argmax tokens for positions S+1..S+Bs-1.
        """
        return lm_head(self.block_hidden(target_hidden, block_embeds)[:, 1:]).argmax(dim=-1)

    def block_hidden(self, target_hidden: Tensor, block_embeds: Tensor) -> Tensor:
        """Drafter hidden states of one block drafted after the whole context (inference form).

        The context is the whole verified prefix: ``target_hidden`` holds positions 0..S-1, i.e.
        every accepted token except the last one (whose target hidden state the verifier has not
        computed yet). That last accepted token is slot 0 of the block, at position S (the anchor),
        followed by Bs-1 mask tokens; all context is visible (``kv < S``). This is exactly what
        :meth:`forward` computes for a block anchored at S, so training and inference agree
        (``tests/test_model.py`` checks it). No KV cache: the context keys/values are recomputed
        on every call, O(S * layers) per step, acceptable for small drafters and short prompts.

        Args:
            target_hidden (Tensor): ``[B, S, K*H]`` tapped target states of positions 0..S-1.
            block_embeds (Tensor): ``[B, Bs, H]``, ``embed_tokens([last_token, MASK x (Bs-1)])``.

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
        # attention_mask=None: every draft slot sees all context and its block (full attention).
        return self._run(block_embeds, target_hidden, positions, None, None)

    def _run(self, draft_embeds, target_hidden, positions, attention_mask, query_valid) -> Tensor:
        self._attention_backend()
        batch, context_len, width = target_hidden.shape
        expected = len(self.config.target_layer_ids) * self.config.hidden_size
        if width != expected:
            raise ValueError(
                f"target_hidden has {width} features, expected K*H = {expected} "
                f"({len(self.config.target_layer_ids)} tapped layers x hidden {self.config.hidden_size})"
            )
        context = self.hidden_norm(self.fc(target_hidden))
        context_positions = torch.arange(context_len, device=positions.device).expand(batch, context_len)
        kv_positions = torch.cat([context_positions, positions], dim=1)
        cos, sin = self.rotary_emb(draft_embeds, kv_positions)
        rope_kv = (cos, sin)
        rope_q = (cos[:, context_len:], sin[:, context_len:])
        hidden = draft_embeds
        for layer in self.layers:
            hidden = layer(hidden, context, rope_q, rope_kv, attention_mask, query_valid)
        return self.norm(hidden)

    def _attention_backend(self) -> str:
        impl = self.config._attn_implementation
        if impl not in SUPPORTED_ATTENTION:
            raise ValueError(
                f"attention backend {impl!r} is not supported by the DFlash drafter; use one of "
                f"{SUPPORTED_ATTENTION} (set attn_implementation=...)"
            )
        return impl

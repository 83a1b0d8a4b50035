"""The DFlash drafter as a self-contained transformers model (arXiv 2602.06036, Sec. 3).

Every checkpoint ``dflash train`` writes carries a verbatim copy of this file as
``modeling_dflash.py`` and an ``auto_map`` naming its classes, so the loading path z-lab's README
shows builds this drafter and loads every weight::

    AutoModel.from_pretrained(checkpoint, trust_remote_code=True)   # or AutoModelForCausalLM

The file therefore imports only torch and transformers, and runs unchanged under transformers
4.57 (the version z-lab/dflash pins) and 5.x. The project's training model
(``dflash.drafter.model.AnchoredDrafter``) subclasses the classes here, so the served copy and the
trained model share one implementation.

The drafter is a stack of Qwen3-style decoder layers with no embedding and no LM head of its own:
it embeds its draft blocks with the target's frozen ``embed_tokens`` and reads them out with the
target's frozen ``lm_head``. It is conditioned on K hidden states tapped from the target
(``target_layer_ids``; id k is HF ``hidden_states[k + 1]``): they are concatenated on the feature
axis and fused once, ``hidden_norm(fc(x))``, into one context sequence every layer attends to.
Queries come only from draft-block tokens; keys/values are the same ``k_proj``/``v_proj`` over
``[context ; draft tokens]`` with ``k_norm`` on both; RoPE (neox style, ``rotate_half``) on Q and
K; GQA (z-lab/dflash ``model.py``; vLLM ``qwen3_dflash.py``).

Layers are ``full_attention`` or ``sliding_attention`` (``layer_types``, as the published
Qwen3.5/3.6 drafters: 4 sliding layers with ``sliding_window`` 2048, then 1 full). A sliding layer
limits what a draft token at position p sees to the ``sliding_window`` positions ending at p: keys
at positions ``> p - sliding_window`` (flash-attention's left bound in transformers, z-lab/dflash
and SGLang). The window is at least ``block_size``, so a draft token always sees its block
(engines disagree on a right bound, which then never bites).

Causality within the draft block follows vLLM main (``qwen3_dflash.py::_dflash_layer_causal``),
read from the config: a top-level ``is_causal`` true or false makes every layer causal or
bidirectional; without it ``dflash_config.causal`` does the same; without either (the published
configs) sliding layers are causal (a draft token sees the slots of its block up to its own) and
full-attention layers bidirectional, the default SGLang (PR #34524), TensorRT-LLM (PR #16914) and
z-lab/dflash's newer ``model.py`` share. See :meth:`DFlashDraftConfig.layer_is_causal`.

Checkpoint layout (what vLLM and SGLang load): a Qwen3 ``config.json`` (``model_type`` ``qwen3``)
plus ``architectures=["DFlashDraftModel"]``, top-level ``block_size`` and ``num_target_layers``,
``dflash_config={"mask_token_id", "target_layer_ids"}``; weights ``fc.weight``,
``hidden_norm.weight``, ``norm.weight`` and ``layers.{i}.…`` with no ``model.`` prefix.

DFlash2 ("DFlash 2: Keep Drafting Parallel", z-lab / Inco AI; the inference contract is z-lab/dflash
``dflash/model.py`` at commit 07ebd93, which vLLM PR #52816 and SGLang PR #35371 serve) is the same
drafter plus two things, switched on by four ``dflash_config`` fields and
``architectures=["DFlash2DraftModel"]``:

- around each layer's attention and MLP, a grouped dynamic causal convolution over the draft block
  (:class:`GroupedDynamicConv`: ``conv_kernel_size`` taps, one dynamic coefficient per
  ``conv_group_size`` channels), on the sublayer's input and again on its output; the context is
  never convolved and a block never reads another block;
- a candidate selector (:class:`CandidateSelector`, rank ``selector_rank``): each slot's
  ``selector_top_k`` most likely tokens by the LM head, re-scored with a low-rank predecessor ->
  candidate transition, and a path walked from the anchor, one slot after the other.

Its weights add ``layers.{i}.attention_conv.{base_kernel,kernel_projection.weight}``, the same for
``mlp_conv``, and ``candidate_selector.{hidden_projection.weight,predecessor_codebook,
successor_codebook}`` (the codebooks as bare tensors, as the published checkpoints store them).

A DFlash2 ``dflash_config`` may also set three transforms (z-lab/dflash 07ebd93; its test fixture
``tests/fixtures/dflash2-config.json`` sets the first two): ``output_multiplier`` m and
``final_logit_softcapping`` c shape the draft logits, ``c * tanh(m * z / c)`` (:class:`LogitTransform`),
which the selector's candidates and unary scores are taken from; ``input_embedding_scale`` multiplies
the draft block's embeddings (anchor and mask tokens; the context is hidden states, never embedded).

Shape legend: B batch, S context length, Q draft tokens, K tapped layers, H hidden size, V
vocabulary, k conv taps, G = H / conv_group_size coefficient groups, r selector rank.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel, Qwen3Config
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

#: Attention backends the drafter supports (keys of transformers' ``ALL_ATTENTION_FUNCTIONS``).
#: "flex_attention" takes a BlockMask (GPU training); "sdpa" a dense bool mask or None.
SUPPORTED_ATTENTION = ("flex_attention", "sdpa")

#: Attention kinds of drafter layers (``config.layer_types`` entries).
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)

#: Block size and tapped layers of a config that does not say (z-lab/dflash's defaults, the published drafters').
DEFAULT_BLOCK_SIZE, DEFAULT_TAPS = 16, 5

#: Mask token of Qwen3 tokenizers (the first embedding row past the tokenizer); the config default.
QWEN3_MASK_TOKEN_ID = 151669

#: ``config.json`` architectures of the two drafters.
DFLASH, DFLASH2 = "DFlashDraftModel", "DFlash2DraftModel"
#: The ``dflash_config`` fields of DFlash2 and the published drafters' values (z-lab/Qwen3.8-27B-DFlash2).
DFLASH2_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
DFLASH2_FIELDS = tuple(DFLASH2_DEFAULTS)
#: DFlash2's optional ``dflash_config`` transforms (module docstring) and their identity values
#: (``final_logit_softcapping`` 0 or null: no cap, as z-lab, vLLM and SGLang read it).
TRANSFORM_IDENTITY = {"output_multiplier": 1.0, "final_logit_softcapping": None, "input_embedding_scale": 1.0}

# transformers 4.x configs take the RoPE base as ``rope_theta`` (+ ``rope_scaling``) and ignore a
# ``rope_parameters`` argument; 5.x takes ``rope_parameters`` and converts the 4.x keywords.
_TAKES_LEGACY_ROPE = "rope_theta" in inspect.signature(Qwen3Config.__init__).parameters


def legacy_rope(rope_parameters: dict) -> tuple[float, dict | None]:
    """Split a transformers 5 ``rope_parameters`` dict into the 4.x ``(rope_theta, rope_scaling)``.

    ``rope_scaling`` is None for plain RoPE (``rope_type`` "default"), else every entry but
    ``rope_theta`` (4.x validates scaling dicts and rejects unknown keys).
    """
    scaling = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
    if scaling.get("rope_type", "default") == "default" and set(scaling) <= {"rope_type"}:
        scaling = None
    return float(rope_parameters["rope_theta"]), scaling


def default_target_layer_ids(num_target_layers: int, num_captured: int) -> list[int]:
    """Target layers to tap, by the public DFlash formula (z-lab/dflash, SpecForge).

    ``num_captured == 1`` gives ``[L // 2]``; otherwise ``round(1 + i * (L - 4) / (N - 1))`` for
    i in 0..N-1. Layer id k is the *output* of decoder layer k, i.e. HF
    ``output.hidden_states[k + 1]``.

    This file travels alone in every checkpoint and imports nothing of dflash, so it carries this
    formula itself; :func:`dflash.layer_taps.default_target_layer_ids` is the trainer's (with
    errors in terms of the CLI flags), and a test checks the two agree.

    Args:
        num_target_layers (int): L, decoder layers of the target.
        num_captured (int): N, layers to tap.

    Returns:
        list[int]: N sorted layer ids, e.g. L=36, N=5 -> [1, 9, 17, 25, 33]; L=64, N=5 ->
        [1, 16, 31, 46, 61].

    Raises:
        ValueError: L < 1, N < 1, or N > 1 with fewer than N + 3 target layers (the formula would
        repeat ids); see :func:`max_captured_layers`.
    """
    if num_target_layers < 1 or num_captured < 1:
        raise ValueError(f"num_target_layers and num_captured must be >= 1, got {num_target_layers}, {num_captured}")
    if num_captured == 1:
        return [num_target_layers // 2]
    if num_captured > max_captured_layers(num_target_layers):
        raise ValueError(
            f"cannot tap {num_captured} distinct layers of a {num_target_layers}-layer target with the "
            f"default formula; use num_captured <= {max_captured_layers(num_target_layers)} or pass "
            "target_layer_ids explicitly"
        )
    span = num_target_layers - 4
    return [round(1 + i * span / (num_captured - 1)) for i in range(num_captured)]


def max_captured_layers(num_target_layers: int) -> int:
    """Largest N for which :func:`default_target_layer_ids` gives distinct ids (1 for L < 5)."""
    return max(1, num_target_layers - 3)


class DFlashDraftConfig(Qwen3Config):
    r"""Config of a DFlash drafter: a Qwen3 config plus the DFlash fields vLLM/SGLang read.

    ``model_type`` stays ``"qwen3"`` (what z-lab checkpoints and vLLM's ``qwen3_dflash`` expect);
    ``num_hidden_layers`` is the number of *drafter* layers. RoPE may be given in either
    transformers form (``rope_parameters``, or ``rope_theta`` + ``rope_scaling``); it is stored in
    the installed version's form, so the base is never silently dropped.

    Args:
        block_size (int): tokens per draft block (anchor + block_size-1 predictions); >= 2.
        num_target_layers (int): L, decoder layers of the target model.
        dflash_config (dict): ``{"mask_token_id": int, "target_layer_ids": list[int]}`` and
            optionally ``"causal": bool``; the mask token must be a row of the target embedding
            (``< vocab_size``), the ids in ``[0, L)``, distinct. None gives the Qwen3 defaults
            (mask 151669, the default ids for L). DFlash2's fields (:data:`DFLASH2_FIELDS`) make it
            a DFlash2 config, which may set the transforms of :data:`TRANSFORM_IDENTITY`
            (``output_multiplier`` and ``input_embedding_scale`` finite and > 0,
            ``final_logit_softcapping`` finite and > 0, or 0 / None for no cap).
        is_causal (bool, optional): True / False: every layer sees its draft block causally /
            bidirectionally; None (the published drafters): ``dflash_config.causal`` if given, else
            sliding layers causal and full-attention layers bidirectional (module docstring). Kept
            in ``is_causal`` and ``dflash_config.causal`` alike.
        **kwargs: Qwen3Config fields (hidden_size, num_attention_heads, rope_parameters,
            layer_types, sliding_window, ...). ``use_sliding_window`` defaults to True when a layer
            is ``sliding_attention`` (Qwen3Config drops ``sliding_window`` without it).

    Raises:
        ValueError: naming the field that is out of range, ``is_causal`` and
            ``dflash_config.causal`` that disagree (engines differ on which one wins), or a
            transform outside a DFlash2 ``dflash_config`` (vLLM 0.34 and SGLang 0.5.19 read them
            there only, and only for DFlash2).
    """

    def __init__(
        self,
        block_size: int | None = None,
        num_target_layers: int = 36,
        dflash_config: dict | None = None,
        is_causal: bool | None = None,
        **kwargs,
    ):
        if SLIDING_ATTENTION in (kwargs.get("layer_types") or ()):
            kwargs.setdefault("use_sliding_window", True)
        block_size = _block_size(block_size, (dflash_config or {}).get("block_size"))
        if block_size < 2:
            raise ValueError(f"block_size must be >= 2 (anchor + predictions), got {block_size}")
        if num_target_layers < 1:
            raise ValueError(f"num_target_layers must be >= 1, got {num_target_layers}")
        _refuse_top_level_transforms(kwargs)
        if _TAKES_LEGACY_ROPE and kwargs.get("rope_parameters") is not None:
            theta, scaling = legacy_rope(kwargs.pop("rope_parameters"))
            kwargs.setdefault("rope_theta", theta)
            kwargs.setdefault("rope_scaling", scaling)
        dflash2 = any(name in (dflash_config or {}) for name in DFLASH2_FIELDS)
        if kwargs.get("architectures") is None or dflash2:
            # DFlash2's fields decide (SGLang's rule): a save_pretrained that wrote the class name
            # "DFlashDraftModel" over a DFlash2 config must not turn it into DFlash for vLLM and z-lab.
            kwargs["architectures"] = [DFLASH2 if dflash2 else DFLASH]
        if dflash_config is None:
            captured = min(DEFAULT_TAPS, max_captured_layers(num_target_layers))
            dflash_config = {
                "mask_token_id": QWEN3_MASK_TOKEN_ID,
                "target_layer_ids": default_target_layer_ids(num_target_layers, captured),
            }
        self.block_size = block_size
        self.num_target_layers = num_target_layers
        self.is_causal = _causality(is_causal, dflash_config.get("causal"))
        self.dflash_config = {k: v for k, v in dflash_config.items() if k not in ("causal", "block_size")}
        if self.is_causal is not None:
            self.dflash_config["causal"] = self.is_causal
        super().__init__(**kwargs)
        self._validate_dflash_config()
        self._validate_attention()
        self._validate_transforms()
        if self.is_dflash2:
            # The published DFlash2 configs carry the block size only here (vLLM and SGLang read it here first).
            self.dflash_config["block_size"] = block_size
            self._validate_dflash2()

    @property
    def is_dflash2(self) -> bool:
        """Whether this is a DFlash2 drafter (module docstring): its ``dflash_config`` has DFlash2's
        fields, or its architecture says so (then missing fields are an error)."""
        return DFLASH2 in (self.architectures or ()) or any(name in self.dflash_config for name in DFLASH2_FIELDS)

    def _validate_transforms(self) -> None:
        problems = []
        for name, identity in TRANSFORM_IDENTITY.items():
            value = self.dflash_config.get(name, identity)
            no_cap = identity is None and value in (None, 0)
            if value != identity and not no_cap and not _positive_finite(value):
                no_cap_note = " (0 or null: no cap)" if identity is None else ""
                problems.append(f"{name} must be a finite number > 0{no_cap_note}, got {value!r}")
        if problems:
            raise ValueError("dflash_config: " + "; ".join(problems))
        if not self.is_dflash2 and self.transforms:
            raise ValueError(
                f"dflash_config {self.transforms}: logit and embedding transforms are DFlash2 "
                "fields (vLLM 0.34 and SGLang 0.5.19 apply them to DFlash2DraftModel drafters only, so a DFlash "
                "drafter would serve without them); drop them, or make the drafter DFlash2"
            )

    @property
    def transforms(self) -> dict:
        """The transforms of ``dflash_config`` that are not the identity (:data:`TRANSFORM_IDENTITY`), by name."""
        return _transforms_set(self.dflash_config)

    @property
    def logit_transform(self) -> LogitTransform | None:
        """The draft logits' transform of ``dflash_config`` (module docstring); None when it is the identity."""
        multiplier = float(self.dflash_config.get("output_multiplier", 1.0))
        softcap = self.dflash_config.get("final_logit_softcapping") or None
        if multiplier == 1.0 and softcap is None:
            return None
        return LogitTransform(multiplier, None if softcap is None else float(softcap))

    @property
    def noise_embedding_scale(self) -> float:
        """``dflash_config.input_embedding_scale``: what the draft block's embeddings are multiplied by."""
        return float(self.dflash_config.get("input_embedding_scale", 1.0))

    def _validate_dflash2(self) -> None:
        missing = [name for name in DFLASH2_FIELDS if not isinstance(self.dflash_config.get(name), int)]
        if missing:
            raise ValueError(
                f"a DFlash2 drafter needs the ints dflash_config.{', dflash_config.'.join(missing)} "
                f"({', '.join(DFLASH2_FIELDS)}; the published drafters: 2, 16, 256, 16)"
            )
        taps, group, rank, top_k = (self.dflash_config[name] for name in DFLASH2_FIELDS)
        problems = []
        if not 1 <= taps <= self.block_size:
            problems.append(f"conv_kernel_size {taps} must be in [1, block_size={self.block_size}]")
        if group < 1 or self.hidden_size % group:
            problems.append(f"conv_group_size {group} must divide hidden_size {self.hidden_size}")
        if rank < 1:
            problems.append(f"selector_rank {rank} must be >= 1")
        if not 1 <= top_k <= self.vocab_size:
            problems.append(f"selector_top_k {top_k} must be in [1, vocab_size={self.vocab_size}]")
        if problems:
            raise ValueError("dflash_config: " + "; ".join(problems))

    def dflash2_value(self, name: str) -> int:
        """One of :data:`DFLASH2_FIELDS` of a DFlash2 config."""
        return self.dflash_config[name]

    def _validate_attention(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of num_key_value_heads "
                f"{self.num_key_value_heads} (grouped-query attention shares each KV head by a whole group)"
            )
        types = list(self.layer_types)
        if len(types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(types)} entries, num_hidden_layers is {self.num_hidden_layers}: give one "
                "per drafter layer"
            )
        unknown = sorted(set(types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"layer_types: {unknown} are not DFlash drafter layers; use {list(LAYER_TYPES)}")
        if SLIDING_ATTENTION not in types:
            return
        window = self.sliding_window
        if not isinstance(window, int) or window < self.block_size:
            raise ValueError(
                f"sliding_window must be a window of at least block_size={self.block_size} tokens for the "
                f"sliding_attention layers (and use_sliding_window true), got {window!r}"
            )

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
        """Token id that fills draft slots 1..block_size-1."""
        return self.dflash_config["mask_token_id"]

    @property
    def target_layer_ids(self) -> list[int]:
        """Tapped target layers: id k is HF ``hidden_states[k + 1]``."""
        return list(self.dflash_config["target_layer_ids"])

    def window_of(self, layer_type: str) -> int | None:
        """The sliding window of layers of ``layer_type`` in tokens; None for full attention."""
        return self.sliding_window if layer_type == SLIDING_ATTENTION else None

    def layer_is_causal(self, layer_type: str) -> bool:
        """Whether layers of ``layer_type`` see their draft block causally (slot k sees slots
        ``0..k``): ``is_causal`` when set, else sliding layers only (module docstring)."""
        return layer_type == SLIDING_ATTENTION if self.is_causal is None else self.is_causal


def _block_size(top_level: int | None, nested: int | None) -> int:
    """The one block size of a config that may give it at the top level (DFlash configs) and in
    ``dflash_config`` (DFlash2 configs); :data:`DEFAULT_BLOCK_SIZE` when neither does."""
    if top_level is not None and nested is not None and top_level != nested:
        raise ValueError(f"block_size {top_level} and dflash_config.block_size {nested} disagree; make them equal")
    found = top_level if top_level is not None else nested
    return DEFAULT_BLOCK_SIZE if found is None else found


def _positive_finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _transforms_set(dflash_config: dict) -> dict:
    """The transforms of ``dflash_config`` that are not the identity (:data:`TRANSFORM_IDENTITY`)."""
    return {
        name: dflash_config[name]
        for name, identity in TRANSFORM_IDENTITY.items()
        if dflash_config.get(name, identity) not in (identity, 0 if identity is None else identity)
    }


def _refuse_top_level_transforms(fields: dict) -> None:
    """z-lab's reference also reads a transform at the config's top level; vLLM and SGLang read only
    ``dflash_config``, so a drafter with one there would serve without it."""
    stray = _transforms_set(fields)
    if stray:
        raise ValueError(
            f"{stray} at the top level of the drafter config: vLLM and SGLang read these transforms only inside "
            "dflash_config (z-lab's reference reads both); move them into dflash_config"
        )


def _causality(is_causal, dflash_causal) -> bool | None:
    """The one causality of a config that may say it in ``is_causal`` and ``dflash_config.causal``."""
    for name, value in (("is_causal", is_causal), ("dflash_config.causal", dflash_causal)):
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{name} must be true, false or absent, got {value!r}")
    if is_causal is not None and dflash_causal is not None and is_causal != dflash_causal:
        raise ValueError(
            f"is_causal {is_causal} and dflash_config.causal {dflash_causal} disagree (vLLM releases before "
            "#52816 read only dflash_config.causal, later ones and SGLang is_causal first); make them equal"
        )
    return dflash_causal if is_causal is None else is_causal


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Neox-style RoPE on ``x`` [B, heads, T, D] with ``cos``/``sin`` [B, T, D]."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + rotate_half(x) * sin


class DFlashAttention(nn.Module):
    """Queries from the draft tokens, keys/values over ``[context ; draft tokens]``, GQA; what a
    draft token sees (window, causality) comes with the mask."""

    def __init__(self, config: DFlashDraftConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.layer_type = config.layer_types[layer_idx]
        # What z-lab/dflash passes to its attention function; the mask carries it here.
        self.sliding_window = config.window_of(self.layer_type)
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        # Read by transformers' sdpa_attention_forward: never add a causal mask of its own (it
        # would align queries to the end of [context ; block]); causal layers get theirs in the mask.
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
        q = apply_rope(q, *rope_q)
        k = apply_rope(k.transpose(1, 2), *rope_kv)
        # The model has already rejected backends outside SUPPORTED_ATTENTION.
        attention = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
        out, _ = attention(self, q, k, v.transpose(1, 2), attention_mask, dropout=0.0, scaling=self.scaling)
        return self.o_proj(out.reshape(batch, q_len, -1))


class GroupedDynamicConv(nn.Module):
    """DFlash2's grouped dynamic causal convolution around one sublayer (z-lab/dflash 07ebd93
    ``GroupedDynamicCausalConv``).

    With ``x`` the sublayer's (normed) input, both sides' coefficients come from it:
    ``dyn = kernel_projection(x)`` viewed ``[.., 2, k, G]``. Side s convolves a sequence ``z`` as
    ``y[t, c] = sum_j (base_kernel[s, j, c] + dyn[t, s, j, c // g]) * z[t - j, c]`` for taps
    ``j < k``, with ``z`` zero before the start of ``t``'s draft block: side 0 convolves the
    sublayer's input, side 1 its output. No bias, no activation.

    Args:
        hidden_size (int): H; conv_kernel_size (int): k taps; group_size (int): g channels per
            coefficient (divides H); block_size (int): Bs, the length of the draft blocks the
            sequence is made of.
    """

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, block_size: int):
        super().__init__()
        self.kernel_size, self.group_size, self.block_size = kernel_size, group_size, block_size
        groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * groups, bias=False)

    def reset_parameters(self) -> None:
        """The identity (a new drafter starts as DFlash): tap 0 of both sides 1, the rest 0."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def forward(self, x: Tensor, sublayer) -> Tensor:
        """``sublayer`` (a function of ``[B, Q, H]``) between the two sides; ``x`` ``[B, Q, H]`` with
        Q a whole number of draft blocks (or one block shorter than ``block_size``). Both sides
        compute in the dtype of the coefficients (bf16 under autocast, as the served bf16 drafter
        computes). Compiled, both sides' gradients come from autograd through their taps (their
        products in that dtype, as eager autograd would form them), not from
        :class:`_BlockConvolution`'s float32 sums: the base kernel's gradient of a bf16 layer is
        then as far from float64 as eager's (relative 1.8e-3 against 6.6e-4, H 64, Q 2,048).

        Raises:
            ValueError: Q is neither whole blocks nor one shorter block.
        """
        length = self._block_length(x.shape[1])
        if torch.compiler.is_compiling() and torch.is_grad_enabled():
            # Each side runs in a checkpoint that computes its own coefficients (its half of
            # kernel_projection) and keeps only that matmul's output. Backward recomputes the taps,
            # and the partitioner recomputes x from the residual stream (its RMSNorm); with the
            # coefficients computed outside, the layer would keep x's bf16 copy (for the
            # projection's weight gradient) and side 0's output: 2.9 [Q, H] a layer, 2.3 GiB at the
            # user's shape (5 layers, 2 rows x 512 anchors x 16), for elementwise work only. The taps
            # go in as plain ops: torch 2.11's partitioner keeps the output of an autograd.Function
            # inside a checkpoint. Eager, the sublayer's projections keep side 0's output all the
            # same; without gradients there is nothing to keep.
            weights = self.kernel_projection.weight.unflatten(0, (2, -1))
            side = lambda s: (x, self.kernel_size, weights[s], self.base_kernel[s], length, self.group_size)
            keep = dict(use_reentrant=False, context_fn=_keep_matmuls)
            convolved = checkpoint(_projected_taps, x, *side(0), **keep)
            return checkpoint(_projected_taps, sublayer(convolved), *side(1), **keep)
        dynamic = self.kernel_projection(x).unflatten(-1, (2, self.kernel_size, -1))
        z = x.to(dynamic.dtype)
        convolved = _BlockConvolution.apply(z, dynamic[..., 0, :, :], self.base_kernel[0], length, self.group_size)
        inner = sublayer(convolved)
        return self._convolve(inner.to(dynamic.dtype), dynamic[..., 1, :, :], self.base_kernel[1])

    def _block_length(self, q_len: int) -> int:
        """The draft blocks' length for ``q_len`` draft tokens: whole blocks, or one block shorter than
        ``block_size`` (a verify width near the token budget, or a drafter served at a smaller width).

        Raises:
            ValueError: ``q_len`` is neither.
        """
        length = self.block_size if q_len % self.block_size == 0 else q_len
        if length > self.block_size:
            raise ValueError(
                f"{q_len} draft tokens are neither whole blocks of {self.block_size} nor one shorter block"
            )
        return length

    def _convolve(self, z: Tensor, dynamic: Tensor, base: Tensor) -> Tensor:
        """One side: ``z`` [B, Q, H], ``dynamic`` [B, Q, k, G], ``base`` [k, H]."""
        return _BlockConvolution.apply(z, dynamic, base, self._block_length(z.shape[1]), self.group_size)


def _in_blocks(t: Tensor, length: int, group_size: int) -> Tensor:
    """``[B, Q, H]`` as ``[B, Q / length, length, H / g, g]``."""
    batch, q_len, hidden = t.shape
    return t.view(batch, q_len // length, length, hidden // group_size, group_size)


def _back(blocks: Tensor, tap: int) -> Tensor:
    """``blocks`` ``[B, N, L, G, g]`` read ``tap`` slots back within each block, zero before its start."""
    return blocks if tap == 0 else F.pad(blocks[:, :, :-tap], (0, 0, 0, 0, tap, 0))


def _ahead(blocks: Tensor, tap: int) -> Tensor:
    """``blocks`` read ``tap`` slots ahead within each block, zero past its end (the adjoint of :func:`_back`)."""
    return blocks if tap == 0 else F.pad(blocks[:, :, tap:], (0, 0, 0, 0, 0, tap))


def _keep_matmuls():
    """A checkpoint's context that keeps its matmuls' outputs and recomputes the rest in backward."""
    # Imported here: this file is served on torch releases older than the compiled training path.
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    matmuls = (torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default)

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in matmuls else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _projected_taps(
    z: Tensor, x: Tensor, taps: int, weight: Tensor, base: Tensor, length: int, group_size: int
) -> Tensor:
    """:func:`_convolve_taps` of ``z`` [B, Q, H] with the coefficients ``x @ weight.T`` (``x`` [B, Q, H],
    ``weight`` [k G, H], one side's rows of ``kernel_projection``), ``z`` in their dtype."""
    dynamic = F.linear(x, weight).unflatten(-1, (taps, -1))
    return _convolve_taps(z.to(dynamic.dtype), dynamic, base, length, group_size)


def _convolve_taps(z: Tensor, dynamic: Tensor, base: Tensor, length: int, group_size: int) -> Tensor:
    """``y[t, c] = sum_j (base[j, c] + dynamic[t, j, c // g]) * z[t - j, c]`` over draft blocks of
    ``length`` slots, in ``z``'s dtype, tap by tap (``z`` [B, Q, H], ``dynamic`` [B, Q, k, G],
    ``base`` [k, H]); autograd through it keeps each shifted copy of ``z``."""
    blocks = _in_blocks(z, length, group_size)
    groups, taps = blocks.shape[3], base.shape[0]
    dynamic = dynamic.reshape(*blocks.shape[:3], taps, groups, 1)
    out = torch.zeros_like(blocks)
    for tap in range(min(taps, length)):  # a tap of a block's length or more reads before its start
        shifted = _back(blocks, tap)
        out = out + base[tap].view(groups, group_size).to(z.dtype) * shifted
        out = torch.addcmul(out, dynamic[:, :, :, tap], shifted)  # z-lab's order of the two terms
    return out.view_as(z)


class _BlockConvolution(torch.autograd.Function):
    """One side of :class:`GroupedDynamicConv` over draft blocks of ``length`` slots:
    ``y[t, c] = sum_j (base[j, c] + dynamic[t, j, c // g]) * z[t - j, c]``, in ``z``'s dtype.

    Written out so that backward keeps only its inputs (``z`` ``[B, Q, H]``, ``dynamic``
    ``[B, Q, k, G]``, ``base`` ``[k, H]``), where autograd of the taps keeps each shifted copy of
    ``z``, some in float32 (with the selector's block top-K, 3.9 GiB off the step's peak at the
    user's shape, 2 rows x 512 anchors, on an H100). Backward: ``dz[t - j] += coefficient[t, j] * dy[t]``,
    ``d base[j, c] = sum_t z[t - j, c] dy[t, c]``, ``d dynamic[t, j, G] = sum_(c in G) z[t - j, c] dy[t, c]``
    (sums in float32).
    """

    @staticmethod
    def forward(ctx, z, dynamic, base, length, group_size):
        ctx.save_for_backward(z, dynamic, base)
        ctx.length, ctx.group_size = length, group_size
        return _convolve_taps(z, dynamic, base, length, group_size)

    @staticmethod
    def backward(ctx, grad):
        z, dynamic, base = ctx.saved_tensors
        blocks = _in_blocks(z, ctx.length, ctx.group_size)
        grad_blocks = _in_blocks(grad, ctx.length, ctx.group_size)
        groups, taps = blocks.shape[3], base.shape[0]
        coefficients = dynamic.reshape(*blocks.shape[:3], taps, groups, 1)
        grad_z = torch.zeros_like(blocks)
        grad_base, grad_dynamic = [], []
        reading = min(taps, ctx.length)  # a tap of a block's length or more reads before its start
        for tap in range(reading):
            coefficient = base[tap].view(groups, ctx.group_size).to(z.dtype) + coefficients[:, :, :, tap]
            grad_z = grad_z + _ahead(coefficient * grad_blocks, tap)
            # z[t - tap] dy[t] at the slots t >= tap, by slicing: a shifted copy of z like forward's
            # would be shared with it, and kept for backward.
            products = blocks[:, :, : blocks.shape[2] - tap].float() * grad_blocks[:, :, tap:].float()
            grad_dynamic.append(F.pad(products.sum(-1), (0, 0, tap, 0)))
            grad_base.append(products.sum((0, 1, 2)).flatten())
        grad_dynamic, grad_base = torch.stack(grad_dynamic, dim=3), torch.stack(grad_base)
        if reading < taps:  # the taps that read nothing get zero gradients
            grad_dynamic = F.pad(grad_dynamic, (0, 0, 0, taps - reading))
            grad_base = F.pad(grad_base, (0, 0, 0, taps - reading))
        return grad_z.view_as(z), grad_dynamic.view_as(dynamic).to(dynamic.dtype), grad_base.to(base.dtype), None, None


@dataclass(frozen=True)
class LogitTransform:
    """DFlash2's optional shaping of the draft logits (z-lab/dflash 07ebd93 ``compute_logits``):
    ``z * multiplier``, then with a ``softcap`` c, ``c * tanh(z / c)``, in that order (vLLM 0.34
    ``LogitsProcessor.get_top_k_tokens`` and SGLang 0.5.19 ``DFlash2DraftModel._transform_unary_logits``
    alike; they apply it to the top-K logits only, the same candidates since it is increasing).
    The candidate selector's candidates and unary scores are the transformed logits.

    Args:
        multiplier (float): ``dflash_config.output_multiplier`` (> 0).
        softcap (float | None): ``dflash_config.final_logit_softcapping`` (> 0); None: no cap.
    """

    multiplier: float
    softcap: float | None

    def __call__(self, logits: Tensor) -> Tensor:
        """The transformed ``logits`` (any shape, floating; differentiable)."""
        if self.multiplier != 1.0:
            logits = logits * self.multiplier
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def derivative(self, transformed: Tensor) -> Tensor | float:
        """The transform's derivative at the logits whose transform is ``transformed``, from it:
        ``m * (1 - (f / c) ** 2)`` with a cap, the constant m without."""
        if self.softcap is None:
            return self.multiplier
        return (1.0 - (transformed / self.softcap).square()) * self.multiplier


class CandidateSelector(nn.Module):
    """DFlash2's candidate selector (z-lab/dflash 07ebd93 ``CandidateSelector``).

    Slot t's score of candidate token b after predecessor token a is
    ``U_t(b) + <A[a] * P h_t, B[b]>`` with ``U_t`` the drafter's logits of slot t (the LM head's,
    after the config's :class:`LogitTransform`), ``h_t``
    its final hidden state, ``P`` = ``hidden_projection`` ``[r, H]``, ``A`` / ``B`` the
    predecessor / successor codebooks ``[V, r]``; the candidates are slot t's ``top_k`` tokens by
    ``U_t``.

    Args:
        hidden_size (int): H; vocab_size (int): V; rank (int): r; top_k (int): K candidates.
    """

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))

    def reset_parameters(self, std: float) -> None:
        """Predecessors ``N(0, std)``, successors 0: a new selector ranks by the logits alone
        (SpecForge's initialisation)."""
        with torch.no_grad():
            self.predecessor_codebook.normal_(0.0, std)
            self.successor_codebook.zero_()

    def scores(self, hidden: Tensor, unary: Tensor, candidates: Tensor, predecessors: Tensor) -> Tensor:
        """``[.., K]`` scores of ``candidates`` (int64 ``[.., K]``, logits ``unary`` ``[.., K]``)
        after ``predecessors`` (int64 ``[..]``) at slots of final hidden states ``hidden`` ``[.., H]``."""
        left = F.embedding(predecessors, self.predecessor_codebook) * self.hidden_projection(hidden)
        right = F.embedding(candidates, self.successor_codebook)
        return unary + (left[..., None, :] * right).sum(-1)

    @torch.no_grad()
    def walk(self, hidden: Tensor, logits: Tensor, anchor_ids: Tensor) -> Tensor:
        """The greedy path (temperature 0) of a block: slot by slot from the anchor, the best-scored
        candidate after the token chosen before it.

        Args:
            hidden (Tensor): ``[B, T, H]`` final hidden states of the block's slots 1..T.
            logits (Tensor): ``[B, T, V]`` their logits (:meth:`DFlashDraftModel.compute_logits`).
            anchor_ids (Tensor): int64 ``[B]``, the block's slot-0 token.

        Returns:
            Tensor: int64 ``[B, T]``, the drafted tokens.
        """
        unary, candidates = torch.topk(logits, self.top_k, dim=-1)
        predecessor, path = anchor_ids, []
        for slot in range(hidden.shape[1]):
            scores = self.scores(hidden[:, slot], unary[:, slot], candidates[:, slot], predecessor)
            predecessor = candidates[:, slot].gather(-1, scores.argmax(-1, keepdim=True))[:, 0]
            path.append(predecessor)
        return torch.stack(path, dim=1)


class DFlashDecoderLayer(nn.Module):
    """Pre-norm Qwen3 block whose attention also reads the shared context features; a DFlash2
    layer wraps its attention and its MLP in a :class:`GroupedDynamicConv` each."""

    def __init__(self, config: DFlashDraftConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.is_dflash2:
            conv = (
                config.hidden_size,
                config.dflash2_value("conv_kernel_size"),
                config.dflash2_value("conv_group_size"),
                config.block_size,
            )
            self.attention_conv, self.mlp_conv = GroupedDynamicConv(*conv), GroupedDynamicConv(*conv)

    def forward(self, hidden, context, rope_q, rope_kv, attention_mask, query_valid) -> Tensor:
        def attend(normed: Tensor) -> Tensor:
            attn = self.self_attn(normed, context, rope_q, rope_kv, attention_mask)
            if query_valid is not None:
                # Padding blocks see no key: flex and CPU SDPA return 0 there, but some GPU SDPA
                # kernels return NaN for an all-masked row, so zero them explicitly (before
                # DFlash2's output-side convolution, whose gradient would carry a NaN on).
                attn = torch.where(query_valid, attn, 0.0)
            return attn

        normed = self.input_layernorm(hidden)
        attn = self.attention_conv(normed, attend) if hasattr(self, "attention_conv") else attend(normed)
        hidden = hidden + attn
        normed = self.post_attention_layernorm(hidden)
        return hidden + (self.mlp_conv(normed, self.mlp) if hasattr(self, "mlp_conv") else self.mlp(normed))


class DFlashDraftModel(PreTrainedModel):
    """The DFlash drafter (weights in the z-lab layout, see the module docstring).

    Pick the attention backend with transformers' usual switch (``attn_implementation=`` of
    ``from_pretrained``/``_from_config``, or ``set_attn_implementation``): one of
    :data:`SUPPORTED_ATTENTION`.

    Args:
        config (DFlashDraftConfig)
    """

    config_class = DFlashDraftConfig
    base_model_prefix = ""
    main_input_name = "noise_embedding"
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
        if config.is_dflash2:
            self.candidate_selector = CandidateSelector(
                config.hidden_size,
                config.vocab_size,
                config.dflash2_value("selector_rank"),
                config.dflash2_value("selector_top_k"),
            )
        self.post_init()

    def _init_weights(self, module) -> None:
        super()._init_weights(module)
        if isinstance(module, GroupedDynamicConv):
            module.reset_parameters()
        elif isinstance(module, CandidateSelector):
            module.reset_parameters(self.config.initializer_range)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def compute_logits(self, hidden: Tensor, output_head: nn.Module) -> Tensor:
        """Draft logits ``[.., V]`` of final hidden states ``hidden`` ``[.., H]``: the target's LM head
        ``output_head``, then the config's :class:`LogitTransform` (z-lab's ``compute_logits``)."""
        logits = output_head(hidden)
        transform = self.config.logit_transform
        return logits if transform is None else transform(logits)

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return self.config.target_layer_ids

    def forward(
        self,
        noise_embedding: Tensor,
        target_hidden: Tensor,
        position_ids: Tensor,
        attention_mask=None,
        query_valid: Tensor | None = None,
    ) -> Tensor:
        """Drafter hidden states of draft tokens attending to a context (z-lab's argument names).

        Args:
            noise_embedding (Tensor): ``[B, Q, H]``, the target's ``embed_tokens`` of the draft
                tokens (a block is ``[last verified token, MASK x (block_size - 1)]``), times
                :attr:`DFlashDraftConfig.noise_embedding_scale` (the caller's, as in z-lab's loop).
            target_hidden (Tensor): ``[B, S, K*H]``, the K tapped target layers of the S context
                tokens concatenated on the feature axis in ``target_layer_ids`` order.
            position_ids (Tensor): int64 ``[B, S + Q]``, positions of the context tokens then of
                the draft tokens (a block right after S context tokens: ``0 .. S + Q - 1``).
            attention_mask (Tensor | BlockMask | dict, optional): visibility of ``[context ; draft]``
                for each draft token (bool ``[B, 1, Q, S + Q]`` for "sdpa"), one per layer type
                (``{"full_attention": ..., "sliding_attention": ...}``; a single mask only when every
                layer is full attention). None is the inference form: every draft token sees all of
                it, within the window on sliding layers (by position: key positions
                ``> position - sliding_window``), and on causal layers
                (:meth:`DFlashDraftConfig.layer_is_causal`) only key positions ``<= position``.
            query_valid (Tensor, optional): bool ``[B, Q, 1]``, False on draft tokens of padding
                blocks (training), whose attention output is zeroed; None: all real.

        Returns:
            Tensor: ``[B, Q, H]`` after the final norm; :meth:`compute_logits` gives the draft logits.

        Raises:
            ValueError: an unsupported attention backend, or mismatched shapes.
        """
        self._attention_backend()
        context_len = target_hidden.shape[1]
        self._check_context_width(target_hidden)
        if position_ids.shape[-1] != context_len + noise_embedding.shape[1]:
            raise ValueError(
                f"position_ids has {position_ids.shape[-1]} positions, expected S + Q = "
                f"{context_len} + {noise_embedding.shape[1]} (context, then draft tokens)"
            )
        context = self.hidden_norm(self.fc(target_hidden))
        position_ids = position_ids.expand(noise_embedding.shape[0], -1)
        cos, sin = self.rotary_emb(noise_embedding, position_ids)
        rope_q = (cos[:, context_len:], sin[:, context_len:])
        by_type = self._masks_by_layer_type(attention_mask, position_ids, context_len)
        hidden = noise_embedding
        for layer in self.layers:
            mask = by_type[layer.self_attn.layer_type]
            hidden = layer(hidden, context, rope_q, (cos, sin), mask, query_valid)
        return self.norm(hidden)

    def _masks_by_layer_type(self, attention_mask, position_ids: Tensor, context_len: int) -> dict:
        """``attention_mask`` (see :meth:`forward`) as ``{layer type: mask}`` for every layer type."""
        types = set(self.config.layer_types)
        if isinstance(attention_mask, dict):
            missing = sorted(types - set(attention_mask))
            if missing:
                raise ValueError(f"attention_mask has no mask for the {missing} layers of this drafter")
            return attention_mask
        if attention_mask is not None:
            if types != {FULL_ATTENTION}:
                raise ValueError(
                    "attention_mask: this drafter has sliding_attention layers; pass one mask per layer type "
                    '({"full_attention": ..., "sliding_attention": ...}) or None'
                )
            return {FULL_ATTENTION: attention_mask}
        return {kind: self._inference_mask(kind, position_ids, context_len) for kind in types}

    def _inference_mask(self, layer_type: str, position_ids: Tensor, context_len: int):
        """None (all visible) for bidirectional full attention; else the window and causality by
        position: a draft token at position p sees keys at ``p - window < position <= p``."""
        window = self.config.window_of(layer_type)
        causal = self.config.layer_is_causal(layer_type)
        if window is None and not causal:
            return None
        query_positions = position_ids[:, context_len:]

        def visible(query_position: Tensor, key_position: Tensor) -> Tensor:
            distance = query_position - key_position
            if window is None:  # causal full attention
                return distance >= 0
            return (distance < window) & (distance >= 0) if causal else distance < window

        if self.config._attn_implementation != "flex_attention":
            return visible(query_positions[:, :, None], position_ids[:, None, :])[:, None]
        from torch.nn.attention.flex_attention import create_block_mask

        def mask_mod(batch, head, q_idx, kv_idx):
            return visible(query_positions[batch, q_idx], position_ids[batch, kv_idx])

        batch, kv_len = position_ids.shape
        return create_block_mask(mask_mod, batch, None, kv_len - context_len, kv_len, device=position_ids.device)

    def _check_context_width(self, target_hidden: Tensor) -> None:
        width = target_hidden.shape[-1]
        expected = len(self.config.target_layer_ids) * self.config.hidden_size
        if width != expected:
            raise ValueError(
                f"target_hidden has {width} features, expected K*H = {expected} "
                f"({len(self.config.target_layer_ids)} tapped layers x hidden {self.config.hidden_size})"
            )

    def _attention_backend(self) -> str:
        impl = self.config._attn_implementation
        if impl not in SUPPORTED_ATTENTION:
            raise ValueError(
                f"attention backend {impl!r} is not supported by the DFlash drafter; use one of "
                f"{SUPPORTED_ATTENTION} (set attn_implementation=...)"
            )
        return impl

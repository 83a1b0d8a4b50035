"""How each decoder layer type of a target keeps the documents of a packed row apart.

A packed row (:mod:`dflash.data.packing`) holds several conversations ("documents", named by
``document_ids`` int ``[B, S]``: maximal runs of equal ids, -1 on padding). The target's hidden
states of every document must equal those of the document run alone, or the drafter learns from
states the verifier never produces. Each layer type needs its own means:

- ``full_attention`` (Qwen3, Llama, ... and Qwen3.5's gated attention): a document-causal
  attention mask in the form of the attention backend (:func:`attention_mask`); positions restart
  per document through ``position_ids``.
- ``sliding_attention`` (Mistral; Qwen3, Qwen2 and Gemma layers with a window): the same mask
  limited to the layer's window (a 4-D mask replaces the one transformers would build, window
  included). Where a target mixes sliding and full layers, each type gets its own mask
  (:func:`attention_masks`: transformers' per-layer-type mapping).
- ``linear_attention`` (Qwen3.5 / Qwen3.6 Gated DeltaNet, arXiv 2412.06464): the mask never
  reaches these layers (transformers hands them a 2-D padding mask, None for a 4-D one), and their
  causal conv and gated delta-rule recurrence run straight across document boundaries. Here the
  row is laid out as one sequence of *segments* (:class:`Segments`; every document, and each
  row's tail padding, is one), and the layer runs its own weights through kernels that restart
  the conv window and the recurrent state at every segment start (:func:`linear_layers_apart`):
  the conv is transformers' own op with each segment's first outputs recomputed from its own
  tokens (:func:`segmented_conv`: the document alone's rounding), the delta rule
  flash-linear-attention's varlen kernel (``cu_seqlens``) on CUDA and transformers' PyTorch reference
  elsewhere. transformers' own route (``cu_seq_lens_q`` / ``seq_idx`` kwargs) needs Dao's
  causal-conv1d, a CUDA source build, for the conv, and raises without it.

Any other layer type (chunked attention, say) is refused for packing
(:func:`dflash.target_model.files.check_packable`),
naming the type and ``--no-pack``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash import masks
from dflash.config import SLIDING_ATTENTION
from dflash.target_model.files import FLA_PACKAGE, LINEAR_ATTENTION, UnknownLayerType, fla_available, layer_types
from dflash.target_model.layer_skip import ForwardOverride

logger = logging.getLogger(__name__)

#: Attributes of transformers' ``Qwen3_5GatedDeltaNet`` (5.x) that :func:`_gated_deltanet_forward` reads.
_GATED_DELTANET_PARTS = (
    "in_proj_qkv",
    "in_proj_z",
    "in_proj_b",
    "in_proj_a",
    "conv1d",
    "A_log",
    "dt_bias",
    "norm",
    "out_proj",
    "key_dim",
    "value_dim",
    "head_k_dim",
    "head_v_dim",
    "activation",
)


@dataclass(frozen=True)
class Segments:
    """The documents of a packed ``[B, S]`` batch laid end to end as one sequence of ``B * S``
    tokens, in flash-attention's varlen form. Each maximal run of equal ``document_ids`` within a
    row is one segment (a row's tail padding too), so no segment is empty and their count does not
    change any tensor shape the kernels compile for. Everything is computed on the host once per
    batch and copied to the device, so the layers index with it without a sync.

    Args:
        cu_seqlens (Tensor): int64 ``[N + 1]`` segment boundaries, ``0 .. B * S``, on the target's device.
        cu_seqlens_cpu (Tensor): the same on the host (flash-linear-attention reads it without a sync).
        conv_width (int): W, the taps of the layers' causal conv.
        head_index (Tensor): int64 ``[N, W - 1]``, the positions of each segment's first ``W - 1``
            tokens (clipped to the sequence), on the device.
        head_inside (Tensor): bool ``[N, W - 1]``, which of those lie inside their segment.
        head_targets (Tensor): int64 ``[M]``, the positions inside (``head_index[head_inside]``).
        head_slots (Tensor): int64 ``[M]``, their places in the flattened ``[N * (W - 1)]`` heads.
    """

    cu_seqlens: Tensor
    cu_seqlens_cpu: Tensor
    conv_width: int
    head_index: Tensor
    head_inside: Tensor
    head_targets: Tensor
    head_slots: Tensor

    @classmethod
    def of(cls, document_ids: Tensor, device: torch.device, *, conv_width: int = 4) -> Segments:
        """Segments of ``document_ids`` (int ``[B, S]``); computed on the host (pass host ids: no sync)."""
        ids = document_ids.cpu()
        batch, seq_len = ids.shape
        tokens = batch * seq_len
        offsets = (torch.arange(seq_len) - masks.document_starts(ids)).reshape(-1)  # position in segment
        first = (offsets == 0).nonzero().squeeze(1)
        cu = torch.cat([first, torch.tensor([tokens])]).to(torch.long)
        steps = torch.arange(conv_width - 1)
        index = first[:, None] + steps
        clipped = index.clamp(max=tokens - 1)
        inside = (index < tokens) & (offsets[clipped] == steps)
        move = lambda t: t.to(device, non_blocking=True)
        return cls(
            cu_seqlens=move(cu),
            cu_seqlens_cpu=cu,
            conv_width=conv_width,
            head_index=move(clipped),
            head_inside=move(inside),
            head_targets=move(index[inside]),
            head_slots=move(inside.reshape(-1).nonzero().squeeze(1)),
        )


def attention_masks(document_ids: Tensor, config, dtype: torch.dtype):
    """What a target's forward takes as ``attention_mask`` for packed rows: the document-causal
    mask of its attention layers (:func:`attention_mask`), limited to ``config.sliding_window``
    for sliding-window layers; one mask where every attention layer is of one type, else a dict by
    layer type (transformers' ``causal_mask_mapping``, which models listing ``layer_types`` read).

    Args:
        document_ids (Tensor): int ``[B, S]`` on the target's device.
        config: the target's (text) config; its ``_attn_implementation`` is the backend.
        dtype (torch.dtype): the target's dtype (eager masks).

    Raises:
        ValueError: see :func:`attention_mask`.
    """
    kinds = set(layer_types(config.to_dict())) - {LINEAR_ATTENTION}
    backend, window = config._attn_implementation, getattr(config, "sliding_window", None)
    masks_by_kind = {
        kind: attention_mask(document_ids, backend, dtype, window=window if kind == SLIDING_ATTENTION else None)
        for kind in kinds
    }
    return masks_by_kind if len(masks_by_kind) > 1 else next(iter(masks_by_kind.values()))


def attention_mask(document_ids: Tensor, backend: str, dtype: torch.dtype, *, window: int | None = None):
    """The document-causal mask of attention layers (``window``: of sliding-window layers, as
    :func:`dflash.masks.document_causal_mask` counts it), in the form of the attention ``backend``:

    - ``sdpa`` (HF's default): a dense bool ``[B, 1, S, S]`` (:func:`dflash.masks.document_causal_mask`).
      Cost: ``B * S^2`` bytes, and SDPA leaves its causal flash kernel for the masked
      (memory-efficient) one, which computes the whole S x S grid: for a Qwen3-8B shape ~4% more
      work than causal at S=2048, ~15% at S=8192.
    - ``eager``: the same as an additive ``dtype`` mask.
    - ``flex_attention``: a BlockMask (:func:`dflash.masks.document_causal_block_mask`) that skips
      every tile across documents (~``sum_d len_d^2 / 2`` per row).

    Args:
        document_ids (Tensor): int ``[B, S]`` on the target's device.
        backend (str): the target config's ``_attn_implementation``.
        dtype (torch.dtype): the target's dtype (eager masks).

    Raises:
        ValueError: another backend (flash-attention kernels take no such mask), naming the fix.
    """
    if backend == "flex_attention":
        return masks.document_causal_block_mask(document_ids, window=window)
    if backend not in ("sdpa", "eager"):
        raise ValueError(
            f"packed rows need a document mask, which the target's attention backend {backend!r} "
            "does not take here; load the target with attn_implementation='sdpa', 'eager' or "
            "'flex_attention', or train without packing (--no-pack)"
        )
    mask = masks.document_causal_mask(document_ids, window=window)
    if backend == "eager":
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    return mask


@dataclass(frozen=True)
class LinearAttentionKernels:
    """The two kernels of a Gated DeltaNet layer over :class:`Segments`.

    Args:
        name (str): for the log.
        conv (Callable): ``(x [1, T, D], weight [D, W], bias [D] | None, activation, segments) -> [1, T, D]``,
            depthwise causal conv whose window never reaches back past a segment start.
        delta_rule (Callable): ``(q [1, T, H, K], k, v [1, T, HV, V], g [1, T, HV] fp32, beta [1, T, HV],
            segments) -> [1, T, HV, V]``, the gated delta rule with q/k L2-normalised in the kernel
            and the state zeroed at each segment start.
        gated_norm (Callable): ``(norm, x [N, V], gate [N, V]) -> [N, V]``, the layer's gated RMSNorm
            (``norm``: transformers' ``Qwen3_5RMSNormGated``, weight ``[V]``) of each token's head.
    """

    name: str
    conv: Callable
    delta_rule: Callable
    gated_norm: Callable


def segmented_conv(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str, segments: Segments) -> Tensor:
    """transformers' causal conv (``F.conv1d`` with left zero padding, then the activation, in
    ``x``'s dtype) over the whole row, with the first ``W - 1`` outputs of every segment computed
    again by the same op from that segment's own tokens behind zeros, so no window reaches into the
    segment before: each output is the op of the segment run alone on the same values (equal up to
    the op's rounding for inputs of another length).

    Args:
        x (Tensor): ``[1, T, D]``; weight ``[D, W]``; bias ``[D]`` or None; activation: an ``ACT2FN`` key.

    Returns:
        Tensor: ``[1, T, D]`` in ``x``'s dtype.
    """
    from transformers.activations import ACT2FN

    tokens, width = x.shape[1], weight.shape[-1]
    if width != segments.conv_width:
        raise ValueError(f"conv of {width} taps over segments laid out for {segments.conv_width}")
    channels = x.transpose(1, 2)  # [1, D, T]
    kernel, head, groups = weight.unsqueeze(1).to(x.dtype), width - 1, weight.shape[0]
    out = F.conv1d(channels, kernel, bias, padding=head, groups=groups)[..., :tokens]
    windows = channels[0][:, segments.head_index] * segments.head_inside  # [D, N, W-1], zero past each segment
    again = F.conv1d(windows.transpose(0, 1), kernel, bias, padding=head, groups=groups)[..., :head]
    out[0][:, segments.head_targets] = again.transpose(0, 1).reshape(groups, -1)[:, segments.head_slots]
    return ACT2FN[activation](out).transpose(1, 2)


def reference_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, segments: Segments) -> Tensor:
    """transformers' pure-PyTorch chunked gated delta rule (``torch_chunk_gated_delta_rule``, what a
    document run alone gets without flash-linear-attention), once per segment from a zero state."""
    rule = _transformers_chunk_rule()
    heads_v = v.shape[2]
    q, k = (t.repeat_interleave(heads_v // t.shape[2], dim=2) for t in (q, k))  # older releases want HV heads
    bounds = segments.cu_seqlens_cpu.tolist()
    parts = [
        rule(q[:, a:b], k[:, a:b], v[:, a:b], g=g[:, a:b], beta=beta[:, a:b], use_qk_l2norm_in_kernel=True)[0]
        for a, b in zip(bounds, bounds[1:])
    ]
    return torch.cat(parts, dim=1)


def _transformers_chunk_rule() -> Callable:
    # The module-level function is wrapped (5.17+) to dispatch to flash-linear-attention when it is
    # installed; the reference runs on any device, so take the PyTorch function underneath.
    from transformers.models.qwen3_5 import modeling_qwen3_5

    rule = modeling_qwen3_5.torch_chunk_gated_delta_rule
    return getattr(rule, "__wrapped__", rule)


def _fla_delta_rule(q, k, v, g, beta, segments):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    out, _ = chunk_gated_delta_rule(
        *(t.contiguous() for t in (q, k, v, g, beta)),
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=segments.cu_seqlens,
        cu_seqlens_cpu=segments.cu_seqlens_cpu,
    )
    return out


def _module_gated_norm(norm: torch.nn.Module, x: Tensor, gate: Tensor) -> Tensor:
    return norm(x, gate)


def _fla_conv(
    x: Tensor, weight: Tensor, bias: Tensor | None, activation: str, segments: Segments, *, fuse_activation: bool
) -> Tensor:
    """flash-linear-attention's varlen causal conv: one kernel that restarts the window at each
    segment start. With ``fuse_activation`` it applies silu before its one rounding to ``x``'s
    dtype; without, the activation follows as transformers' own op, which rounds the conv's
    output first as transformers does."""
    from fla.modules.causal_conv1d import causal_conv1d
    from transformers.activations import ACT2FN

    if fuse_activation and activation not in ("silu", "swish"):
        raise ValueError(f"flash-linear-attention's causal conv applies silu, not {activation!r}")
    out, _ = causal_conv1d(
        x,
        weight,
        bias,
        activation="silu" if fuse_activation else None,
        cu_seqlens=segments.cu_seqlens,
        cu_seqlens_cpu=segments.cu_seqlens_cpu,
    )
    return out if fuse_activation else ACT2FN[activation](out)


def _fla_gated_norm(norm: torch.nn.Module, x: Tensor, gate: Tensor) -> Tensor:
    """flash-linear-attention's fused gated RMSNorm: normalise, scale and gate in fp32, one rounding
    (transformers rounds the normalised head to ``x``'s dtype before the scale)."""
    from fla.modules.norm.fused_norm_gate import rms_norm_gated

    return rms_norm_gated(x, gate, norm.weight, None, activation=norm.activation, eps=norm.variance_epsilon)


REFERENCE_KERNELS = LinearAttentionKernels(
    "transformers' PyTorch reference (slow)", segmented_conv, reference_delta_rule, _module_gated_norm
)
FLA_KERNELS = LinearAttentionKernels(FLA_PACKAGE, segmented_conv, _fla_delta_rule, _module_gated_norm)
#: Also the conv in flash-linear-attention's varlen kernel (no transposes, no recomputed segment
#: heads), its activation and the gated norm still transformers' ops, rounding where they round.
FLA_CONV_KERNELS = LinearAttentionKernels(
    f"{FLA_PACKAGE} (varlen conv)",
    functools.partial(_fla_conv, fuse_activation=False),
    _fla_delta_rule,
    _module_gated_norm,
)
#: The conv with its activation, and the gated norm, in flash-linear-attention's fused kernels
#: (fewer launches; each rounds once where transformers' ops round after each step).
FLA_FUSED_KERNELS = LinearAttentionKernels(
    f"{FLA_PACKAGE} (conv and gated norm fused)",
    functools.partial(_fla_conv, fuse_activation=True),
    _fla_delta_rule,
    _fla_gated_norm,
)


def kernels_for(device: torch.device) -> LinearAttentionKernels:
    """flash-linear-attention's varlen conv and delta rule on CUDA when installed, else the exact
    reference. The varlen conv keeps packed documents within the same packing bar as the segmented
    conv (both 1.625 at 16 layers of the Qwen3.6-27B layout) and runs the target 1.09x faster
    (``benchmarks/target_profile.py --kernels``, docs/results.md 2026-12-05); the fused sets do not
    keep the bar."""
    return FLA_CONV_KERNELS if device.type == "cuda" and fla_available() else REFERENCE_KERNELS


def linear_layers(model) -> dict[int, torch.nn.Module]:
    """The linear-attention token mixers of a transformers hybrid causal LM (Qwen3.5's
    ``decoder.layers[i].linear_attn``) by decoder layer index; empty for a standard-attention model.

    Raises:
        UnknownLayerType: a linear-attention layer whose module lacks what
            :func:`_gated_deltanet_forward` reads (another transformers version or architecture).
    """
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    types = getattr(config, "layer_types", None) or []
    decoder = model.get_decoder()
    mixers = {i: decoder.layers[i].linear_attn for i, t in enumerate(types) if t == LINEAR_ATTENTION}
    for mixer in mixers.values():
        missing = [name for name in _GATED_DELTANET_PARTS if not hasattr(mixer, name)]
        if missing:
            raise UnknownLayerType(
                f"linear-attention layer {type(mixer).__name__} has no {', '.join(missing)}: packing keeps documents "
                "apart for transformers 5.x's Gated DeltaNet (Qwen3.5 / Qwen3.6); train with --no-pack"
            )
    return mixers


#: The segments, kernels and per-token work of the packed forward running in this thread, if any.
_PACKED = ForwardOverride("dflash_packed_segments")


def gated_deltanet_inputs(layer, h: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A Gated DeltaNet layer's per-token work before its conv: ``h`` ``[1, T, H]`` -> (the conv's
    input ``[1, T, 2 * key_dim + value_dim]``, ``beta`` ``[1, T, HV]``, the decay ``g`` ``[1, T, HV]``
    float32, the gate ``z`` ``[T * HV, head_v_dim]``), as transformers' ``Qwen3_5GatedDeltaNet.forward``."""
    beta = layer.in_proj_b(h).sigmoid()
    g = -layer.A_log.float().exp() * F.softplus(layer.in_proj_a(h).float() + layer.dt_bias)
    z = layer.in_proj_z(h).reshape(-1, layer.head_v_dim)
    return layer.in_proj_qkv(h), beta, g, z


def gated_deltanet_output(layer, core: Tensor, z: Tensor, gated_norm: Callable) -> Tensor:
    """A Gated DeltaNet layer's per-token work after its delta rule: the gated norm of each head of
    ``core`` ``[T * HV, head_v_dim]`` by ``z`` (``gated_norm``: :attr:`LinearAttentionKernels.gated_norm`),
    then ``out_proj``: ``[T, H]``."""
    return layer.out_proj(gated_norm(layer.norm, core, z).reshape(-1, layer.value_dim))


@dataclass(frozen=True)
class PerTokenWork:
    """What runs a Gated DeltaNet layer's per-token work around its kernels: :func:`gated_deltanet_inputs`
    and :func:`gated_deltanet_output` themselves, or compiled regions of them (:mod:`dflash.target_model.compiled`)."""

    inputs: Callable = gated_deltanet_inputs
    output: Callable = gated_deltanet_output


EAGER = PerTokenWork()


def install_segmented_forward(mixers: Iterable[torch.nn.Module]) -> None:
    """Give each of ``mixers`` a forward that runs over the segments of :func:`linear_layers_apart`
    when the calling thread is inside it, and its own forward otherwise (once per mixer;
    :class:`dflash.target_model.layer_skip.ForwardOverride`), so another thread using the same model
    meanwhile (decoding, regeneration) runs transformers' forward untouched."""
    for mixer in mixers:
        _PACKED.install(mixer, _segmented)


def _segmented(mixer, packed: tuple[Segments, LinearAttentionKernels, PerTokenWork], own_forward, *args, **kwargs):
    return _gated_deltanet_forward(mixer, *args, segments=packed[0], kernels=packed[1], work=packed[2], **kwargs)


def linear_layers_apart(
    segments: Segments, kernels: LinearAttentionKernels, work: PerTokenWork = EAGER
) -> AbstractContextManager[None]:
    """Within the block, in this thread, mixers given :func:`install_segmented_forward` run over
    ``segments`` (:func:`_gated_deltanet_forward`) with ``kernels``, their per-token work run by ``work``."""
    return _PACKED.active((segments, kernels, work))


def _gated_deltanet_forward(
    layer,
    hidden_states: Tensor,
    *args,
    segments: Segments,
    kernels: LinearAttentionKernels,
    work: PerTokenWork,
    **kwargs,
) -> Tensor:
    """transformers' Qwen3.5 Gated DeltaNet forward (``Qwen3_5GatedDeltaNet.forward``, no cache) on
    ``hidden_states`` ``[B, S, H]`` with its conv and recurrence restarted at each segment start.
    The cache and 2-D padding mask transformers passes are not used: a packed forward has neither
    (padding is a segment of its own)."""
    batch, seq_len, _ = hidden_states.shape
    h = hidden_states.reshape(1, batch * seq_len, -1)
    qkv, beta, g, z = work.inputs(layer, h)
    mixed = kernels.conv(qkv, layer.conv1d.weight.squeeze(1), layer.conv1d.bias, layer.activation, segments)
    q, k, v = mixed.split([layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    q, k = (t.reshape(1, batch * seq_len, -1, layer.head_k_dim) for t in (q, k))
    v = v.reshape(1, batch * seq_len, -1, layer.head_v_dim)
    core = kernels.delta_rule(q, k, v, g, beta, segments)
    return work.output(layer, core.reshape(-1, layer.head_v_dim), z, kernels.gated_norm).reshape(batch, seq_len, -1)

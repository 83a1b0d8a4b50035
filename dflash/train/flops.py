"""How much work a drafter step does and how fast the device could do it: the MFU estimate's
numerator (:func:`drafter_step_flops`, model FLOPs of useful work) and denominator (a known GPU's dense
bf16 peak, :func:`detect_peak_tflops`)."""

from __future__ import annotations

import torch

# Dense bf16 tensor-core peaks (TFLOP/s) for the MFU estimate, matched against the device name.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}


def detect_peak_tflops(device: torch.device) -> float | None:
    """Dense bf16 peak of a known GPU (``PEAK_TFLOPS``), else None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)


def drafter_step_flops(drafter, *, draft_tokens: float, context_tokens: float, visible_pairs: float) -> float:
    """Model FLOPs of drafter training (forward + backward), the MFU numerator.

    Count only useful work: ``draft_tokens`` = valid blocks * Bs (padding blocks excluded),
    ``context_tokens`` = B * S, ``visible_pairs`` = (query, key) pairs the masks allow, summed over
    the drafter's layers (``AnchoredDrafter.attention_pairs``: sliding layers see fewer).
    6 * params * tokens for the drafter layers on the draft tokens and for the context
    ``k_proj``/``v_proj`` on the context tokens; 4 * params * tokens for ``fc`` (its input, the
    target states, needs no grad); 4 * V * H per draft token for the frozen
    LM head (forward + input grad, no weight grad); attention 12 * heads * head_dim per visible
    (query, key) pair (QK^T and PV, forward + backward). Model FLOPs: any recompute would
    not count (the fused LM head loss recomputes nothing). A DFlash2 drafter's convolutions are
    counted with its layers (their projections are matmuls; their elementwise taps, 6 per
    ``base_kernel`` entry, are a small undercount), and its selector's loss per draft token as
    ``6 * (r * H + K * H + K * r)``: ``hidden_projection``, the K candidates' logits from the hidden
    state, and the K transition dot products, forward + backward.
    """
    cfg = drafter.config
    layer_params = sum(p.numel() for p in drafter.layers.parameters()) + drafter.norm.weight.numel()
    kv_params = sum(
        layer.self_attn.k_proj.weight.numel() + layer.self_attn.v_proj.weight.numel() for layer in drafter.layers
    )
    # fc reads the frozen target states: forward + weight grad only (4, not 6, per parameter).
    context_flops = (4 * drafter.fc.weight.numel() + 6 * kv_params) * context_tokens
    head_flops = 4 * cfg.vocab_size * cfg.hidden_size * draft_tokens
    attention_flops = 12 * cfg.num_attention_heads * cfg.head_dim * visible_pairs
    selector = getattr(drafter, "candidate_selector", None)
    selector_flops = 0.0
    if selector is not None:
        rank, top_k = selector.hidden_projection.out_features, selector.top_k
        selector_flops = 6 * (rank * cfg.hidden_size + top_k * cfg.hidden_size + top_k * rank) * draft_tokens
    return 6 * layer_params * draft_tokens + context_flops + head_flops + attention_flops + selector_flops

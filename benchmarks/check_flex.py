"""GPU check of the compiled flex_attention drafter step against the SDPA reference.

    python benchmarks/check_flex.py --device cuda            # full check (forward + backward)
    python benchmarks/check_flex.py --device cpu --small     # forward-only smoke test (slow compile)
    python benchmarks/check_flex.py --device cuda --sliding-window 512   # sliding layers, then a full one

1. Correctness (fp32, TF32 off): ``torch.compile(fullgraph=True)`` of the drafter forward with the
   flex BlockMask vs the eager SDPA path with the dense mask; then the whole training step
   (forward + chunked loss + backward) compiled vs eager SDPA, comparing loss and gradients.
2. Recompiles: three steps with fresh anchors (new BlockMask, same shapes) must not recompile.
3. Throughput (bf16): ms per compiled training step and peak memory at a realistic shape.
Exits non-zero on a mismatch, a graph break in the forward, or a recompile.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from transformers import Qwen3Config

from dflash import masks
from dflash.config import TrainConfig
from dflash.drafter.model import AnchoredDrafter, create_drafter_config
from dflash.train.loss import dflash_loss
from dflash.train.loss_settings import LossSettings


def build(args, dtype):
    target = Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=36,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        head_dim=64,
    )
    window = args.sliding_window
    # With --sliding-window: every layer but the last slides (the published Qwen3.6 drafters' layout).
    types = ["sliding_attention"] * max(1, args.layers - 1) + ["full_attention"] * (args.layers > 1) if window else None
    config = create_drafter_config(
        target,
        args.layers,
        block_size=args.block_size,
        mask_token_id=args.vocab - 1,
        layer_types=types,
        sliding_window=window,
    )
    torch.manual_seed(0)
    model = AnchoredDrafter._from_config(config, attn_implementation="flex_attention", dtype=dtype)
    return model.to(args.device)


def batch(args, model, dtype, seed):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, args.vocab - 1, (args.batch, args.seq_len), generator=gen)
    loss_mask = torch.rand(args.batch, args.seq_len, generator=gen) < 0.9
    anchors, valid = masks.sample_anchors(loss_mask, args.anchors, generator=gen)
    labels, label_mask = masks.build_labels(ids, loss_mask, anchors, valid, args.block_size)
    draft_ids = masks.draft_input_ids(ids, anchors, valid, args.block_size, args.vocab - 1)
    k_h = len(model.config.target_layer_ids) * args.hidden
    dev = args.device
    return dict(
        draft_embeds=(torch.randn(args.vocab, args.hidden, generator=gen)[draft_ids] * 0.02).to(dev, dtype),
        target_hidden=torch.randn(args.batch, args.seq_len, k_h, generator=gen).to(dev, dtype),
        anchors=anchors.to(dev),
        valid=valid.to(dev),
        labels=labels.to(dev),
        label_mask=label_mask.to(dev),
    )


def loss_settings(args) -> LossSettings:
    """``dflash train``'s default loss settings at this block size."""
    return LossSettings.from_config(
        TrainConfig(), block_size=args.block_size, mask_token_id=args.vocab - 1, selector=False
    )


def step(model, lm_head, weights, b, attention_mask, settings):
    hidden = model(b["draft_embeds"], b["target_hidden"], b["anchors"], b["valid"], attention_mask=attention_mask)
    out = dflash_loss(hidden, lm_head, b["labels"], b["label_mask"], weights, settings)
    return out.loss_sum / out.weight_sum


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument("--sliding-window", type=int, default=None, help="window of sliding layers (all but the last)")
    args = p.parse_args()
    big = dict(hidden=1024, layers=2, vocab=32000, batch=2, seq_len=2048, anchors=256, block_size=16)
    small = dict(hidden=128, layers=1, vocab=512, batch=1, seq_len=100, anchors=8, block_size=16)
    for k, v in (small if args.small else big).items():
        setattr(args, k, v)
    train = args.device != "cpu"  # torch 2.13 has no flex_attention backward on CPU
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from torch._dynamo.utils import counters

    failures = []
    # 1. fp32 correctness: compiled flex vs eager SDPA.
    model = build(args, torch.float32)
    lm_head = torch.randn(args.vocab, args.hidden, device=args.device) * 0.02
    settings = loss_settings(args)
    weights = settings.position_weight(args.device)
    b = batch(args, model, torch.float32, seed=1)
    bm = model.build_attention_mask(b["anchors"], b["valid"], args.seq_len)
    counters.clear()
    fwd = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        flex_out = fwd(b["draft_embeds"], b["target_hidden"], b["anchors"], b["valid"], attention_mask=bm)
        model.set_attn_implementation("sdpa")
        sdpa_out = model(b["draft_embeds"], b["target_hidden"], b["anchors"], b["valid"])
        model.set_attn_implementation("flex_attention")
    err = (flex_out - sdpa_out).abs().max().item()
    print(f"forward fullgraph compile ok; max |flex - sdpa| = {err:.2e}")
    if err > 1e-3:
        failures.append(f"forward mismatch {err}")

    if train:
        compiled_step = torch.compile(step)
        loss = compiled_step(model, lm_head, weights, b, bm, settings)
        loss.backward()
        flex_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        model.set_attn_implementation("sdpa")
        ref = step(
            model, lm_head, weights, b, model.build_attention_mask(b["anchors"], b["valid"], args.seq_len), settings
        )
        ref.backward()
        model.set_attn_implementation("flex_attention")
        gerr = max(
            ((flex_grads[n] - p.grad).abs().max() / p.grad.abs().max().clamp(min=1e-12)).item()
            for n, p in model.named_parameters()
        )
        print(f"train step: loss flex {loss.item():.6f} sdpa {ref.item():.6f}; max relative grad err {gerr:.2e}")
        print(f"graph breaks in the compiled step: {dict(counters['graph_break'])}")
        if abs(loss.item() - ref.item()) > 1e-4 * abs(ref.item()) or gerr > 1e-3:
            failures.append("train step mismatch")

        # 2. No recompiles for new anchors (same shapes).
        frames_before = counters["stats"]["unique_graphs"]
        for seed in (2, 3, 4):
            bb = batch(args, model, torch.float32, seed)
            compiled_step(
                model, lm_head, weights, bb, model.build_attention_mask(bb["anchors"], bb["valid"], args.seq_len), 16
            ).backward()
        new_graphs = counters["stats"]["unique_graphs"] - frames_before
        print(f"new graphs compiled for 3 fresh batches: {new_graphs}")
        if new_graphs:
            failures.append(f"{new_graphs} recompiles for new anchors")

        # 3. bf16 throughput.
        model = build(args, torch.bfloat16)
        lm_head = lm_head.to(torch.bfloat16)
        compiled_step = torch.compile(step)
        batches = [batch(args, model, torch.bfloat16, seed) for seed in range(5)]
        torch.cuda.reset_peak_memory_stats()
        for i, bb in enumerate(batches):
            if i == 1:
                torch.cuda.synchronize()
                start = time.perf_counter()
            mask = model.build_attention_mask(bb["anchors"], bb["valid"], args.seq_len)
            compiled_step(model, lm_head, weights, bb, mask, settings).backward()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - start) / (len(batches) - 1) * 1e3
        print(
            f"bf16 step (B={args.batch}, S={args.seq_len}, N={args.anchors}, Bs={args.block_size}, "
            f"H={args.hidden}, layers={args.layers}, V={args.vocab}): {ms:.1f} ms, "
            f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB"
        )

    print("FAIL: " + "; ".join(failures) if failures else "OK")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

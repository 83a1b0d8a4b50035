"""The drafter's chunked LM head + loss, fused (dflash.train.loss) vs checkpointed, side by side.

    python benchmarks/lm_head_loss.py --device cuda          # realistic: 8,192 draft rows, H 4096, V 151,936
    python benchmarks/lm_head_loss.py --device cpu --tiny    # smoke test

``dflash.train.loss.dflash_loss`` computes each chunk's loss and its gradient with respect to the hidden
states in one pass. The baseline runs the same per-chunk loss under ``torch.utils.checkpoint``
(forward keeps only the chunk's inputs, backward recomputes its logits): the same memory bound, one
more V x H matmul per draft token. Both run forward + backward of the loss alone, compiled with
inductor on CUDA (as in training) or eager on CPU; the script prints the median time of each, the
ratio, the gradient difference between them, and the model FLOP rate of the fused one.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dflash.config import TrainConfig
from dflash.train.loss import dflash_loss
from dflash.train.loss_settings import LossSettings


def checkpointed_loss(hidden, weight, labels, label_mask, slot_weights, settings):
    """The baseline: decay-weighted CE per chunk of blocks, each chunk under checkpoint."""
    chunk_blocks = settings.chunk_blocks
    rows, bs = hidden.shape[0] * hidden.shape[1] // slot_weights.shape[0], slot_weights.shape[0]
    hidden = hidden.reshape(rows, bs, -1)
    labels, label_mask = labels.reshape(rows, bs), label_mask.reshape(rows, bs)

    def chunk(h, lab, mask):
        log_probs = F.log_softmax((h @ weight.t()).float(), dim=-1)
        token = -log_probs.gather(-1, lab[..., None]).squeeze(-1)
        return (torch.where(mask, slot_weights.expand_as(token), 0.0) * token).sum()

    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, rows, chunk_blocks):
        part = slice(start, start + chunk_blocks)
        total = total + checkpoint(chunk, hidden[part], labels[part], label_mask[part], use_reentrant=False)
    return total


def fused_loss(hidden, weight, labels, label_mask, slot_weights, settings):
    return dflash_loss(hidden, weight, labels, label_mask, slot_weights, settings).loss_sum


def time_backward(fn, hidden, args, *, repeats: int, device) -> tuple[float, torch.Tensor]:
    """Median seconds of forward + backward, and the gradient of the last run."""
    times = []
    for _ in range(repeats + 2):  # two warm-ups (compile)
        hidden.grad = None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn(hidden, *args).backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]), hidden.grad.clone()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="small shape (CPU smoke test)")
    parser.add_argument(
        "--chunk-blocks",
        type=int,
        default=TrainConfig.loss_chunk_blocks,
        help="draft blocks per chunk (default: dflash train's --loss-chunk-blocks, %(default)s)",
    )
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    device = torch.device(args.device)
    rows, hidden_size, vocab, bs = (256, 64, 1000, 16) if args.tiny else (8192, 4096, 151936, 16)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device).manual_seed(0)
    hidden = (torch.randn(1, rows, hidden_size, generator=gen, device=device) * 0.5).to(dtype).requires_grad_(True)
    weight = (torch.randn(vocab, hidden_size, generator=gen, device=device) * hidden_size**-0.5).to(dtype)
    labels = torch.randint(0, vocab, (1, rows // bs, bs), generator=gen, device=device)
    label_mask = torch.rand(1, rows // bs, bs, generator=gen, device=device) < 0.9
    label_mask[..., 0] = False
    config = TrainConfig(loss_chunk_blocks=args.chunk_blocks)  # dflash train's loss otherwise
    settings = LossSettings.from_config(config, block_size=bs, mask_token_id=0, selector=False)
    inputs = (weight, labels, label_mask, settings.position_weight(device), settings)
    results = {}
    for name, fn in (("checkpointed", checkpointed_loss), ("fused", fused_loss)):
        if device.type == "cuda":
            fn = torch.compile(fn, dynamic=False)
        results[name] = time_backward(fn, hidden, inputs, repeats=args.repeats, device=device)
    (base_s, base_grad), (fused_s, fused_grad) = results["checkpointed"], results["fused"]
    error = (fused_grad.float() - base_grad.float()).norm() / base_grad.float().norm()
    model_flops = 4 * rows * hidden_size * vocab  # forward logits + input gradient
    print(f"LM head + loss, {rows} draft rows, H {hidden_size}, V {vocab}, {dtype}, chunk {args.chunk_blocks} blocks")
    print(f"  checkpointed: {1e3 * base_s:.2f} ms   fused: {1e3 * fused_s:.2f} ms")
    print(f"  fused / checkpointed time: {fused_s / base_s:.3f}; gradient relative difference {error:.2e}")
    print(f"  fused: {model_flops / fused_s / 1e12:.1f} TFLOP/s of model FLOPs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

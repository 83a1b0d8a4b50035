#!/usr/bin/env python
"""Build the embedded default target and chat corpus that ``dflash train`` uses with no arguments.

What it makes (under ``dflash/assets/`` by default):

* ``default_chat/{train,heldout}.jsonl``: real human-written two-person chats from the BYU PCC
  Chit-Chat Challenge (PyPI ``chitchat-dataset==0.9.0``, MIT licence) in OpenAI ``messages``
  format; the first speaker is ``user``, the second ``assistant``. The two files hold disjoint
  conversations, and the held-out ones were never seen by the target.
* ``default_target/``: a byte-level BPE tokenizer trained on the training conversations (Qwen3-style
  special tokens and chat template, plus ``<|mask|>``, the MASK token a DFlash drafter puts in its
  draft blocks) and a small ``Qwen3ForCausalLM`` trained from scratch on every training
  conversation, rendered with that chat template, stored in bfloat16.

Nothing is downloaded at run time: the corpus is the installed PyPI package. Reproduce with::

    pip install chitchat-dataset==0.9.0
    python scripts/make_default_target.py            # ~20 min on one CPU core

Seeds are fixed; the result is deterministic up to floating-point reduction order on the CPU used.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from importlib import metadata
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

CORPUS_PACKAGE, CORPUS_VERSION = "chitchat-dataset", "0.9.0"
ASSETS = Path(__file__).resolve().parent.parent / "dflash" / "assets"

# Qwen3's names for its special tokens; <|mask|> is ours (Qwen3 DFlash drafters use an added token too).
ENDOFTEXT, IM_START, IM_END, MASK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END, MASK]  # ids 0..3, in this order
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ASSETS, help="assets folder (default: dflash/assets)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden-size", type=int, default=192)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--steps", type=int, default=600, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per packed sequence")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--heldout", type=int, default=150, help="conversations kept out of all training")
    p.add_argument("--ship-train", type=int, default=1000, help="training conversations shipped in train.jsonl")
    p.add_argument("--ship-max-messages", type=int, default=12, help="shipped conversations are cut to this many turns")
    # One thread: on a shared 2-core box, 2 OpenMP threads spin-wait on each other (measured 15x slower).
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args()


def load_conversations() -> list[list[dict]]:
    """Chit-Chat conversations as OpenAI message lists, in a fixed order.

    Each dataset turn is a list of consecutive chat lines by one sender; the lines are joined with
    newlines. Conversations with fewer than two turns (one person alone) are dropped.
    """
    try:
        version = metadata.version(CORPUS_PACKAGE)
    except metadata.PackageNotFoundError:
        raise SystemExit(
            f"{CORPUS_PACKAGE} is not installed; run: pip install {CORPUS_PACKAGE}=={CORPUS_VERSION}"
        ) from None
    if version != CORPUS_VERSION:
        raise SystemExit(f"{CORPUS_PACKAGE} {version} found, {CORPUS_VERSION} needed for a reproducible build")
    import chitchat_dataset

    conversations = []
    for _, conv in sorted(chitchat_dataset.Dataset().items()):
        turns = ["\n".join(line["text"].strip() for line in turn).strip() for turn in conv["messages"]]
        if len(turns) < 2 or not all(turns):
            continue
        roles = ("user", "assistant")
        conversations.append([{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)])
    return conversations


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2/Qwen style pre-tokenizer) with the special tokens at ids 0..3."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        mask_token=MASK,
        additional_special_tokens=[IM_START],
        model_max_length=2048,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def pack(tokenizer, conversations, seq_len: int) -> torch.Tensor:
    """Render each conversation with the chat template, join with <|endoftext|>, cut into rows."""
    texts = [tokenizer.apply_chat_template(conv, tokenize=False) + ENDOFTEXT for conv in conversations]
    # The backend tokenizer skips the max-length warning: whole conversations exceed 2048 tokens before packing.
    ids = [i for enc in tokenizer.backend_tokenizer.encode_batch(texts) for i in enc.ids]
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


@torch.no_grad()
def mean_loss(model, rows: torch.Tensor, batch_size: int = 32) -> float:
    model.eval()
    losses = [model(input_ids=b, labels=b).loss.item() * len(b) for b in rows.split(batch_size)]
    model.train()
    return sum(losses) / len(rows)


def make_model(tokenizer, args) -> Qwen3ForCausalLM:
    head_dim = 32
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=args.hidden_size * 8 // 3 // 64 * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden_size // head_dim,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.pad_token_id,
        # Read by the DFlash trainer: the row of embed_tokens that fills a draft block after its anchor.
        dflash_mask_token_id=tokenizer.mask_token_id,
    )
    return Qwen3ForCausalLM(config)


def train(model, rows: torch.Tensor, args) -> float:
    """AdamW with linear warmup and cosine decay to 10% over ``args.steps``; returns seconds taken."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))),
    )
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(args.seed))
    start = time.perf_counter()
    for step in range(args.steps):
        batch = rows[order[(torch.arange(args.batch_size) + step * args.batch_size) % len(order)]]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == args.steps - 1:
            print(
                f"step {step:5d} loss {loss.item():.3f} lr {schedule.get_last_lr()[0]:.2e} "
                f"{time.perf_counter() - start:.0f}s",
                flush=True,
            )
    return time.perf_counter() - start


def save_target(model, tokenizer, target_dir: Path, summary: dict) -> None:
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.convert_tokens_to_ids(IM_END), tokenizer.pad_token_id],
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    model.save_pretrained(target_dir)
    tokenizer.save_pretrained(target_dir)
    # transformers 5 writes its own class name and a list under extra_special_tokens, which 4.x
    # reads as a dict and fails on; the generic class and additional_special_tokens load in both.
    config_path = target_dir / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    extra = tok_config.pop("extra_special_tokens", None)
    if isinstance(extra, list):
        tok_config["additional_special_tokens"] = extra
    config_path.write_text(json.dumps(tok_config, indent=1) + "\n")
    (target_dir / "training_summary.json").write_text(json.dumps(summary, indent=1) + "\n")


def save_chats(chat_dir: Path, splits: dict, max_messages: int) -> None:
    chat_dir.mkdir(parents=True, exist_ok=True)
    for name, convs in splits.items():
        with open(chat_dir / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for conv in convs:
                conv = conv[:max_messages]
                conv = conv[: len(conv) // 2 * 2]  # end on an assistant turn
                f.write(json.dumps({"messages": conv}, ensure_ascii=False) + "\n")


def main() -> None:
    args = parse_args()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)

    conversations = load_conversations()
    random.Random(args.seed).shuffle(conversations)
    heldout, train_convs = conversations[: args.heldout], conversations[args.heldout :]
    print(f"corpus: {len(conversations)} conversations -> {len(train_convs)} train, {len(heldout)} held out")

    tokenizer = train_tokenizer([m["content"] for c in train_convs for m in c], args.vocab_size)
    print(
        f"tokenizer: {len(tokenizer)} tokens; special ids "
        + ", ".join(f"{t}={tokenizer.convert_tokens_to_ids(t)}" for t in SPECIAL_TOKENS)
    )

    train_rows, heldout_rows = pack(tokenizer, train_convs, args.seq_len), pack(tokenizer, heldout, args.seq_len)
    print(f"packed: {train_rows.numel()} train tokens, {heldout_rows.numel()} held-out tokens")

    model = make_model(tokenizer, args)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: Qwen3 {args.layers} layers, hidden {args.hidden_size}, {n_params / 1e6:.2f} M parameters")
    loss0 = mean_loss(model, heldout_rows)
    print(f"held-out loss before training {loss0:.3f} (ppl {math.exp(loss0):.1f})")

    train_s = train(model, train_rows, args)
    epochs = args.steps * args.batch_size / len(train_rows)
    model = model.to(torch.bfloat16)
    loss1 = mean_loss(model, heldout_rows)
    print(
        f"trained {args.steps} steps ({epochs:.2f} epochs) in {train_s:.0f}s; "
        f"held-out loss after (bf16) {loss1:.3f} (ppl {math.exp(loss1):.1f})"
    )

    target_dir, chat_dir = args.out / "default_target", args.out / "default_chat"
    save_target(
        model,
        tokenizer,
        target_dir,
        {
            "script": "scripts/make_default_target.py",
            "args": {k: str(v) for k, v in vars(args).items() if k != "out"},
            "corpus": f"{CORPUS_PACKAGE}=={CORPUS_VERSION}",
            "parameters": n_params,
            "train_tokens": train_rows.numel(),
            "heldout_tokens": heldout_rows.numel(),
            "epochs": round(epochs, 3),
            "heldout_loss_untrained": round(loss0, 4),
            "heldout_loss_trained_bf16": round(loss1, 4),
            "train_seconds": round(train_s),
            "torch": torch.__version__,
        },
    )
    save_chats(chat_dir, {"train": train_convs[: args.ship_train], "heldout": heldout}, args.ship_max_messages)
    print(f"wrote {target_dir} and {chat_dir}")

    for conv in heldout[:4]:
        prompt = conv[:1]
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_tensors="pt", return_dict=False)
        out = model.generate(ids, max_new_tokens=40, do_sample=False)
        print(f"USER: {prompt[0]['content']!r}\nTARGET: {tokenizer.decode(out[0, ids.shape[1] :])!r}")


if __name__ == "__main__":
    main()

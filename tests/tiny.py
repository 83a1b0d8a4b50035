"""Tiny stand-ins for the tests: a byte-level BPE tokenizer with a ChatML template and a
mask token, random Qwen3 / Llama / Qwen3.5 (hybrid) targets saved as HF directories, a scripted drafter for
speculative decoding, a JSONL writer, a tokenizer that records what it rendered, a run-in-a-thread
helper, and one to run a script in a fresh interpreter on plain or patched torch.

Built in a temp dir in well under a second each; no network.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import threading
from pathlib import Path

import torch

# One intra-op thread per test process: with pytest-xdist (or other jobs) on a 2-core box,
# oversubscribed OpenMP threads made these tiny models 10-20x slower.
torch.set_num_threads(1)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CORPUS = [
    "the cat sat on the mat and looked at the dog",
    "what is two plus two? two plus two is four.",
    "please write a short poem about the sea and the sky",
    "hello there, how are you today? I am fine, thank you.",
    "user assistant system tell me a story about a fox",
]
CONVERSATIONS = [
    [{"role": "user", "content": "what is two plus two?"}, {"role": "assistant", "content": "two plus two is four."}],
    [
        {"role": "system", "content": "you are helpful"},
        {"role": "user", "content": "tell me a story"},
        {"role": "assistant", "content": "the fox sat on the mat and looked at the dog"},
        {"role": "user", "content": "and then?"},
        {"role": "assistant", "content": "the cat sat on the mat"},
    ],
    [
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "hello, how are you today? I am fine"},
    ],
    [
        {"role": "user", "content": "write a poem about the sea"},
        {"role": "assistant", "content": "the sea and the sky, the sky and the sea"},
    ],
]


def make_tokenizer(directory: Path):
    """A fast byte-level BPE tokenizer (vocab ~300) with the ChatML template, saved to
    ``directory``; returns the loaded ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        eos_token="<|im_end|>",
        mask_token="<|mask|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    directory.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(directory)
    return fast


#: The hybrid (qwen3_5) architectures: Qwen3.5 / Qwen3.6, text-only and as the multimodal
#: checkpoint Qwen3.6-27B ships (a vision tower around the language model, ``text_config`` nested).
HYBRID_ARCHS = ("qwen3_5", "qwen3_5_multimodal")
#: The mixture-of-experts hybrid (qwen3_5_moe, Qwen3.5/3.6-35B-A3B's text model), text-only.
MOE_ARCH = "qwen3_5_moe"


def make_target(
    directory: Path,
    *,
    arch: str = "qwen3",
    num_layers: int = 4,
    hidden: int = 32,
    seed: int = 0,
    tied: bool = False,
    sliding_window: int | None = None,
):
    """Save a random tiny causal LM (:func:`random_causal_lm`) plus the tiny tokenizer in
    ``directory`` and return the directory."""
    tokenizer = make_tokenizer(directory)
    model = random_causal_lm(
        arch,
        vocab_size=len(tokenizer),
        num_layers=num_layers,
        hidden=hidden,
        seed=seed,
        tied=tied,
        sliding_window=sliding_window,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model.save_pretrained(directory)
    return directory


def random_causal_lm(
    arch: str,
    *,
    vocab_size: int,
    num_layers: int = 4,
    hidden: int = 32,
    seed: int = 0,
    tied: bool = False,
    sliding_window: int | None = None,
    **config,
):
    """A random tiny causal LM of ``vocab_size`` tokens (``config``: more config fields, e.g.
    ``initializer_range``).

    ``arch``: ``qwen3``, ``llama`` or ``mistral`` (dense; with ``sliding_window``, Mistral's layers
    all slide, Qwen3's second half), or one of :data:`HYBRID_ARCHS`: Qwen3.6's layout
    (3 Gated DeltaNet layers then 1 gated full-attention layer, repeated; partial rotary with
    M-RoPE sections), or :data:`MOE_ARCH` (the same layout with 4 experts of which 2 are active, no
    single MLP width), transformers 5 only. ``tied``: the LM head is the embedding matrix (the
    multimodal checkpoint says so at its top level, as ``save_pretrained`` writes it).
    """
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
        **config,
    )
    torch.manual_seed(seed)
    if arch == "qwen3":
        sliding = dict(use_sliding_window=True, sliding_window=sliding_window, max_window_layers=num_layers // 2)
        return Qwen3ForCausalLM(Qwen3Config(**common, **(sliding if sliding_window else {})))
    if arch == "mistral":
        return MistralForCausalLM(MistralConfig(**common, sliding_window=sliding_window))
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**common))
    if arch in (*HYBRID_ARCHS, MOE_ARCH):
        return _hybrid_model(arch, common, hidden, tied)
    raise ValueError(arch)


def _hybrid_model(arch: str, common: dict, hidden: int, tied: bool):
    from transformers import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig

    text = dict(
        common,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=hidden // 4,
        linear_value_head_dim=hidden // 4,
        linear_conv_kernel_dim=4,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
            "mrope_section": [1, 1, 0],
            "mrope_interleaved": True,
        },
    )
    if arch == "qwen3_5":
        return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text))
    if arch == MOE_ARCH:
        from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

        experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden // 2)
        text = {k: v for k, v in text.items() if k != "intermediate_size"}
        return Qwen3_5MoeForCausalLM(
            Qwen3_5MoeTextConfig(**text, **experts, shared_expert_intermediate_size=hidden // 2)
        )
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=hidden, patch_size=4)
    text["tie_word_embeddings"] = False  # what save_pretrained writes there; the top level decides
    return Qwen3_5ForConditionalGeneration(
        Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=tied)
    )


def tiny_target_config(**overrides):
    """A Qwen3 target config, no weights: vocab 64, hidden 32, 8 layers, 4 heads / 2 KV heads of 8."""
    from transformers import Qwen3Config

    fields = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
    )
    return Qwen3Config(**{**fields, **overrides})


def tiny_drafter(layer_types=None, *, sliding_window=None, is_causal=None, seed: int = 0, arch: str = "dflash"):
    """A random SDPA drafter (eval mode) of block size 4 tapping 3 layers of :func:`tiny_target_config`:
    2 full-attention layers, or one layer per entry of ``layer_types``; mask token 63; ``is_causal``
    as in its config (None: the engines' rule, sliding layers causal); ``arch`` dflash or dflash2."""
    from dflash.drafter.model import AnchoredDrafter, create_drafter_config

    layers = len(layer_types) if layer_types else 2
    config = create_drafter_config(
        tiny_target_config(),
        layers,
        block_size=4,
        num_captured_layers=3,
        mask_token_id=63,
        layer_types=layer_types,
        sliding_window=sliding_window,
        is_causal=is_causal,
        arch=arch,
    )
    torch.manual_seed(seed)
    return AnchoredDrafter._from_config(config, attn_implementation="sdpa").eval()


def random_heads(config, device="cpu", dtype=torch.float32, seed: int = 1):
    """Frozen random embedding and LM head (:class:`dflash.train.replica.Heads`) for a drafter's config."""
    from dflash.train.replica import Heads

    vocab, hidden = config.vocab_size, config.hidden_size
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(vocab, hidden, generator=gen).to(device, dtype) for _ in range(2)]
    embed, head = torch.nn.Embedding(vocab, hidden), torch.nn.Linear(hidden, vocab, bias=False)
    for module, weight in zip((embed, head), weights):
        module.weight = torch.nn.Parameter(weight, requires_grad=False)
    return Heads(embed, head)


def micro_batch(drafter, seed: int, device="cpu", dtype=torch.float32):
    """(TargetBatch, anchors, valid) for a drafter of :func:`tiny_target_config`'s vocabulary (mask
    token 63): 2 packed rows of 40 tokens, random tapped states and last hidden state, 7 anchors per
    row (14 blocks: chunks of 4 leave a shorter last one)."""
    from dflash.masks import sample_anchors
    from dflash.target_model.model import TargetStates
    from dflash.train.step import TargetBatch

    gen = torch.Generator().manual_seed(seed)
    batch = packed_batch([[20, 20], [12, 28]], 40, seed=seed)
    anchors, valid = sample_anchors(batch.loss_mask, 7, document_ids=batch.document_ids, generator=gen)
    hidden = drafter.config.hidden_size
    width = len(drafter.config.target_layer_ids) * hidden
    context, last = torch.randn(2, 40, width, generator=gen), torch.randn(2, 40, hidden, generator=gen)
    states = TargetStates(context.to(device, dtype), last.to(device, dtype))
    ids = batch.input_ids % 63  # the tiny vocabulary; 63 is the mask token
    tensors = (ids, batch.loss_mask, batch.position_ids, batch.document_ids)
    target = TargetBatch(*(t.to(device) for t in tensors), states, batch.num_tokens)
    return target, anchors.to(device), valid.to(device)


def loss_settings(*, block_size: int, mask_token_id: int = 0, selector: bool = True, **flags):
    """:class:`dflash.train.loss_settings.LossSettings` as ``dflash train`` builds it from
    :class:`dflash.config.TrainConfig`'s defaults and ``flags`` (config field names: ``gamma``,
    ``loss_chunk_blocks``, ``dpace``, ``selector_missing_gold`` ...) for a drafter with a selector
    (DFlash2) or, ``selector=False``, without: the tests write no defaults of their own."""
    from dflash.config import TrainConfig
    from dflash.train.loss_settings import LossSettings

    config = TrainConfig(**flags)
    return LossSettings.from_config(config, block_size=block_size, mask_token_id=mask_token_id, selector=selector)


def step_settings(soft_label_weight: float = 0.0, selector_target: str = "hard"):
    """:func:`loss_settings` for :func:`tiny_drafter`: chunks of 4 blocks, gamma 2, DFlash2's selector
    at weight 0.5 with ``insert``, towards ``selector_target``."""
    return loss_settings(
        block_size=4,
        mask_token_id=63,
        gamma=2.0,
        loss_chunk_blocks=4,
        soft_label_weight=soft_label_weight,
        selector_loss_weight=0.5,
        selector_missing_gold="insert",
        selector_target=selector_target,
    )


class ScriptedDrafter:
    """Stands in for a drafter in :func:`dflash.evaluation.decoding.speculative_generate`: proposes the target's
    greedy continuation ``reference`` (generated tokens, prompt excluded) with the first ``correct``
    drafts of every block right and the rest wrong (the right token - 1, or 1 for token 0), or, with
    ``correct=None``, a count drawn uniformly from 0..Bs-1 per block (``seed``), so every rejection
    point and the whole block occur. ``config`` needs ``block_size``, ``mask_token_id`` and
    ``target_layer_ids`` (a real drafter's, or a SimpleNamespace)."""

    def __init__(self, config, reference: list[int], prompt_len: int, *, correct: int | None = None, seed: int = 0):
        self.config, self.reference, self.prompt_len, self.correct = config, reference, prompt_len, correct
        self.rng = random.Random(seed)

    def draft_block(self, target_hidden, block_embeds, lm_head, anchor_ids):
        start = target_hidden.shape[1] - self.prompt_len + 1  # index of the first drafted token
        n = self.config.block_size - 1
        truth = (self.reference + [0] * (start + n))[start : start + n]
        right = self.rng.randint(0, n) if self.correct is None else self.correct
        drafts = truth[:right] + [t - 1 if t else 1 for t in truth[right:]]
        return torch.tensor([drafts], device=target_hidden.device)


def save_random_drafter(target_dir: Path, out: Path, *, step: int = 7, arch: str = "dflash") -> Path:
    """A run directory ``out`` holding one complete checkpoint (step ``step``) of a random 1-layer
    ``arch`` drafter of block size 4 for the target in ``target_dir`` (2 tapped layers); returns its
    step directory."""
    from transformers import AutoTokenizer

    from dflash.drafter.model import AnchoredDrafter, create_drafter_config
    from dflash.run.checkpoint import save_checkpoint
    from dflash.target_model.model import load_target

    target = load_target(target_dir, num_capture_layers=2, device="cpu")
    mask_id = AutoTokenizer.from_pretrained(target_dir).convert_tokens_to_ids("<|mask|>")
    config = create_drafter_config(
        target.config, 1, block_size=4, target_layer_ids=target.layer_ids, mask_token_id=mask_id, arch=arch
    )
    drafter = AnchoredDrafter._from_config(config)
    return save_checkpoint(
        out, step, weights=drafter.state_dict(), drafter_config=config.to_diff_dict(), training_state={"step": step}
    )


def assert_same_block_mask(ours, ref) -> None:
    """Two BlockMasks select the same partial and full tiles (same counts, same kv tiles in order)."""
    assert ours.shape == ref.shape
    for attr in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(ours, attr), getattr(ref, attr)), attr
    for attr in ("kv_indices", "full_kv_indices"):
        counts = getattr(ours, attr.replace("indices", "num_blocks"))
        for idx in torch.nonzero(counts >= 0).tolist():
            n = int(counts[tuple(idx)])
            assert torch.equal(getattr(ours, attr)[tuple(idx)][:n], getattr(ref, attr)[tuple(idx)][:n]), attr


def unfused_flex(monkeypatch, model) -> None:
    """Switch ``model`` to flex_attention, unfused (no torch.compile, CPU forward).

    transformers wraps flex_attention in torch.compile, which on CPU costs ~30 s of C++ builds,
    and builds its own causal BlockMasks with ``create_block_mask(_compile=True)`` (~10 s); calling
    the eager ops keeps the test fast. Eager flex evaluates the mask_mod on the full grid; the
    BlockMask tile tables the compiled kernel uses are checked against create_block_mask in
    test_masks.py, and the compiled path end to end by benchmarks/check_flex.py.
    """
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from transformers import masking_utils
    from transformers.integrations import flex_attention as hf_flex

    monkeypatch.setattr(
        hf_flex,
        "compile_friendly_flex_attention",
        lambda q, k, v, training=False, **kwargs: flex_attention(q, k, v, **kwargs),
    )
    if hasattr(masking_utils, "create_block_mask"):
        eager_block_mask = lambda *args, _compile=False, **kwargs: create_block_mask(*args, **kwargs)
        monkeypatch.setattr(masking_utils, "create_block_mask", eager_block_mask)
    model.set_attn_implementation("flex_attention")
    assert model.config._attn_implementation == "flex_attention"


def flex_eager(monkeypatch, model, *batch, attention_mask=None):
    """Run ``model`` with flex_attention, unfused (:func:`unfused_flex`)."""
    unfused_flex(monkeypatch, model)
    with torch.no_grad():
        return model(*batch, attention_mask=attention_mask)


def write_jsonl(path: Path, records) -> Path:
    """Write records (dicts) one per line; a str record is written verbatim."""
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(record if isinstance(record, str) else json.dumps(record))
            f.write("\n")
    return path


def write_chat_data(path: Path, repeat: int = 4) -> Path:
    """The tiny conversations in OpenAI ``messages`` format, ``repeat`` times."""
    return write_jsonl(path, [{"messages": c} for c in CONVERSATIONS * repeat])


def record_losses(trainer, *, crash_after: int | None = None):
    """Record each step's loss of ``trainer`` in ``trainer.losses``; with ``crash_after``, the step
    after that many raises KeyboardInterrupt (like a kill) before it runs. Returns ``trainer``."""
    run = trainer.engine.run
    trainer.losses = []

    def recording(step, **kwargs):
        if crash_after is not None and step > crash_after:
            raise KeyboardInterrupt("simulated kill")
        stats = run(step, **kwargs)
        trainer.losses.append(stats.loss)
        return stats

    trainer.engine.run = recording
    return trainer


def example(length: int, seed: int, supervised: float = 0.7):
    """A tokenized conversation (:class:`dflash.data.tokenize.Example`) of ``length`` random tokens, about
    ``supervised`` of them in the loss mask."""
    import random

    from dflash.data.tokenize import Example

    rng = random.Random(seed)
    return Example(
        [rng.randrange(3, 200) for _ in range(length)], [int(rng.random() < supervised) for _ in range(length)]
    )


def packed_batch(row_lengths: list[list[int]], seq_len: int, seed: int = 0):
    """A collated batch whose row r holds documents of ``row_lengths[r]`` tokens."""
    from dflash.data.batches import collate

    rows = [
        [example(n, seed * 1000 + 10 * r + d) for d, n in enumerate(lengths)] for r, lengths in enumerate(row_lengths)
    ]
    return collate(rows, seq_len=seq_len, pad_token_id=0)


def capture_packed_and_alone(target, sizes: list[int], seq_len: int):
    """Target states of two packed rows (documents of ``sizes`` and reversed), checked to equal each
    conversation run alone (fp32 tolerance); returns (batch, packed states)."""
    batch = packed_batch([sizes, sizes[::-1]], seq_len, seed=4)
    packed = target.capture(batch.input_ids, batch.position_ids, batch.document_ids)
    for row, order in enumerate([sizes, sizes[::-1]]):
        start = 0
        for size in order:
            alone = target.capture(batch.input_ids[row : row + 1, start : start + size])
            for field in ("context", "last_hidden"):
                got = getattr(packed, field)[row : row + 1, start : start + size]
                torch.testing.assert_close(got, getattr(alone, field), rtol=1e-5, atol=1e-5)
            start += size
    return batch, packed


#: Training flags of the tiny tests: a drafter a few thousand parameters big, steps in milliseconds.
TINY_TRAINING = dict(
    block_size=4,
    gamma=2.0,
    num_target_layers=2,
    seq_len=48,
    batch_size=2,
    max_anchors=6,
    steps=6,
    warmup_steps=2,
    lr=1e-2,
    save_every=3,
    log_every=1,
    progress=False,
    seed=7,
)


def train_config(**values):
    """A :class:`dflash.config.TrainConfig` of :data:`TINY_TRAINING` updated with ``values`` (paths
    may be ``Path`` objects)."""
    from dflash.config import TrainConfig

    paths = {k: str(values[k]) for k in ("target", "data", "out") if values.get(k) is not None}
    return TrainConfig(**{**TINY_TRAINING, **values, **paths})


def training_inputs(root: Path) -> dict:
    """``{"target", "data"}``: a 5-layer tiny target and the tiny chats (16 conversations), under ``root``."""
    return {"target": make_target(root / "target", num_layers=5), "data": write_chat_data(root / "chats.jsonl")}


def inputs_config(inputs: dict, out, **values):
    """:func:`train_config` of :func:`training_inputs` into ``out`` (2 tapped layers)."""
    return train_config(target=inputs["target"], data=inputs["data"], out=out, num_target_layers=2, **values)


class RecordingTokenizer:
    """A tokenizer, recording how many characters each call rendered or tokenized."""

    def __init__(self, tokenizer):
        self._tokenizer, self.rendered, self.tokenized = tokenizer, [], []

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def apply_chat_template(self, messages, **kwargs):
        self.rendered.append(sum(len(m["content"]) for m in messages))
        return self._tokenizer.apply_chat_template(messages, **kwargs)

    def __call__(self, text, **kwargs):
        self.tokenized.append(len(text))
        return self._tokenizer(text, **kwargs)


def in_thread(fn, timeout_s: float = 60):
    """``fn()`` in a new thread; its exception is raised here."""
    out, errors = [], []

    def run():
        try:
            out.append(fn())
        except Exception as e:  # re-raised below, not lost in the thread
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), "the thread did not finish"
    if errors:
        raise errors[0]
    return out[0]


def run_script(script: str, *, patched: bool, timeout_s: float = 240) -> subprocess.CompletedProcess:
    """``python -c script`` in a fresh interpreter, with the patch series (``DFLASH_PATCHES=1``) or on
    plain torch (``DFLASH_PATCHES=0``); output captured as text."""
    env = dict(os.environ, DFLASH_PATCHES="1" if patched else "0")
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout_s)


def script_result(script: str, *, patched: bool, timeout_s: float = 240):
    """The JSON value ``script`` prints on its last line (:func:`run_script`); its stderr if it fails."""
    done = run_script(script, patched=patched, timeout_s=timeout_s)
    side = "patched" if patched else "plain"
    assert done.returncode == 0, f"the script failed on {side} torch:\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def supervised_text(tokenizer, example) -> str:
    """The decoded tokens of ``example`` that its loss mask trains on."""
    return tokenizer.decode([t for t, m in zip(example.input_ids, example.loss_mask) if m])


@contextlib.contextmanager
def chat_template(tokenizer, template: str):
    """``tokenizer`` renders with ``template`` inside the block (module-scoped fixtures share the tokenizer)."""
    original, tokenizer.chat_template = tokenizer.chat_template, template
    try:
        yield tokenizer
    finally:
        tokenizer.chat_template = original

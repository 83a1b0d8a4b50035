"""Training configuration for ``dflash train``.

One ``@dataclass(kw_only=True)`` with a string docstring under each field (torchtitan style);
the CLI flags and their help text are generated from it (``dflash/commands/train.py``).
The defaults train the embedded default target on a 2-core CPU in a few minutes.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import os
import re
import textwrap
from dataclasses import dataclass
from functools import cache
from typing import Literal

from dflash.choices import check_choices

# Saved absolute, so train_config.json and a resume from another directory name the same files.
INPUT_PATHS = ("target", "data", "init_from", "eval_data")
#: The attention of a drafter layer, as ``layer_types`` in a ``config.json`` names it (the names of
#: dflash.drafter.modeling_dflash, which imports transformers; this module must not: the CLI settles a config
#: before anything heavy is imported). tests/unit/test_run_drafter_shape.py checks they agree.
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
_SHORT_NAMES = {"full": FULL_ATTENTION, "sliding": SLIDING_ATTENTION}
#: gamma of the position decay used by the DFlash paper per block size (Sec. 3.3); --gamma's default.
PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}

# The choice fields' choices (dflash.choices: --help, argparse's choices and the checks read them).
#: ``--arch``: the drafter's architecture.
Arch = Literal["dflash", "dflash2"]
#: ``--overflow``: a conversation longer than ``--seq-len``.
Overflow = Literal["truncate", "drop"]
#: ``--responses``: whose assistant replies are trained on.
Responses = Literal["auto", "data", "target"]
#: ``--selector-missing-gold``: DFlash2's selector loss on a slot whose true token is not a candidate.
MissingGold = Literal["exclude", "insert"]
#: ``--compile``.
Compile = Literal["auto", "on", "off"]
#: ``--selector-target``: what DFlash2's selector is trained towards (:mod:`dflash.train.selector_loss`).
SelectorTarget = Literal["hard", "soft"]
#: ``--selector-codebooks``: DFlash2's selector codebooks in training (:mod:`dflash.drafter.codebooks`).
SelectorCodebooks = Literal["tables", "projected"]
#: ``--compile-scope`` (:mod:`dflash.train.regions`).
CompileScope = Literal["regional", "step"]
#: ``--target-dtype`` (:mod:`dflash.target_model.fp8`).
TargetDtype = Literal["auto", "fp8"]
#: ``--save-dtype``; "auto" is the dtype the drafter computes in (bf16 when training in bf16).
SaveDtype = Literal["auto", "bfloat16", "float16", "float32"]


def paper_gamma(block_size: int) -> float:
    """The decay gamma the DFlash paper uses for ``block_size`` (Sec. 3.3; :data:`PAPER_GAMMA`).

    Raises:
        ValueError: a block size the paper gives no gamma for (pass ``--gamma`` then).
    """
    if block_size not in PAPER_GAMMA:
        raise ValueError(
            f"gamma: the paper gives no decay for block size {block_size} (only for {sorted(PAPER_GAMMA)}); "
            "pass --gamma (about block size / 2)"
        )
    return PAPER_GAMMA[block_size]


def absolute_path(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def check_block_fits_row(block_size: int, seq_len: int, *, origin: str | None = None) -> None:
    """A draft block (the anchor and the ``block_size - 1`` tokens after it) fits in a row of ``seq_len`` tokens.

    Args:
        origin: where ``block_size`` came from when the user did not give it (the message says so).

    Raises:
        ValueError: ``block_size > seq_len``, naming both flags and the fix.
    """
    if block_size <= seq_len:
        return
    given = f"--block-size {block_size} ({origin})" if origin else f"block_size {block_size}"
    raise ValueError(
        f"{given} is longer than --seq-len {seq_len}: a draft block (the anchor and the {block_size - 1} tokens "
        f"after it) must fit in a row; pass --block-size {seq_len} or less, or --seq-len {block_size} or more"
    )


def parse_layer_types(text: str) -> list[str]:
    """``--draft-layer-types`` as a list of ``full_attention``/``sliding_attention``.

    Accepts ``full``, ``sliding`` or the full names, separated by commas or spaces.

    Raises:
        ValueError: an empty list or an unknown entry (names the choices).
    """
    entries = text.replace(",", " ").split()
    unknown = [e for e in entries if e not in _SHORT_NAMES and e not in LAYER_TYPES]
    if not entries or unknown:
        raise ValueError(
            f"draft_layer_types {text!r}: give one of full / sliding per drafter layer, comma-separated "
            "(e.g. sliding,sliding,sliding,sliding,full)"
        )
    return [_SHORT_NAMES.get(e, e) for e in entries]


@dataclass(kw_only=True)
class TrainConfig:
    # ---- inputs and outputs -------------------------------------------------------------
    target: str | None = None
    """Local Hugging Face causal-LM directory of the target (verifier); empty = the embedded default target."""
    data: str | None = None
    """JSONL chat file (OpenAI `messages` or ShareGPT `conversations`); empty = the embedded default train set."""
    out: str = "runs/dflash"
    """Output directory: checkpoints/, tensorboard logs, train_config.json."""
    resume: bool = False
    """Continue exactly from the latest checkpoint in --out (same data order, RNG and schedule)."""
    allow_nonempty_out: bool = False
    """Train into an --out that already holds files that are not a run's (the run's files go beside them)."""

    # ---- drafter (empty = dflash.run.drafter_shape's rule: the target's geometry, or the published drafters' shape
    # for Qwen3.5/3.6 targets, or the --init-from drafter's) -----------------------------------------------------
    init_from: str | None = None
    """Drafter to fine-tune: a published drafter directory (config.json + model.safetensors, z-lab layout) or a
    dflash run (its latest checkpoint): its shape, layer
    types, window, block size, mask token, tapped layers and RoPE are kept and its weights loaded strictly; held-out
    acceptance is measured before step 1 and after the last step (on --eval-data, else the embedded held-out set)."""
    arch: Arch | None = None
    """Drafter architecture: `dflash` (arXiv 2602.06036) or `dflash2` (DFlash plus a grouped dynamic convolution
    around each layer's attention and MLP and a top-K candidate selector, as z-lab's DFlash2 drafters; z-lab/dflash
    model.py at 07ebd93); empty = dflash, or the --init-from drafter's."""
    block_size: int | None = None
    """Draft block size Bs: the anchor plus Bs-1 masked slots predicted in parallel."""
    num_draft_layers: int | None = None
    """Decoder layers of the drafter."""
    draft_layer_types: str | None = None
    """Attention of each drafter layer, comma-separated `full`/`sliding` (e.g. sliding,sliding,sliding,sliding,full)."""
    draft_sliding_window: int | None = None
    """Window of the sliding layers in tokens (>= block size; a draft slot sees the window ending at itself, as
    flash-attention serves it)."""
    draft_heads: int | None = None
    """Attention heads of the drafter."""
    draft_kv_heads: int | None = None
    """KV heads of the drafter."""
    draft_head_dim: int | None = None
    """Head dim of the drafter."""
    draft_intermediate_size: int | None = None
    """MLP width of the drafter."""
    target_layer_ids: list[int] | None = None
    """Target decoder layers whose outputs feed the drafter (id k = output of layer k); empty = the DFlash default
    spread (with --arch dflash2, for a dense Qwen3.5/3.6 target of the published depth, the published taps)."""
    num_target_layers: int | None = None
    """How many target layers to tap when --target-layer-ids is not given (the rule's count lowered, with a log line,
    to the target's layers - 3, the most the default spread fits)."""
    mask_token_id: int | None = None
    """Token id of the draft mask slot (an existing row of the target embedding, never resized); empty = the resumed
    drafter's, else the tokenizer's mask token, else the first unused embedding row, else pad/eos/unk (logged)."""

    # ---- data -----------------------------------------------------------------------------
    seq_len: int = 128
    """Tokens per training row (fixed shape; longer conversations follow --overflow)."""
    overflow: Overflow = "truncate"
    """What to do with conversations longer than --seq-len: `truncate` (keep the start) or `drop`."""
    batch_size: int = 8
    """Rows per micro-batch of each drafter replica (a row of --seq-len tokens holds several conversations when
    packed); a step trains on batch_size x grad_accum x drafter replicas x processes rows."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (the loss is normalised by the position weights of the whole step)."""
    drafter_rows: int | None = None
    """Rows per drafter forward/backward: the drafter runs each micro-batch's rows in groups of this many, its
    gradients accumulating, with the loss normalised over the whole step as without groups: the same training, with
    the drafter's activations (they grow with rows x anchors) of a group only; the target's forward still takes the
    whole micro-batch. Must divide --batch-size; empty or 0 = the whole micro-batch. When the first step runs out of
    GPU memory in the drafter's forward/backward, it is halved (down to 1) and the step retried on the same
    micro-batches (a warning names the value that starts there)."""
    max_anchors: int = 32
    """Draft blocks (anchors) sampled per row (512 is common on GPU at seq 4k); with --pack the row's budget, shared
    max-min fairly by its conversations (each keeps all its candidates when they fit, the rest split evenly)."""
    pack: bool = True
    """Several conversations per row, each kept apart as if alone (document-masked target and drafter attention,
    positions restarting per conversation, anchors per conversation), so rows are not mostly padding; --no-pack puts
    one conversation per row."""
    responses: Responses = "auto"
    """Assistant replies to train on: `data` (as in the file), `target` (regenerated greedily by the target, cached
    in --out; each conversation keeps its messages before the first assistant turn plus the target's reply: later
    turns, tool calls and tool results are not kept), `auto` (`target` for the embedded default target and corpus,
    else `data`)."""
    regenerate_max_new_tokens: int = 48
    """Longest regenerated reply in tokens (with --responses target)."""

    # ---- loss -----------------------------------------------------------------------------
    gamma: float | None = None
    """Decay of the position weights w_k = exp(-(k-1)/gamma) (arXiv 2602.06036 Sec. 3.3)."""
    soft_label_weight: float = 0.0
    """Weight of the KL to the target's distribution (0 = hard labels only, 1 = soft only)."""
    loss_chunk_blocks: int = 16
    """Draft blocks per chunk of the LM head + loss (peak logits memory = chunk * Bs * vocab floats; fewer chunks
    compile faster)."""
    dpace: bool = False
    """D-PACE confidence-weighted positions (arXiv 2605.18810) instead of the decay weights, as SpecForge and
    speculators define it."""
    dpace_alpha: float = 0.5
    """D-PACE confidence smoothing alpha in [0, 1]: slot confidence (1 - alpha) * p + alpha (SpecForge and
    speculators default 0.5)."""

    selector_loss_weight: float = 1.0
    """DFlash2: weight of the candidate selector's loss (a cross-entropy over each slot's top-K candidates, scored
    after the true previous token) against the drafter's; 0 gives the selector no gradient (weight decay still
    applies)."""
    selector_missing_gold: MissingGold = "insert"
    """DFlash2: slots whose true token is not among the top-K candidates: `insert` it as the K-th candidate
    (speculators; more held-out acceptance in our measurement, docs/results.md) or `exclude` them from the selector's
    loss (SpecForge, NeMo: only what serving can select)."""
    selector_target: SelectorTarget = "hard"
    """DFlash2: what the selector learns over each slot's candidates: `hard`, a cross-entropy to the true token (the
    public trainers'); `soft`, the target's own distribution over them (a KL to its softmax restricted to the
    candidates), what sampling at T > 0 draws the path from. `soft` reads the target's last hidden state, as
    --soft-label-weight does. On the embedded default `soft` accepted more at T = 0.6 and 1 and 0.7 tokens per
    prompt less at T = 0 (docs/dflash.md)."""
    selector_codebooks: SelectorCodebooks = "tables"
    """DFlash2: how the selector's predecessor and successor codebooks are trained: `tables`, free [vocab, rank]
    tables (the published checkpoints' and the public trainers'); `projected`, rank x hidden projections of the
    target's frozen token embeddings (3 x hidden x rank selector parameters, what the DFlash2 blog's count suggests).
    Checkpoints hold the tables either way (projected ones materialised), in the published format."""

    # ---- held-out acceptance ------------------------------------------------------------------
    eval_data: str | None = None
    """JSONL chat file of held-out conversations: acceptance (tau, as dflash eval measures it) is measured on them
    before step 1, every --eval-every steps and after the last step (with --init-from, on the embedded held-out set
    when empty)."""
    eval_every: int | None = None
    """Measure held-out acceptance every N steps too (with --eval-data or --init-from); empty = before step 1 and
    after the last step only. Training waits while it runs (its seconds are logged)."""
    eval_prompts: int = 20
    """Held-out prompts decoded for that acceptance: a random sample of the usable ones (as dflash eval
    --num-prompts draws it at its default --seed)."""
    eval_max_new_tokens: int = 64
    """Tokens generated per held-out prompt."""
    # GREEDY's temperature, written again: this module may not import dflash.evaluation (a test keeps them equal).
    eval_temperature: float = 0.0
    """Temperature of that acceptance: 0 decodes greedily (each output checked against the target's); above 0 both
    methods sample at it and drafts are verified by speculative sampling, as dflash eval --temperature measures (its
    default --seed, every token: no top-p or top-k)."""

    # ---- schedule -------------------------------------------------------------------------
    steps: int | None = 300
    """Optimizer steps (or --epochs instead: give one of the two)."""
    epochs: float | None = None
    """Epochs over the data, instead of --steps (--epochs alone trains by epochs)."""
    lr: float = 3e-3
    """Peak learning rate of AdamW."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine schedule as a fraction of --lr."""
    warmup_steps: int = 20
    """Linear warm-up steps before the cosine decay."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Clip the global grad norm to this value (0 = off)."""

    # ---- runtime --------------------------------------------------------------------------
    device: str = "auto"
    """cpu, cuda, cuda:N or auto (cuda if visible)."""
    compile: Compile = "auto"
    """Compile the drafter step with torch.compile + flex_attention: `auto` (on for CUDA), `on`, `off`."""
    compile_scope: CompileScope = "regional"
    """What a compiled step compiles: `regional` (one decoder layer, one loss chunk and DFlash2's selector loss,
    each compiled once and reused for every layer and chunk; the first layer, whose input needs no gradient, gets a
    graph of its own) or `step` (the whole forward and loss as one graph: every layer and loss chunk lowered anew, so
    the first step's compile grows with them: minutes at the user's shape). On an H100 regional's first step came
    2.9x sooner and its later steps ran at 0.95x, before a fix took about 14 of the 24 ms between them; not
    measured since (docs/results.md). Without compiling it has no effect."""
    compile_target: bool = True
    """With --compile on, also compile the target's per-token work (each decoder layer's norms and MLP, a Gated
    DeltaNet layer's projections around its kernels) as regions shared by every layer
    (dflash.target_model.compiled): the elementwise work fuses, and an FP8 target quantizes each activation once,
    fused; --no-compile-target keeps the target's forward eager."""
    slow_linear_attention: bool = False
    """Run a hybrid target's linear-attention layers (Qwen3.5 / Qwen3.6 Gated DeltaNet) on CUDA without
    flash-linear-attention, on the exact PyTorch reference kernels (orders of magnitude slower; for checks only).
    Without this flag such a run is refused: install the kernels with `pip install -e '.[fla]'`."""
    target_dtype: TargetDtype = "auto"
    """The target's forward: `auto` (bf16 on GPU, fp32 on CPU) or `fp8` (its linear layers as float8 matmuls
    with row-wise scales, the rest bf16; an NVIDIA GPU of compute capability 8.9+ and torchao: pip install -e
    '.[fp8]'). The held-out acceptance of a run measures against the target it trains with."""
    random_target_weights: bool = False
    """Initialise at random every weight the target's files lack: a benchmark of a model's shape from its config
    and a small weight file. Without this flag such a target is refused once it has loaded (it would train the
    drafter against a partly random verifier)."""
    cpu_threads: int | None = None
    """torch intra-op threads on CPU; empty = the cores free of other jobs (the cores this process may use less
    the 1-minute load average, at least 1; logged), or OMP_NUM_THREADS when set. Threads that wait for busy cores
    run several times slower (3.4x with torch's default of every core on a shared 2-core machine)."""
    seed: int = 0
    """Seed for weights, data order and anchor sampling."""
    save: bool = True
    """Write checkpoints (every --save-every steps, at the end, and on SIGTERM/SIGINT); --no-save for throughput
    measurements (a 1B drafter's checkpoint with its training state is about 14 GB)."""
    save_every: int = 100
    """Save a checkpoint every this many steps (and at the end; 0 = only at the end)."""
    keep_last: int = 2
    """Checkpoints to keep (older ones are deleted after a successful save)."""
    save_dtype: SaveDtype = "auto"
    """dtype of the saved drafter weights: `auto` (the compute dtype: bfloat16 when training in bf16, as published
    drafters are; float32 on CPU), `bfloat16`, `float16` or `float32`. Resuming stays exact either way."""
    log_every: int = 10
    """Log metrics to the console and tensorboard every this many steps."""
    stall_minutes: float = 10.0
    """A step that makes no progress for this many minutes writes every thread's stack to stderr, and again every
    as many minutes while it stays stuck (training goes on if it moves again); 0 = never."""
    profile_step: int = 0
    """Record this step with torch.profiler: a Chrome trace `profile_step<N>.json.gz` in --out and a log line of the
    GPU time by kernel kind (matmuls, flex_attention, compiled fusions, eager elementwise, ...) for the step, the
    target's forward and the drafter's step; 0 = off. Pick a step after the first (its compiles); the steady-state
    summary leaves the profiled step out."""
    peak_tflops: float | None = None
    """Peak dense bf16 TFLOP/s of the device for the MFU estimate; empty = detect (H100/H200: 989)."""
    progress: bool = True
    """Show a tqdm progress bar."""

    # ---- threaded multi-device layout (dflash/train/threaded.py) -----------------------------------
    target_devices: str | None = None
    """Devices of the target threads, one frozen target replica each: `cuda:0-4`, `cuda:0,cuda:2`, `cpu`,
    `cpu:0-1`; empty = the single-device path (--device)."""
    drafter_devices: str | None = None
    """Devices of the drafter threads, one drafter replica each, gradients averaged every optimizer step (same
    syntax as --target-devices)."""
    prefetch_depth: int = 2
    """Target-state batches buffered ahead per drafter thread (bounded: the target threads wait when it is full)."""
    vary_seq_len: int = 0
    """Cycle each drafter replica through this many padded sequence lengths (staggered across threads) to force
    recompiles, for benchmarks and soak runs; 0 = off."""

    def __post_init__(self) -> None:
        if self.target and re.fullmatch(r"[\w.-]+/[\w.-]+", self.target) and not os.path.exists(self.target):
            raise ValueError(
                f"target {self.target!r}: no such directory, and Hub ids are not downloaded; fetch the model first "
                f"(huggingface-cli download {self.target} --local-dir DIR) and pass --target DIR"
            )
        if not self.out.strip():
            raise ValueError("out must name a directory, got an empty one (it would be the working directory)")
        check_choices(self)
        for name in INPUT_PATHS:
            if getattr(self, name):
                setattr(self, name, absolute_path(getattr(self, name)))
        # First: nan passes every `x < 0` / `x <= 0` check below, and inf passes most.
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(
                    f"{field.name} must be a finite number, got {value} (--{field.name.replace('_', '-')})"
                )
        positive = (
            "seq_len",
            "batch_size",
            "grad_accum",
            "max_anchors",
            "log_every",
            "keep_last",
            "loss_chunk_blocks",
            "eval_prompts",
            "eval_max_new_tokens",
        )
        optional_positive = (
            "num_draft_layers",
            "num_target_layers",
            "draft_sliding_window",
            "draft_heads",
            "eval_every",
        )
        optional_positive += ("draft_kv_heads", "draft_head_dim", "draft_intermediate_size")
        for name in positive + optional_positive:
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.draft_layer_types is not None:
            parse_layer_types(self.draft_layer_types)
        if self.eval_temperature < 0:
            raise ValueError(
                f"eval_temperature must be 0 (greedy) or a positive number, got {self.eval_temperature} "
                "(--eval-temperature)"
            )
        if not (self.eval_data or self.init_from):
            defaults = {f.name: f.default for f in dataclasses.fields(self)}
            for name in ("eval_every", "eval_temperature"):
                if getattr(self, name) != defaults[name]:
                    raise ValueError(
                        f"{name}: held-out acceptance needs held-out conversations; pass --eval-data FILE (JSONL chats)"
                    )
        if self.block_size is not None and self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (an anchor plus at least one draft slot), got {self.block_size}")
        if self.block_size is not None:
            check_block_fits_row(self.block_size, self.seq_len)
        if (self.steps is None) == (self.epochs is None):
            raise ValueError(
                "steps/epochs: give --steps or --epochs"
                + (
                    f", not both (--steps {self.steps} would decide the length, --epochs {self.epochs} be ignored)"
                    if self.steps
                    else ""
                )
            )
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.epochs is not None and self.epochs <= 0:
            raise ValueError(f"epochs must be > 0, got {self.epochs}")
        if self.regenerate_max_new_tokens < 1:
            raise ValueError(f"regenerate_max_new_tokens must be >= 1, got {self.regenerate_max_new_tokens}")
        if self.gamma is not None and self.gamma <= 0:
            raise ValueError(f"gamma must be > 0, got {self.gamma}")
        if self.gamma is None and self.block_size is not None:
            paper_gamma(self.block_size)
        if not 0.0 <= self.dpace_alpha <= 1.0:
            raise ValueError(f"dpace_alpha must be in [0, 1], got {self.dpace_alpha}")
        if self.selector_codebooks == "projected" and self.init_from:
            raise ValueError(
                "selector_codebooks projected trains new codebooks from the target's embeddings; the --init-from "
                "drafter brings tables of its own: drop --selector-codebooks projected to fine-tune them, or "
                "--init-from to train projected ones"
            )
        if self.selector_loss_weight < 0:
            raise ValueError(f"selector_loss_weight must be >= 0, got {self.selector_loss_weight}")
        if not 0.0 <= self.soft_label_weight <= 1.0:
            raise ValueError(f"soft_label_weight must be in [0, 1], got {self.soft_label_weight}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
        for name in ("lr", "peak_tflops"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        for name in ("weight_decay", "grad_clip", "warmup_steps", "save_every", "stall_minutes", "profile_step"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.steps is not None and self.profile_step > self.steps:
            raise ValueError(f"profile_step: step {self.profile_step} is past the run's --steps {self.steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if (self.target_devices is None) != (self.drafter_devices is None):
            raise ValueError(
                "target_devices/drafter_devices: give both --target-devices and --drafter-devices "
                "(e.g. cuda:0 and cuda:1-3) or neither"
            )
        if self.target_devices is not None and self.device != "auto":
            raise ValueError(
                f"device: --device {self.device} is the single-device path, but --target-devices/--drafter-devices "
                "name every thread's device; drop --device (or drop the two layout flags to train on one device)"
            )
        if self.drafter_rows is not None and self.drafter_rows < 0:
            raise ValueError(
                f"drafter_rows must be >= 0, got {self.drafter_rows}: pass the rows per drafter forward, a divisor of "
                f"--batch-size {self.batch_size}, or 0 for the whole micro-batch"
            )
        if self.drafter_rows is not None and self.batch_size % max(self.drafter_rows, 1):
            divisors = [n for n in range(1, self.batch_size + 1) if self.batch_size % n == 0]
            raise ValueError(
                f"drafter_rows {self.drafter_rows} does not divide --batch-size {self.batch_size}: the drafter runs a "
                f"micro-batch in groups of equal rows (one compiled shape); pass one of {divisors}, or 0 for the whole "
                "micro-batch"
            )
        if self.prefetch_depth < 1:
            raise ValueError(f"prefetch_depth must be >= 1, got {self.prefetch_depth}")
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be >= 2 (an anchor and the token after it), got {self.seq_len}")
        if self.vary_seq_len < 0:
            raise ValueError(f"vary_seq_len must be >= 0, got {self.vary_seq_len}")
        if self.target_layer_ids is not None and (not self.target_layer_ids or min(self.target_layer_ids) < 0):
            raise ValueError(f"target_layer_ids must be non-negative layer ids, got {self.target_layer_ids}")

    @property
    def measures_acceptance(self) -> bool:
        """Whether the run measures held-out acceptance (``--eval-data``, or ``--init-from``'s before/after)."""
        return bool(self.eval_data or self.init_from)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def defaults(cls) -> dict:
        """Every field's default value, by name."""
        return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}

    @classmethod
    def from_dict(cls, values: dict) -> TrainConfig:
        """Build from a dict (e.g. a checkpoint's saved config); unknown keys raise ValueError."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown training config keys {unknown}; known: {sorted(known)}")
        return cls(**values)


@cache
def field_docs(cls: type = TrainConfig) -> dict[str, str]:
    """The string literal under each dataclass field, by field name (used as CLI help)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = after.value.value
    return docs

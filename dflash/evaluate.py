"""Greedy (T=0) speculative decoding with a DFlash drafter against its target, and the
numbers that judge a drafter: acceptance length tau, its histogram and the speedup.

One speculative step (paper Sec. 3; gpt-fast ``speculative_decode`` has the same shape):
the drafter fills a block ``[last token, MASK x (Bs-1)]`` from the target hidden states of
the verified prefix; the target verifies the block in one forward; drafts are accepted while
they equal the target's argmax, and the target's next argmax is the bonus token. Each step
therefore emits ``accepted + 1`` tokens, and the output is exactly the target's greedy output
(:func:`greedy_generate`; ``tests/unit/test_evaluate.py`` checks it).

Each figure comes in two conventions, both reported (labelled) so results compare with ours and
with the published ones (z-lab/dflash ``benchmark.py``, whose numbers the DFlash paper reports):

- tau per step: mean of ``accepted + 1`` over all steps of all prompts, the last step of a prompt
  cut at EOS / the token budget (it counts only tokens the step really emitted).
- tau per prompt (z-lab): mean over prompts of each prompt's mean ``accepted + 1``, counted as
  z-lab/dflash's ``dflash_generate`` counts it at commit 10129599 (``dflash/model.py``): it steps
  while ``start + 1 < max_length`` and no stop token was written, records ``produced = min(accepted
  + 1, max_length - start - 1)`` cut after the first stop token, and takes no step when the
  prefill token is a stop token (nor when the budget is that token alone). Those are exactly the
  steps and cut counts of tau per step; a prompt without steps has no mean and is left out (z-lab's
  ``np.mean`` of it would be NaN). One difference remains: near the budget z-lab drafts a shorter
  last block (``verify_size = min(block_size, max_length - start)``), so with bidirectional layers
  its last drafts, and that step's count, can differ from ours, which drafts the whole block and
  cuts. (Its older loop, at 44947fb, also counted the last step uncut and ran one more step at the
  budget.)
- speedup with prefill: (target-only seconds per output token) / (speculative seconds per output
  token), whole generations, summed over prompts.
- decoding speedup (z-lab): the same ratio of per-prompt decoding time per output token, prefill
  excluded, each averaged over prompts.

Both methods run on the same prompts after a warm-up.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash.data.chats import DatasetError, prompt_messages, read_conversations
from dflash.data.tokenize import TemplateRejected, cut_to_budget, encode, render_chat
from dflash.drafter.files import DRAFTER_FILES
from dflash.drafter.model import architecture_name, load_drafter_dir
from dflash.run.step_dirs import find_checkpoint
from dflash.target_model.model import Target
from dflash.target_model.rollback import StateRollback, crop, new_cache

logger = logging.getLogger(__name__)


@dataclass
class Generation:
    """Output of one generation.

    Args:
        tokens (list[int]): generated ids (prompt excluded), ending at the first EOS if any.
        accept_lengths (list[int]): per speculative step, accepted drafts + 1, cut at EOS and at
            ``max_new_tokens`` (empty for greedy); z-lab's ``acceptance_lengths`` (module docstring).
        seconds (float): wall time of the generation.
        prefill_seconds (float): the part of ``seconds`` spent on the prompt forward and the
            first token.
    """

    tokens: list[int]
    accept_lengths: list[int] = field(default_factory=list)  # sum + 1 (prefill token) == len(tokens)
    seconds: float = 0.0
    prefill_seconds: float = 0.0

    @property
    def decode_ms_per_token(self) -> float:
        """Milliseconds per output token after prefill (z-lab's time per output token)."""
        return 1e3 * (self.seconds - self.prefill_seconds) / len(self.tokens)


@dataclass
class EvalReport:
    """Aggregate over prompts (what ``dflash eval`` prints; see the module docstring).

    Args:
        tau_per_step (float): mean emitted tokens per step, last step cut at EOS/budget.
        tau_per_prompt (float): z-lab's: mean over prompts of the per-prompt mean (module docstring).
        histogram (dict[int, int]): steps by emitted tokens (``accepted + 1``, cut), 1..block_size.
        speedup (float): target-only / speculative time per output token, prefill included.
        decode_speedup (float): the same after prefill, per-prompt times averaged (z-lab's).
        target_ms_per_token, speculative_ms_per_token (float): whole generations, prefill included.
        target_decode_ms_per_token, speculative_decode_ms_per_token (float): mean over prompts of
            the decoding time per output token.
        num_prompts, num_tokens, block_size (int): speculative output tokens over all prompts.
        intervals (dict[str, tuple[float, float]]): for a sample of the held-out prompts, the 95%
            interval of each of tau_per_step, tau_per_prompt, speedup and decode_speedup
            (:func:`bootstrap_intervals`); empty for the whole set.
        mismatches (int): prompts whose speculative output differs from the target's greedy output.
        dtype (str): the target's dtype during the measurement (``"float32"``, ``"bfloat16"``).
    """

    tau_per_step: float
    tau_per_prompt: float
    histogram: dict[int, int]
    speedup: float
    decode_speedup: float
    target_ms_per_token: float
    speculative_ms_per_token: float
    target_decode_ms_per_token: float
    speculative_decode_ms_per_token: float
    num_prompts: int
    num_tokens: int
    block_size: int
    intervals: dict = field(default_factory=dict)
    mismatches: int = 0
    dtype: str = "float32"

    @property
    def verification_failed(self) -> bool:
        """Whether a speculative output differed from greedy decoding in float32, where verification
        is exact (in lower precision the batched verify forward may break argmax ties otherwise)."""
        return self.mismatches > 0 and self.dtype == "float32"

    def to_dict(self) -> dict:
        return {k: (dict(sorted(v.items())) if isinstance(v, dict) else v) for k, v in vars(self).items()}


def _finish(tokens: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    tokens = tokens[:max_new_tokens]
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: i + 1]
    return tokens


def stop_token_ids(tokenizer, target_config) -> set[int]:
    """Token ids that end a generation: the tokenizer's eos and the target config's ``eos_token_id``(s)."""
    configured = getattr(target_config, "eos_token_id", None)
    ids = {tokenizer.eos_token_id} | set(configured if isinstance(configured, list) else [configured])
    return {i for i in ids if i is not None}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def greedy_generate(target: Target, prompt_ids: torch.Tensor, *, max_new_tokens: int, eos_ids: set[int]) -> Generation:
    """Plain greedy decoding with the target alone, one token per forward (KV cache).

    Args:
        prompt_ids: int64 ``[1, P]``.
    """
    _sync(target.device)
    start = time.perf_counter()
    cache = new_cache(target)
    out = target.decoder_forward(prompt_ids.to(target.device), past_key_values=cache)
    tokens, prefill_seconds = [], None
    while True:
        token = target.lm_head(out.last_hidden_state[:, -1]).argmax(-1)  # [1]
        tokens.append(int(token))  # int() waits for the device
        if prefill_seconds is None:
            prefill_seconds = time.perf_counter() - start
        if len(tokens) >= max_new_tokens or tokens[-1] in eos_ids:
            break
        out = target.decoder_forward(token[:, None], past_key_values=cache)
    _sync(target.device)
    return Generation(
        tokens=_finish(tokens, max_new_tokens, eos_ids),
        seconds=time.perf_counter() - start,
        prefill_seconds=prefill_seconds,
    )


@torch.no_grad()
def speculative_generate(
    target: Target,
    drafter,
    prompt_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_ids: set[int],
    rollback_strategy: str = "mixers",
) -> Generation:
    """Greedy speculative decoding; output identical to :func:`greedy_generate`.

    A hybrid target's linear-attention states are rolled back to the last kept token after each
    rejection (:mod:`dflash.target_model.rollback`); attention layers' KV is cropped.

    Args:
        drafter: a ``AnchoredDrafter`` (``draft_block``), same device as the target, tapping
            ``target.layer_ids``.
        prompt_ids: int64 ``[1, P]``.
        rollback_strategy (str): how a hybrid target's states advance past a rejection, one of
            :data:`dflash.target_model.rollback.STRATEGIES`.

    Raises:
        ValueError: the drafter taps other layers than ``target.layer_ids``.
    """
    if list(drafter.config.target_layer_ids) != target.layer_ids:
        raise ValueError(
            f"drafter taps target layers {drafter.config.target_layer_ids}, the target "
            f"was loaded with {target.layer_ids}"
        )
    block_size, mask_id = drafter.config.block_size, drafter.config.mask_token_id
    device = target.device
    _sync(device)
    start = time.perf_counter()
    cache = new_cache(target)
    out = target.decoder_forward(prompt_ids.to(device), past_key_values=cache)
    rollback = StateRollback.for_target(target, cache, rollback_strategy)
    context = target.select(out.hidden_states)  # [1, P, K*H]: states of every verified token
    last = target.lm_head(out.last_hidden_state[:, -1]).argmax(-1)  # [1], no target state yet
    tokens, accept_lengths = [int(last)], []  # int() waits for the device
    prefill_seconds = time.perf_counter() - start
    masks = torch.full((1, block_size - 1), mask_id, dtype=torch.long, device=device)
    while len(tokens) < max_new_tokens and tokens[-1] not in eos_ids:
        block = torch.cat([last[:, None], masks], dim=1)  # [1, Bs]
        draft = drafter.draft_block(context, target.embed_tokens(block), target.lm_head, last)  # [1, Bs-1]
        verified = context.shape[1]
        block = torch.cat([last[:, None], draft], dim=1)
        with rollback.verifying() if rollback else contextlib.nullcontext():
            out = target.decoder_forward(block, past_key_values=cache)
        greedy = target.lm_head(out.last_hidden_state).argmax(-1)[0]  # [Bs]: next token after each slot
        matches = (draft[0] == greedy[:-1]).int()
        accepted = int(matches.cumprod(0).sum())
        # Emit the accepted drafts and the bonus token, but nothing past EOS or the token budget:
        # tau counts tokens the step really contributed, so sum(accept_lengths) + 1 == len(tokens).
        proposed = draft[0, :accepted].tolist() + [int(greedy[accepted])]
        emitted = _finish(proposed, max_new_tokens - len(tokens), eos_ids)
        tokens.extend(emitted)
        accept_lengths.append(len(emitted))
        # Keep target states/cache for the block's first token and the accepted drafts only.
        context = torch.cat([context, target.select(out.hidden_states)[:, : accepted + 1]], dim=1)
        if rollback:
            rollback.keep(block[:, : accepted + 1], verified)
        else:
            crop(cache, verified + accepted + 1)
        last = greedy[accepted : accepted + 1]
    _sync(device)
    return Generation(
        tokens=tokens,
        accept_lengths=accept_lengths,
        seconds=time.perf_counter() - start,
        prefill_seconds=prefill_seconds,
    )


def load_drafter(path: str | Path, *, device: torch.device, dtype: torch.dtype):
    """Load a drafter from a run directory, its ``checkpoints/``, a step directory or a drafter
    shipped for serving (``config.json`` and ``model.safetensors`` are all it reads: no training
    state needed), in ``dtype`` on ``device``, with SDPA attention. The two files are verified
    against the manifest when there is one; without it a warning says they were not. Loaded
    strictly (:mod:`dflash.drafter.files`): never a random weight, never a default shape.

    Raises:
        CheckpointError: see :func:`dflash.run.step_dirs.find_checkpoint`; a config that is not a
            drafter's or lacks a field, or weights that disagree with it (named), before any
            model is built.
    """
    step_dir = find_checkpoint(path, files=DRAFTER_FILES)
    drafter = load_drafter_dir(step_dir, dtype=dtype, device=device)
    logger.info(
        "drafter %s: %s, %d layer(s) (%s), block size %d, taps target layers %s",
        step_dir,
        architecture_name(drafter.config),
        drafter.config.num_hidden_layers,
        ", ".join(drafter.config.layer_types),
        drafter.config.block_size,
        drafter.config.target_layer_ids,
    )
    return drafter.eval()


@dataclass
class HeldOutPrompts:
    """The prompts :func:`load_prompts` took from a held-out file, and what it left out.

    Args:
        source (Path): the JSONL file.
        prompts (list[torch.Tensor]): int64 ``[1, P]`` each, ``P <= max_prompt_tokens``, in file order.
        requested (int, optional): prompts asked for (``--num-prompts``); None: every usable one.
        context (int): the target's ``max_position_embeddings``.
        max_new_tokens (int): tokens each prompt is continued by.
        too_long (int): conversations skipped for a prompt over ``max_prompt_tokens`` tokens.
        without_prompt (int): conversations skipped for no user turn before an assistant turn, or
            a prompt the target's chat template rejects.
        usable (int): usable prompts in the file; ``prompts`` is a random sample of them when fewer.
        messages (list): the messages of each prompt (:func:`dflash.data.chats.prompt_messages`), as ``prompts``.
    """

    source: Path
    prompts: list[torch.Tensor]
    requested: int | None
    context: int
    max_new_tokens: int
    too_long: int = 0
    without_prompt: int = 0
    usable: int = 0
    messages: list = field(default_factory=list)

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt whose generation stays within the target's context."""
        return self.context - self.max_new_tokens

    @property
    def sampled(self) -> bool:
        """Whether the prompts are a sample of the usable ones (not all of them)."""
        return len(self.prompts) < self.usable

    def to_dict(self) -> dict:
        return {
            "source": str(self.source),
            "requested": self.requested,
            "used": len(self.prompts),
            "usable": self.usable,
            "max_prompt_tokens": self.max_prompt_tokens,
            "skipped_too_long": self.too_long,
            "skipped_without_prompt": self.without_prompt,
        }


def load_prompts(
    tokenizer, path: str | Path, *, num_prompts: int | None, context: int, max_new_tokens: int, seed: int = 0
) -> HeldOutPrompts:
    """The usable prompts of held-out conversations, all of them or a random sample of
    ``num_prompts`` (drawn with ``seed``, kept in file order): the messages before the first
    assistant turn, rendered with the chat template and its generation prompt.

    A prompt is usable when its rendered length plus ``max_new_tokens`` fits the target's
    ``context`` (positions past ``max_position_embeddings`` make tau and speedup meaningless).
    As in training (:mod:`dflash.data.tokenize`), a prompt with more content than
    :func:`dflash.data.tokenize.char_budget` of that limit is surely too long and skipped unrendered, so
    the work per conversation is bounded (a huge one costs nothing).

    Raises:
        ValueError: ``max_new_tokens`` leaves no room for a prompt in ``context``.
        DatasetError: unreadable file (see :func:`dflash.data.chats.read_conversations`), or no
            usable prompt (the message says why and the fix).
    """
    import random

    held_out = HeldOutPrompts(Path(path), [], num_prompts, context, max_new_tokens)
    limit = held_out.max_prompt_tokens
    if limit < 1:
        raise ValueError(
            f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the target's context of "
            f"{context} tokens (max_position_embeddings); pass --max-new-tokens below {context}"
        )
    for conversation in read_conversations(path):
        messages = prompt_messages(conversation)
        if messages is None:
            held_out.without_prompt += 1
            continue
        if cut_to_budget(messages, limit)[1]:  # surely over the limit: never rendered whole
            held_out.too_long += 1
            continue
        try:
            text = render_chat(tokenizer, messages, add_generation_prompt=True)
        except TemplateRejected:
            held_out.without_prompt += 1
            continue
        ids = encode(tokenizer, text)["input_ids"]
        if len(ids) > limit:
            held_out.too_long += 1
            continue
        held_out.prompts.append(torch.tensor([ids]))
        held_out.messages.append(messages)
    if not held_out.prompts:
        raise DatasetError(f"{path}: no usable prompt: {_why_none(held_out)}")
    held_out.usable = len(held_out.prompts)
    if num_prompts is not None and num_prompts < held_out.usable:
        keep = sorted(random.Random(seed).sample(range(held_out.usable), num_prompts))
        held_out.prompts = [held_out.prompts[i] for i in keep]
        held_out.messages = [held_out.messages[i] for i in keep]
    return held_out


def _why_none(held_out: HeldOutPrompts) -> str:
    """Why no prompt was usable, and the fix (one line)."""
    reasons, wanted = [], []
    if held_out.too_long:
        reasons.append(
            f"{held_out.too_long} prompts are longer than {held_out.max_prompt_tokens} tokens (the target's "
            f"max_position_embeddings {held_out.context} minus --max-new-tokens {held_out.max_new_tokens})"
        )
        wanted.append("shorter conversations")
    if held_out.without_prompt:
        reasons.append(
            f"{held_out.without_prompt} conversations have no user turn before an assistant turn "
            "(or one the chat template rejects)"
        )
        wanted.append("conversations that have a user turn before an assistant turn")
    fix = f"pass --data with {' and '.join(wanted)}"
    return f"{' and '.join(reasons)}; " + (f"lower --max-new-tokens, or {fix}" if held_out.too_long else fix)


def evaluate(
    target: Target,
    drafter,
    prompts: list[torch.Tensor],
    *,
    max_new_tokens: int,
    eos_ids: set[int],
    progress: bool = False,
    sample: bool = False,
) -> EvalReport:
    """Run target-only greedy and speculative decoding on every prompt and compare.

    The first prompt is run once untimed by both methods as a warm-up. Each speculative output
    is checked against the greedy one and the report counts the mismatches
    (:attr:`EvalReport.verification_failed` in float32, where verification must be exact; a
    warning in bf16, where the batched verify forward and one-token decoding round differently and
    can break argmax ties). ``sample``: the prompts are a random sample of the held-out set, and
    the report gets the 95% interval of each figure.
    """
    from tqdm import tqdm

    kwargs = dict(max_new_tokens=max_new_tokens, eos_ids=eos_ids)
    greedy_generate(target, prompts[0], **kwargs)
    speculative_generate(target, drafter, prompts[0], **kwargs)
    plains, specs = [], []
    for prompt in tqdm(prompts, desc="eval", disable=not progress):
        plains.append(greedy_generate(target, prompt, **kwargs))
        specs.append(speculative_generate(target, drafter, prompt, **kwargs))
    report = summarize(plains, specs, block_size=drafter.config.block_size, dtype=target.dtype)
    if report.verification_failed:
        logger.error(
            "%d/%d speculative outputs differ from the target's greedy output in float32: verification is wrong, so "
            "is the acceptance measured; please report it",
            report.mismatches,
            len(prompts),
        )
    elif report.mismatches:
        logger.warning(
            "%d/%d speculative outputs differ from the target's greedy output: in %s the batched verify forward and "
            "one-token decoding round differently and can break argmax ties; rerun with float32 to check exactness",
            report.mismatches,
            len(prompts),
            report.dtype,
        )
    if sample:
        report.intervals = bootstrap_intervals(plains, specs)
    return report


def summarize(
    plains: list[Generation], specs: list[Generation], *, block_size: int, dtype: torch.dtype = torch.float32
) -> EvalReport:
    """The report of target-only (``plains``) and speculative (``specs``) generations of the same
    prompts by a target in ``dtype``, in both conventions of the module docstring.

    A generation without steps (its prefill token was a stop token, or the whole budget) has no
    per-prompt tau and is left out of ``tau_per_prompt``; a figure with nothing to average is NaN.
    """
    lengths = [n for spec in specs for n in spec.accept_lengths]
    per_prompt = [_mean(spec.accept_lengths) for spec in specs if spec.accept_lengths]
    target_ms = 1e3 * sum(p.seconds for p in plains) / sum(len(p.tokens) for p in plains)
    spec_ms = 1e3 * sum(s.seconds for s in specs) / sum(len(s.tokens) for s in specs)
    target_decode_ms = _mean([p.decode_ms_per_token for p in plains])
    spec_decode_ms = _mean([s.decode_ms_per_token for s in specs])
    return EvalReport(
        tau_per_step=_mean(lengths),
        tau_per_prompt=_mean(per_prompt),
        histogram=dict(Counter(lengths)),
        speedup=target_ms / spec_ms,
        decode_speedup=target_decode_ms / spec_decode_ms if spec_decode_ms > 0 else float("nan"),
        target_ms_per_token=target_ms,
        speculative_ms_per_token=spec_ms,
        target_decode_ms_per_token=target_decode_ms,
        speculative_decode_ms_per_token=spec_decode_ms,
        num_prompts=len(specs),
        num_tokens=sum(len(s.tokens) for s in specs),
        block_size=block_size,
        mismatches=sum(plain.tokens != spec.tokens for plain, spec in zip(plains, specs)),
        dtype=str(dtype).removeprefix("torch."),
    )


#: Resamples of the prompts behind a sample's 95% intervals.
BOOTSTRAP_RESAMPLES = 2000


def bootstrap_intervals(
    plains: list[Generation], specs: list[Generation], *, level: float = 0.95, seed: int = 0
) -> dict[str, tuple[float, float]]:
    """Percentile-bootstrap intervals (Efron & Tibshirani, "An Introduction to the Bootstrap",
    1993, ch. 13) of the figures of :func:`summarize`, resampling prompts (the unit a sample of
    the held-out set draws) :data:`BOOTSTRAP_RESAMPLES` times with ``seed``.

    Returns:
        dict: ``tau_per_step``, ``tau_per_prompt``, ``speedup``, ``decode_speedup`` -> (low, high).
    """
    import random

    # Per prompt, the sums each figure is a ratio or mean of, so a resample costs O(prompts).
    columns = {
        "emitted": [sum(s.accept_lengths) for s in specs],
        "steps": [len(s.accept_lengths) for s in specs],
        "plain_s": [p.seconds for p in plains],
        "plain_n": [len(p.tokens) for p in plains],
        "spec_s": [s.seconds for s in specs],
        "spec_n": [len(s.tokens) for s in specs],
        "plain_decode": [p.decode_ms_per_token for p in plains],
        "spec_decode": [s.decode_ms_per_token for s in specs],
    }
    per_prompt = [_mean(s.accept_lengths) if s.accept_lengths else None for s in specs]

    def figures(pick: list[int]) -> dict[str, float]:
        total = {name: sum(column[j] for j in pick) for name, column in columns.items()}
        return {
            "tau_per_step": total["emitted"] / total["steps"] if total["steps"] else float("nan"),
            "tau_per_prompt": _mean([per_prompt[j] for j in pick if per_prompt[j] is not None]),
            "speedup": (total["plain_s"] / total["plain_n"]) / (total["spec_s"] / total["spec_n"]),
            "decode_speedup": total["plain_decode"] / total["spec_decode"] if total["spec_decode"] else float("nan"),
        }

    rng = random.Random(seed)
    resamples = [figures([rng.randrange(len(specs)) for _ in specs]) for _ in range(BOOTSTRAP_RESAMPLES)]
    return {name: _quantiles([r[name] for r in resamples], level) for name in resamples[0]}


def _quantiles(values: list[float], level: float) -> tuple[float, float]:
    kept = sorted(v for v in values if v == v)  # NaN: a resample with nothing to average
    if not kept:
        return float("nan"), float("nan")
    at = lambda q: kept[min(len(kept) - 1, int(q * len(kept)))]
    return at((1 - level) / 2), at((1 + level) / 2)


def _mean(values) -> float:
    return sum(values) / len(values) if values else float("nan")

"""Which token fills draft slots 1..Bs-1: resolved as public trainers do, never by resizing.

The mask token must be an existing row of the target's embedding: the drafter shares the target's
frozen ``embed_tokens`` (and vLLM/SGLang embed with the target's), so the embedding is never
resized for it. Candidates, first usable wins (SpecForge ``resolve_mask_token_id``):

1. the explicit ``--mask-token-id``;
2. the drafter config's ``dflash_config.mask_token_id`` (a resumed or given drafter keeps its own);
3. the tokenizer's mask token;
4. the first embedding row past the tokenizer when ``len(tokenizer) < vocab_size``: an existing,
   never-trained row (151669 for Qwen3, 248070 for Qwen3.5/3.6, the ids z-lab's drafters use);
5. the tokenizer's pad, eos, then unk token (a real token; a warning says so).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

EXPLICIT = "--mask-token-id"
DRAFTER_CONFIG = "drafter config dflash_config.mask_token_id"
TOKENIZER_MASK = "tokenizer mask token"
UNUSED_ROW = "first unused embedding row (len(tokenizer) < vocab_size)"
_FALLBACKS = (
    ("pad_token_id", "tokenizer pad token"),
    ("eos_token_id", "tokenizer eos token"),
    ("unk_token_id", "tokenizer unk token"),
)


def resolve_mask_token_id(
    *, explicit: int | None, drafter_config: dict | None, tokenizer, vocab_size: int
) -> tuple[int, str]:
    """The mask token id and where it came from (logged), in the order of the module docstring.

    Args:
        explicit (int, optional): ``--mask-token-id``.
        drafter_config (dict, optional): the drafter's ``dflash_config`` (``{"mask_token_id": ...}``)
            when resuming or continuing a drafter; None for a new one.
        tokenizer: the target's tokenizer (``mask_token_id``, ``pad_token_id``, ``eos_token_id``,
            ``unk_token_id``, ``len()``).
        vocab_size (int): rows of the target's input embedding.

    Returns:
        tuple[int, str]: the id (in ``[0, vocab_size)``) and its source, one of the constants of
        this module or a fallback name ("tokenizer pad token", ...).

    Raises:
        ValueError: the explicit or drafter-config id is not a row of the embedding (the drafter
            belongs to another target), or no candidate is one; the message names the fix.
    """
    for source, candidate in ((EXPLICIT, explicit), (DRAFTER_CONFIG, (drafter_config or {}).get("mask_token_id"))):
        if candidate is None:
            continue
        if not isinstance(candidate, int) or not 0 <= candidate < vocab_size:
            raise ValueError(
                f"mask token id {candidate!r} from the {source} is not a row of the target embedding "
                f"[0, {vocab_size}); pass --mask-token-id with an existing token id of this target"
            )
        return _chosen(candidate, source)
    candidates = [(TOKENIZER_MASK, tokenizer.mask_token_id)]
    if len(tokenizer) < vocab_size:
        candidates.append((UNUSED_ROW, len(tokenizer)))
    candidates += [(name, getattr(tokenizer, attribute, None)) for attribute, name in _FALLBACKS]
    for source, candidate in candidates:
        if candidate is not None and 0 <= candidate < vocab_size:
            return _chosen(candidate, source)
    raise ValueError(
        f"mask_token_id: the tokenizer has no mask, pad, eos or unk token inside the target embedding "
        f"[0, {vocab_size}) and no unused row; pass --mask-token-id with an existing, rarely used token id"
    )


def _chosen(token_id: int, source: str) -> tuple[int, str]:
    if source in {name for _, name in _FALLBACKS}:
        logger.warning(
            "mask token id %d from the %s: a real token also fills the draft slots; pass --mask-token-id "
            "with a rarely used token id if the tokenizer has one",
            token_id,
            source,
        )
    else:
        logger.info("mask token id %d (from the %s)", token_id, source)
    return token_id, source

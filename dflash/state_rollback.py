"""Putting a hybrid target's cache back to the last accepted token after a rejected draft.

Greedy verification (:func:`dflash.evaluate.speculative_generate`) runs the target over a whole
draft block and keeps only the tokens up to the first rejection. Attention layers keep a KV cache,
which is cropped. Linear-attention layers (Qwen3.5 / Qwen3.6 Gated DeltaNet) keep a recurrent state
and a conv window instead, summaries of every token they saw, which cannot be cropped: after a
rejection they must be put back to the state after the last kept token (vLLM and SGLang do the
same for Mamba-style layers).

:class:`StateRollback` snapshots those states before verification and, after a rejection, restores
them and advances them by the kept tokens, in one of two ways (:data:`STRATEGIES`):

- ``mixers``: re-run only the linear-attention token mixers, each on its own input hidden states
  of the kept tokens, recorded during verification (causal: they equal what a forward of the kept
  tokens alone would feed it). Reads the mixer weights only (a quarter of Qwen3.6-27B's).
- ``forward``: re-run the kept tokens through the whole target (KV cropped to before the block).

Reads transformers 5.x's cache layout (``cache.layers[i].conv_states[0]``/``recurrent_states[0]``,
5.2-5.24).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from dflash.document_separation import LINEAR_ATTENTION

#: How a rejected block's linear-attention states are advanced by the kept tokens (module docstring).
STRATEGIES = ("mixers", "forward")


def new_cache(target):
    """An empty cache for ``target``'s decoder: built from its config, so a hybrid target gets its
    linear-attention layers' state slots (a bare ``DynamicCache()`` gives it none)."""
    from transformers import DynamicCache

    return DynamicCache(config=target.config)


def crop(cache, keep: int, *, skip: frozenset[int] = frozenset()) -> None:
    """Drop every cached token past the first ``keep`` of the attention layers of ``cache``; layers
    in ``skip`` (linear attention) have no tokens to drop."""
    remove = cache.get_seq_length() - keep
    if remove <= 0:
        return
    if not skip:
        cache.crop(-remove)  # DynamicCache.crop(-n) drops the last n tokens in transformers 4.x and 5.x
        return
    for index, layer in enumerate(cache.layers):
        if index not in skip:
            layer.crop(-remove)


class StateRollback:
    """Snapshot and restore of a hybrid target's linear-attention states around verification.

    Args:
        target (dflash.target.Target): a target with linear-attention layers.
        cache: its decoding cache (:func:`new_cache`), already past the prompt.
        strategy (str): one of :data:`STRATEGIES`.

    Raises:
        ValueError: an unknown strategy.
    """

    def __init__(self, target, cache, strategy: str = "mixers"):
        if strategy not in STRATEGIES:
            raise ValueError(f"rollback strategy {strategy!r}: use one of {STRATEGIES}")
        self.target, self.cache, self.strategy = target, cache, strategy
        decoder = target.model.get_decoder()
        types = target.config.get_text_config().layer_types
        self.mixers = {i: decoder.layers[i].linear_attn for i, t in enumerate(types) if t == LINEAR_ATTENTION}
        self._saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._inputs: dict[int, torch.Tensor] = {}

    @classmethod
    def for_target(cls, target, cache, strategy: str = "mixers") -> StateRollback | None:
        """A rollback for ``target`` when it has linear-attention layers, else None (KV crop suffices)."""
        config = target.config.get_text_config()
        return (
            cls(target, cache, strategy) if LINEAR_ATTENTION in (getattr(config, "layer_types", None) or []) else None
        )

    @property
    def linear_layers(self) -> frozenset[int]:
        """Indices of the cache layers that hold linear-attention states."""
        return frozenset(self.mixers)

    @contextlib.contextmanager
    def verifying(self) -> Iterator[None]:
        """Wrap the verification forward: snapshot the states first, record the mixers' inputs."""
        self._saved = {i: tuple(state.clone() for state in self._states(i)) for i in self.mixers}
        hooks = [
            mixer.register_forward_pre_hook(self._recorder(i), with_kwargs=True) for i, mixer in self.mixers.items()
        ]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()

    def keep(self, kept_ids: torch.Tensor, verified: int) -> None:
        """After :meth:`verifying` a block from ``verified`` cached tokens, keep only its first n
        tokens ``kept_ids`` (int64 ``[1, n]``): attention layers cropped to ``verified + n``,
        linear-attention layers put at their state after those n tokens (as they are when the
        whole block is kept)."""
        kept = kept_ids.shape[1]
        if kept == next(iter(self._inputs.values())).shape[1]:
            return
        for index, (conv, recurrent) in self._saved.items():
            now_conv, now_recurrent = self._states(index)
            now_conv.copy_(conv)
            now_recurrent.copy_(recurrent)
        if self.strategy == "forward":
            crop(self.cache, verified, skip=self.linear_layers)
            self.target.decoder_forward(kept_ids, past_key_values=self.cache)
            return
        crop(self.cache, verified + kept, skip=self.linear_layers)
        with torch.no_grad():
            for index, mixer in self.mixers.items():
                mixer(self._inputs[index][:, :kept], self.cache)

    def _states(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.cache.layers[index]
        return layer.conv_states[0], layer.recurrent_states[0]

    def _recorder(self, index: int):
        def record(module, args, kwargs):
            self._inputs[index] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

        return record

"""Which target layers the drafter taps: the DFlash default spread, and the check of a choice
against a target's depth with errors in terms of the CLI flags (``--num-target-layers``,
``--target-layer-ids``) and the values that would work.

Layer id k is the *output* of decoder layer k, i.e. Hugging Face ``output.hidden_states[k + 1]``.
Id ``L - 1`` is the final-norm output (``dflash.target_model.model``), which the default spread never picks
and the suggestions here avoid. Imports nothing heavy: the checks run before any model loads.
"""

from __future__ import annotations

NUM_FLAG, IDS_FLAG = "--num-target-layers", "--target-layer-ids"


def max_captured_layers(num_target_layers: int) -> int:
    """Largest N for which :func:`default_target_layer_ids` gives distinct ids (1 for L < 5)."""
    return max(1, num_target_layers - 3)


def default_target_layer_ids(num_target_layers: int, num_captured: int) -> list[int]:
    """Target layers to tap, by the public DFlash formula (z-lab/dflash, SpecForge).

    ``num_captured == 1`` gives ``[L // 2]``; otherwise ``round(1 + i * (L - 4) / (N - 1))`` for
    i in 0..N-1.

    Args:
        num_target_layers (int): L, decoder layers of the target.
        num_captured (int): N, layers to tap.

    Returns:
        list[int]: N sorted layer ids, e.g. L=36, N=5 -> [1, 9, 17, 25, 33]; L=64, N=5 ->
        [1, 16, 31, 46, 61].

    Raises:
        ValueError: L < 1, N < 1, or N > 1 with fewer than N + 3 target layers (the formula would
        repeat ids); the message names the flags and the values that work.
    """
    if num_target_layers < 1 or num_captured < 1:
        raise ValueError(
            f"{NUM_FLAG} and the target's layer count must be >= 1, got {num_captured}, {num_target_layers}"
        )
    if num_captured == 1:
        return [num_target_layers // 2]
    if num_captured > max_captured_layers(num_target_layers):
        raise ValueError(too_many_taps_message(num_target_layers, num_captured))
    span = num_target_layers - 4
    return [round(1 + i * span / (num_captured - 1)) for i in range(num_captured)]


def suggested_ids(num_target_layers: int, count: int) -> list[int] | None:
    """``count`` distinct ids that fit the target: the default spread where it fits, else spread
    evenly over ids ``0..L-2``; None if the target has fewer than ``count`` layers to tap."""
    if count <= max_captured_layers(num_target_layers):
        return default_target_layer_ids(num_target_layers, count)
    usable = num_target_layers - 1  # ids 0..L-2: not the final-norm output
    if count > usable:
        return None
    return [round(i * (usable - 1) / (count - 1)) for i in range(count)]


def _ids_text(ids: list[int]) -> str:
    return ",".join(map(str, ids))


def too_many_taps_message(num_target_layers: int, num_captured: int) -> str:
    """Why ``num_captured`` default taps do not fit an ``num_target_layers``-layer target, and what does."""
    most = max_captured_layers(num_target_layers)
    message = (
        f"{NUM_FLAG} {num_captured}: the default spread taps at most {most} distinct layer(s) of this "
        f"{num_target_layers}-layer target; pass {NUM_FLAG} {most}"
    )
    ids = suggested_ids(num_target_layers, num_captured)
    if ids is not None:
        return message + f", or choose the layers yourself: {IDS_FLAG} {_ids_text(ids)}"
    return message + f" (it has {num_target_layers - 1} layer(s) to tap besides the final-norm output)"


def check_taps(num_target_layers: int, *, layer_ids: list[int] | None, num_captured: int) -> list[int]:
    """The layer ids the drafter will tap (``layer_ids``, or the default spread of ``num_captured``),
    checked against a target of ``num_target_layers`` decoder layers.

    Raises:
        ValueError: too many default taps, or explicit ids empty, repeated or out of range; the
            message names the flag and the values that work.
    """
    if layer_ids is None:
        return default_target_layer_ids(num_target_layers, num_captured)
    bad = [k for k in layer_ids if not 0 <= k < num_target_layers]
    if bad or not layer_ids or len(set(layer_ids)) != len(layer_ids):
        example = suggested_ids(num_target_layers, max(1, len(layer_ids))) or suggested_ids(num_target_layers, 1)
        raise ValueError(
            f"{IDS_FLAG} {_ids_text(layer_ids)}: each id must be in [0, {num_target_layers}) and appear "
            f"once for this {num_target_layers}-layer target (id {num_target_layers - 1} is the final-norm "
            f"output), e.g. {IDS_FLAG} {_ids_text(example)}"
        )
    return list(layer_ids)

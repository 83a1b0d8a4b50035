"""What makes a drafter checkpoint load the same under every transformers version and serving engine.

``config.json``: transformers 5 writes RoPE as ``rope_parameters``; transformers 4.x loaders
(z-lab/dflash pins 4.57.1; vLLM copies the ``rope_theta`` attribute when transformers < 5) read
top-level ``rope_theta``/``rope_scaling`` and fall back to 10000 without them, which for a Qwen3
drafter (base 1e6) silently collapses acceptance. SGLang reads ``rope_parameters`` first. So the
config carries both forms. Comparing a Qwen3Config that transformers 4.57.1 reads from a 5.x
``config.json`` with one 4.57.1 builds natively from the same values, field by field, RoPE is the
only difference (``dtype`` is already spelled the same in both), so no other key is duplicated.

``auto_map`` + ``modeling_dflash.py``: ``AutoModel.from_pretrained(path, trust_remote_code=True)``
(the loading path z-lab's README shows) builds a plain Qwen3Model, with missing and unexpected
weights, unless the folder names its own classes. The config class is mapped too, so that loading
registers the drafter for that class only and never for the stock Qwen3Config (transformers
registers the remote model class under the config's class for the rest of the process).
"""

from __future__ import annotations

from importlib import resources

import torch

from dflash.drafter.modeling_dflash import legacy_rope

#: The self-contained modeling file, copied into every checkpoint under this name.
MODELING_FILE = "modeling_dflash.py"

#: ``config.json`` ``auto_map``: what ``trust_remote_code=True`` loading builds.
AUTO_MAP = {
    "AutoConfig": "modeling_dflash.DFlashDraftConfig",
    "AutoModel": "modeling_dflash.DFlashDraftModel",
    "AutoModelForCausalLM": "modeling_dflash.DFlashDraftModel",
}


def rope_parameters_of(config: dict) -> dict:
    """The RoPE settings of a config dict in the transformers 5 form, from either form.

    A top-level ``rope_theta`` is what transformers 4.x configs carry natively (and what the
    installed 4.x runs with), so it wins; 5.x configs have only ``rope_parameters``.

    Args:
        config (dict): ``PretrainedConfig.to_dict()`` of a 4.x or 5.x config, or a ``config.json``.

    Returns:
        dict: ``{"rope_type": ..., "rope_theta": float, <scaling fields>}``.

    Raises:
        ValueError: neither ``rope_theta`` nor a flat ``rope_parameters`` with ``rope_theta``.
    """
    if config.get("rope_theta") is not None:
        scaling = dict(config.get("rope_scaling") or {})
        rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
        return {"rope_type": rope_type, **scaling, "rope_theta": float(config["rope_theta"])}
    params = config.get("rope_parameters")
    if not isinstance(params, dict) or "rope_theta" not in params:
        raise ValueError(
            f"config has no RoPE base: neither rope_theta nor a flat rope_parameters with rope_theta "
            f"(rope_parameters={params!r}); pass a config of a RoPE decoder (Qwen3, Llama)"
        )
    return dict(params)


#: RoPE fields of a target that a drafter never carries: M-RoPE (Qwen3.5/3.6, Qwen2.5-VL) and partial
#: rotary. The drafter rotates all of head_dim along one position axis; vLLM's DFlash proposer refuses
#: a drafter config with M-RoPE fields, and an engine honouring ``partial_rotary_factor`` would rotate
#: a quarter of head_dim of a drafter trained on all of it (acceptance 5.75 -> 1.37, issue 22).
TARGET_ONLY_ROPE_FIELDS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")


def drafter_rope_parameters(target_config: dict) -> dict:
    """The RoPE a drafter of this target uses, in the transformers 5 form: the target's type, base
    and real scaling (YaRN, linear, ...), without :data:`TARGET_ONLY_ROPE_FIELDS`; M-RoPE
    (``rope_type`` "mrope" in 4.x configs) becomes plain RoPE.

    Args:
        target_config (dict): the target's (text) config, ``to_dict()`` or ``config.json``.

    Returns:
        dict: ``{"rope_type": ..., "rope_theta": float, <scaling fields>}``.

    Raises:
        ValueError: the target has no RoPE base (see :func:`rope_parameters_of`).
    """
    rope = {k: v for k, v in rope_parameters_of(target_config).items() if k not in TARGET_ONLY_ROPE_FIELDS}
    if rope.get("rope_type") == "mrope":
        rope["rope_type"] = "default"
    return rope


def portable_config(config: dict, *, dtype: torch.dtype | None) -> dict:
    """``config`` with the keys every loader needs: RoPE in both forms, ``auto_map``, ``dtype``
    (``layer_types``, ``sliding_window``, ``use_sliding_window`` and ``max_window_layers`` are Qwen3
    fields every config dict carries), and the drafter's causality as every engine reads it.

    Causality: a config without ``is_causal`` (the published drafters') has causal sliding layers
    and bidirectional full layers in vLLM, SGLang, TensorRT-LLM and z-lab/dflash, and so in
    :class:`~dflash.drafter.modeling_dflash.DFlashDraftConfig`; such a config gets neither key. One that
    deviates (``is_causal`` true or false: every layer alike) gets both ``is_causal`` and
    ``dflash_config.causal``: vLLM before #52816 reads only the latter, later vLLM, SGLang and
    z-lab the former.

    Args:
        config (dict): the drafter config (``DFlashDraftConfig.to_diff_dict()`` of 4.x or 5.x).
        dtype (torch.dtype, optional): dtype of the saved weights (``dtype="auto"`` loads in it);
            None leaves ``dtype`` as it is in ``config``.

    Returns:
        dict: a new dict for ``config.json``.

    Raises:
        ValueError: ``config`` has no RoPE base (see :func:`rope_parameters_of`).
    """
    rope = rope_parameters_of(config)
    rope_theta, rope_scaling = legacy_rope(rope)
    dflash_config = {k: v for k, v in (config.get("dflash_config") or {}).items() if k != "causal"}
    causal = config.get("is_causal")
    if causal is None:  # a dict whose is_causal was left out as a default keeps it here
        causal = (config.get("dflash_config") or {}).get("causal")
    out = {
        **{k: v for k, v in config.items() if k not in ("is_causal", "dflash_config")},
        "rope_parameters": rope,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        # DFlash2's own name selects its convolution and selector in z-lab's loader and vLLM's.
        "architectures": list(config.get("architectures") or ["DFlashDraftModel"]),
        "auto_map": dict(AUTO_MAP),
    }
    if causal is not None:
        out |= {"is_causal": causal, "dflash_config": {**dflash_config, "causal": causal}}
    elif "dflash_config" in config:
        out["dflash_config"] = dflash_config
    if dtype is not None:
        out["dtype"] = str(dtype).removeprefix("torch.")
    return out


def modeling_source() -> bytes:
    """Bytes of ``dflash/drafter/modeling_dflash.py`` as installed (written into each checkpoint)."""
    return resources.files("dflash.drafter").joinpath(MODELING_FILE).read_bytes()

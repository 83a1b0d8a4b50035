"""``dflash export``: a serving-ready drafter directory from a run's checkpoint.

What each engine needs, and where it is written (``docs/dflash.md``, :mod:`dflash.drafter.hf_config`):

- the weights in bf16 by default (published drafters are; SGLang's ``--dtype auto`` would serve a
  float32 drafter as fp16 next to a bf16 target), checked against the config first
  (:mod:`dflash.drafter.files`): an export is a complete drafter or nothing;
- ``config.json`` with RoPE in both transformers forms, ``layer_types`` / ``sliding_window`` /
  ``is_causal``, ``dflash_config``, ``block_size``, ``auto_map``; ``modeling_dflash.py`` for
  ``trust_remote_code``; ``manifest.json`` so ``dflash eval`` verifies what it reads;
- a directory name containing ``dflash``: vLLM recognises a DFlash drafter from its path;
- ``README.md`` with the vLLM and SGLang launch lines (vLLM ignores ``block_size``:
  ``num_speculative_tokens = block_size - 1``; SGLang drafts ``--speculative-num-draft-tokens =
  block_size``) and the acceptance measured for that checkpoint (:mod:`dflash.run.acceptance_log`),
  unless it was measured while verification was wrong (a float32 mismatch against greedy decoding).

The directory is written next to its final place and renamed into it, so it is never half there.
Importing this module loads neither torch nor transformers: a path mistake is refused before they load.
"""

from __future__ import annotations

import json
import logging
import shlex
import shutil
from pathlib import Path
from typing import Literal

from dflash.assets import default_target_dir
from dflash.drafter.files import DRAFTER_FILES, check_tensors, read_drafter_config
from dflash.run import acceptance_log
from dflash.run.layout import ACCEPTANCE_NAME, SAVED_CONFIG_NAME, read_saved_config, run_of
from dflash.run.step_dirs import find_checkpoint

logger = logging.getLogger(__name__)

README_NAME = "README.md"
#: ``--dtype`` of ``dflash export``: the exported floating weights' (published drafters are bf16).
ExportDtype = Literal["bfloat16", "float16", "float32"]


def export(run: str | Path, out: str | Path, *, dtype: ExportDtype) -> Path:
    """Write the newest checkpoint of ``run`` (or the step directory ``run``) as a drafter in ``out``.

    Args:
        run: a run directory (``--out`` of ``dflash train``), its ``checkpoints/`` or a step directory.
        out: the new directory; its name must contain ``dflash``; it must not exist (or be empty).
        dtype (ExportDtype): of the floating weights.

    Returns:
        Path: ``out``.

    Raises:
        ValueError: ``out``'s name lacks ``dflash``, ``out`` holds files, or ``out`` lies inside the run
            (or the drafter directory) exported: each before torch loads.
        CheckpointError: no checkpoint in ``run`` (before torch loads), a corrupt file, or weights that
            disagree with their config (named), before anything is written.
    """
    out = Path(out)
    step_dir, run_dir = _checked_paths(run, out)
    import torch
    from safetensors.torch import load_file

    from dflash.run.checkpoint import write_drafter_files

    config = read_drafter_config(step_dir)
    check_tensors(step_dir, config)
    weights = load_file(str(step_dir / "model.safetensors"))
    readme = serving_readme(config, out=out, target=_trained_target(run_dir), step_dir=step_dir, dtype=dtype)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write_drafter_files(tmp, weights=weights, drafter_config=config.to_diff_dict(), dtype=getattr(torch, dtype))
        (tmp / README_NAME).write_text(readme)
        if out.exists():
            out.rmdir()  # empty, checked above
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _checked_paths(run: str | Path, out: Path) -> tuple[Path, Path | None]:
    """``(step directory, its run directory or None)`` of ``run``, checked with ``out`` without torch.

    Raises:
        ValueError, CheckpointError: see :func:`export`.
    """
    if "dflash" not in out.name.lower():
        raise ValueError(
            f"--out {out}: vLLM recognises a DFlash drafter by 'dflash' in its path; name the directory so, "
            f"e.g. {out.with_name(out.name + '-dflash')}"
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} already exists and is not empty; choose a new directory (nothing was written)")
    step_dir = find_checkpoint(run, files=DRAFTER_FILES)
    run_dir = run_of(step_dir)
    source = (run_dir or step_dir).resolve()
    if out.resolve().is_relative_to(source):
        raise ValueError(
            f"--out {out} is inside {source}, which dflash train --resume and dflash eval read (a directory of "
            f"other files there stops a resume); export beside it, e.g. --out {source.parent / out.name} "
            "(nothing was written)"
        )
    return step_dir, run_dir


def _trained_target(run_dir: Path | None) -> str:
    """The target the run trained against (its train_config.json), for the launch lines."""
    target = read_saved_config(run_dir).get("target") if run_dir is not None else None
    if target:
        return target
    if run_dir is not None and (run_dir / SAVED_CONFIG_NAME).is_file():
        return str(default_target_dir())  # trained on the embedded default target
    return "TARGET"


def serving_readme(config, *, out: Path, target: str, step_dir: Path, dtype: ExportDtype) -> str:
    """The README of an exported drafter: what it is, its measured acceptance, how to serve it."""
    from dflash.drafter.modeling_dflash import DFLASH2_FIELDS

    block = config.block_size
    # The lines name both models relatively: the training host's paths mean nothing where it is served.
    target_name = Path(target).name
    draft_path, target_path = shlex.quote(out.name), shlex.quote(target_name)
    kinds = list(dict.fromkeys(config.layer_types))
    layers = ", ".join(f"{config.layer_types.count(k)} x {k}" for k in kinds)
    window = f"; sliding window {config.sliding_window}" if "sliding_attention" in kinds else ""
    speculative = json.dumps({"method": "dflash", "model": out.name, "num_speculative_tokens": block - 1})
    # vLLM serves a drafter mixing sliding and full layers, and DFlash2's selector (PR #52816), only
    # with its V2 model runner.
    v2 = "VLLM_USE_V2_MODEL_RUNNER=1 " if len(kinds) > 1 or config.is_dflash2 else ""
    heads = f"{config.num_attention_heads} heads, {config.num_key_value_heads} KV heads, head dim {config.head_dim}"
    what = "A DFlash drafter (block diffusion speculative decoding, arXiv 2602.06036)"
    extra = ""
    if config.is_dflash2:
        what = "A DFlash2 drafter (DFlash with grouped dynamic convolutions and a top-K candidate selector)"
        taps, group, rank, top_k = (config.dflash2_value(name) for name in DFLASH2_FIELDS)
        extra = f"\n- convolutions of {taps} taps, {group} channels per coefficient; selector rank {rank}, top {top_k}"
    if config.transforms:
        extra += f"\n- logit and embedding transforms (z-lab's `dflash_config` fields): {json.dumps(config.transforms)}"
    return f"""# {out.name}

{what} for `{target}`,
exported by `dflash export` from `{step_dir}`.

- {config.num_hidden_layers} layer{"" if config.num_hidden_layers == 1 else "s"}: {layers}{window}
- block size {block}; {heads}{extra}
- taps target layers {config.target_layer_ids}; mask token {config.mask_token_id}
- {dtype} weights

## Measured acceptance

{_measured(step_dir)}

## Serve it

Run these from the directory that holds `{out.name}`, with `{target_name}` the target's directory (or
Hub id) on the serving host.

vLLM (it ignores `block_size`: `num_speculative_tokens` = block size - 1 = {block - 1}):

```bash
{v2}vllm serve {target_path} \\
  --speculative-config {shlex.quote(speculative)}
```

SGLang (drafts `--speculative-num-draft-tokens` = block size = {block} tokens per step){_sglang_caveat(config)}:

```bash
python -m sglang.launch_server --model-path {target_path} \\
  --speculative-algorithm DFLASH --speculative-draft-model-path {draft_path} \\
  --speculative-num-draft-tokens {block} --trust-remote-code
```

transformers: `AutoModel.from_pretrained({out.name!r}, trust_remote_code=True)`;
`dflash eval --drafter {draft_path} --target {target_path}` measures it again.
"""


def _sglang_caveat(config) -> str:
    """What SGLang serves differently from this drafter, for the README (and the log)."""
    if "input_embedding_scale" not in config.transforms:
        return ""
    # SGLang 0.5.19's DFlash worker scales the block's embeddings only by a factor the target model
    # defines (get_dflash_noise_embedding_scale), never by the drafter's input_embedding_scale.
    logger.warning(
        "dflash_config.input_embedding_scale %s: SGLang 0.5.19 does not apply it (vLLM 0.34 and z-lab's reference do); "
        "serve this drafter with vLLM",
        config.dflash_config["input_embedding_scale"],
    )
    return (
        ", but not as trained: SGLang 0.5.19 does not apply this drafter's `input_embedding_scale` "
        "(vLLM 0.34 does); serve it with vLLM"
    )


def _decoding(measurement: dict) -> str:
    """``greedy`` or ``sampled at temperature 1, top-p 0.9``: how a measurement chose tokens
    (:meth:`dflash.evaluation.report.EvalReport.to_dict`; entries from before sampling are greedy)."""
    decoding = measurement.get("decoding", "greedy")
    return decoding if decoding == "greedy" else f"sampled at {decoding}"


def _measured(step_dir: Path) -> str:
    """The most complete acceptance measurement kept for this checkpoint in its run's acceptance.json
    (:func:`dflash.run.acceptance_log.most_complete_for`), in words, with its 95% intervals when it
    decoded a sample of the held-out prompts."""
    run_dir = run_of(step_dir) or step_dir
    found = acceptance_log.most_complete_for(run_dir, step_dir.name)
    if found is None:
        return (
            f"Not measured: run `dflash eval --drafter {shlex.quote(str(run_dir))}` on held-out conversations "
            "and export again."
        )
    if found.get("mismatches") and found.get("dtype", "float32") == "float32":
        logger.warning(
            "%s: the acceptance kept for %s was measured while %d/%d speculative outputs differed from greedy "
            "decoding in float32; the README does not quote it",
            run_dir / ACCEPTANCE_NAME,
            step_dir.name,
            found["mismatches"],
            found["num_prompts"],
        )
        return (
            f"Not quoted: the measurement kept for this checkpoint ({found['source']}) was wrong ({found['mismatches']}"
            f"/{found['num_prompts']} speculative outputs differed from greedy decoding in float32); run `dflash eval "
            f"--drafter {shlex.quote(str(run_dir))}` again and export again."
        )
    intervals = found.get("intervals") or {}

    def interval(name: str, digits: int = 3) -> str:
        low, high = intervals.get(name, (None, None))
        return "" if low is None else f" [{low:.{digits}f}, {high:.{digits}f}]"

    if _decoding(found) != "greedy":
        # A sampled measurement has intervals whether or not it decoded every prompt: its draws are a sample too.
        prompts = f"{found['num_prompts']} held-out prompts (95% bootstrap intervals over prompts)"
    elif intervals:
        prompts = f"a random sample of {found['num_prompts']} held-out prompts (95% bootstrap intervals over prompts)"
    else:
        prompts = f"all {found['num_prompts']} usable held-out prompts"
    return (
        f"Acceptance length tau {found['tau_per_prompt']:.3f}{interval('tau_per_prompt')} per prompt (z-lab's "
        f"convention, as its benchmark counts it) and {found['tau_per_step']:.3f}{interval('tau_per_step')} per step, "
        f"{_decoding(found)}, on {prompts} of `{found['data']}` ({found['max_new_tokens']} new tokens each); "
        f"speedup over target-only decoding {found['speedup']:.2f}x{interval('speedup', 2)} on the machine it was "
        f"measured on ({found['source']}; the most complete of the {_count(run_dir, step_dir.name)} kept for "
        "this checkpoint)."
    )


def _count(run_dir: Path, checkpoint: str) -> str:
    n = sum(m.get("checkpoint") == checkpoint for m in acceptance_log.read(run_dir))
    return "one measurement" if n == 1 else f"{n} measurements"

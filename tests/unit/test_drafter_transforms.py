"""z-lab's DFlash2 transforms (``dflash_config`` ``output_multiplier``, ``final_logit_softcapping``,
``input_embedding_scale``; z-lab/dflash 07ebd93 ``compute_logits`` and ``dflash_generate``) in the
drafter: the draft logits and the selector's path in decoding, the block's embeddings in training
and decoding, the training loss with its selector, ``dflash train --init-from`` / ``eval`` /
``export`` of a drafter with z-lab's fixture's transforms, and nothing done at the identity.
Equality with z-lab's reference itself: tests/integration/test_zlab_dflash2.py."""

from __future__ import annotations

import copy
import json

import torch
import torch.nn.functional as F
from tiny import loss_settings, make_target, micro_batch, random_heads, step_settings, tiny_drafter, write_chat_data
from torch.utils._python_dispatch import TorchDispatchMode

from dflash.drafter.model import AnchoredDrafter
from dflash.drafter.modeling_dflash import DFlashDraftConfig, LogitTransform
from dflash.train import loss as L

#: z-lab/dflash 07ebd93 ``tests/fixtures/dflash2-config.json``'s transforms (1 / sqrt(26) and 20).
FIXTURE = {"output_multiplier": 0.19611613513818404, "final_logit_softcapping": 20.0}


def _with_transforms(drafter, **transforms) -> AnchoredDrafter:
    """``drafter``'s weights under its config with ``transforms`` added to ``dflash_config``."""
    fields = {k: v for k, v in drafter.config.to_dict().items() if k != "model_type"}
    fields["dflash_config"] = {**drafter.config.dflash_config, **transforms}
    model = AnchoredDrafter._from_config(DFlashDraftConfig(**fields), attn_implementation="sdpa").eval()
    model.load_state_dict(drafter.state_dict())
    return model


def _random_dflash2(seed: int = 0) -> AnchoredDrafter:
    """A tiny DFlash2 drafter with every weight random (the selector's codebooks included)."""
    drafter = tiny_drafter(arch="dflash2", seed=seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if name.endswith("norm.weight") else torch.randn_like(p) * 0.3)
    return drafter


def _block(seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    context, block = torch.randn(1, 9, 3 * 32, generator=gen), torch.randn(1, 4, 32, generator=gen)
    head = torch.nn.Linear(32, 64, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(64, 32, generator=gen) * 8)  # logits of tens: the cap bends them
    return context, block, head


def test_draft_logits_and_the_selectors_path_follow_the_fixtures_transform():
    """z-lab's ``compute_logits``: the head's logits times the multiplier, then capped, in that order;
    the selector takes its candidates and unary scores from them."""
    plain = _random_dflash2()
    shaped = _with_transforms(plain, **FIXTURE)
    context, block, head = _block()
    m, c = FIXTURE["output_multiplier"], FIXTURE["final_logit_softcapping"]
    with torch.no_grad():
        hidden = shaped.block_hidden(context, block)[:, 1:]
        raw = head(hidden)
        assert raw.abs().max() * m > c  # in the cap's bend, so the order of the two matters
        logits = shaped.compute_logits(hidden, head)
        torch.testing.assert_close(logits, torch.tanh(raw * m / c) * c, rtol=0, atol=0)
        path = shaped.draft_block(context, block, head, torch.tensor([5]))
        assert torch.equal(path, shaped.candidate_selector.walk(hidden, logits, torch.tensor([5])))
        assert not torch.equal(path, plain.draft_block(context, block, head, torch.tensor([5])))


def test_the_blocks_embeddings_are_scaled_in_training_and_decoding():
    """``input_embedding_scale`` multiplies the draft block's embeddings (anchor and mask slots), as
    z-lab's loop and vLLM's ``embed_input_ids`` do; the context is hidden states and is not scaled."""
    plain = _random_dflash2()
    scaled = _with_transforms(plain, input_embedding_scale=2.5)
    context, block, _ = _block()
    with torch.no_grad():
        torch.testing.assert_close(scaled.block_hidden(context, block), plain.block_hidden(context, block * 2.5))
        assert not torch.allclose(scaled.block_hidden(context, block), plain.block_hidden(context, block))
        anchors = torch.tensor([[0, 4]])
        embeds = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(2))
        torch.testing.assert_close(scaled(embeds, context, anchors), plain(embeds * 2.5, context, anchors))


def _written_out_loss(hidden, weight, labels, label_mask, slot_weights, selector, predecessors, transform):
    """The DFlash2 loss (decay weights, ``insert``) written out over whole logits with autograd."""
    logits = transform((hidden @ weight.t()).float()).view(*labels.shape, -1)
    ce = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="none").view_as(labels)
    weights = slot_weights * label_mask
    candidates = logits.topk(selector.top_k, dim=-1).indices
    found = (candidates == labels[..., None]).any(-1, keepdim=True)
    candidates = torch.where(found, candidates, torch.cat([candidates[..., :-1], labels[..., None]], -1))
    unary = logits.gather(-1, candidates)
    rows = hidden.view(*labels.shape, -1)
    scores = selector.scores(rows, unary, candidates, predecessors).float()
    gold = (candidates == labels[..., None]).float().argmax(-1)
    selected = F.cross_entropy(scores.flatten(0, -2), gold.flatten(), reduction="none").view_as(labels)
    return (weights * ce).sum() + 0.5 * (weights * selected).sum()


def test_the_dflash2_loss_with_transforms_equals_the_loss_written_out():
    """The chunked loss (any chunking) takes the drafter's logits after the transform: its
    cross-entropy, the selector's candidates, their unary scores and every gradient."""
    selector = _random_dflash2().candidate_selector
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 5 * 4, 32, generator=gen).requires_grad_(True)
    weight = torch.randn(64, 32, generator=gen) * 2
    labels = torch.randint(0, 64, (2, 5, 4), generator=gen)
    label_mask = torch.rand(2, 5, 4, generator=gen) < 0.8
    label_mask[..., 0] = False
    predecessors = torch.randint(0, 64, (2, 5, 4), generator=gen)
    settings = {"block_size": 4, "gamma": 2.0, "selector_loss_weight": 0.5, "selector_missing_gold": "insert"}
    slot_weights = loss_settings(**settings).position_weight("cpu")
    transform = LogitTransform(0.7, 3.0)  # logits of about +-10: far into the cap's bend
    reference = _written_out_loss(hidden, weight, labels, label_mask, slot_weights, selector, predecessors, transform)
    expected = torch.autograd.grad(reference, [hidden, *selector.parameters()])
    inputs = (hidden, weight, labels, label_mask, slot_weights)
    for chunk_blocks in (1, 3, 10):
        out = L.dflash_loss(
            *inputs,
            loss_settings(**settings, loss_chunk_blocks=chunk_blocks),
            selector=selector,
            predecessors=predecessors,
            logit_transform=transform,
        )
        torch.testing.assert_close(out.loss_sum, reference, rtol=1e-5, atol=1e-5)
        for got, want in zip(torch.autograd.grad(out.loss_sum, [hidden, *selector.parameters()]), expected):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    without = L.dflash_loss(*inputs, loss_settings(**settings), selector=selector, predecessors=predecessors)
    assert (without.loss_sum - reference).abs() > 1.0


def _step(drafter, heads, seed: int = 4, step_fn=None):
    """One training step's statistics (:class:`dflash.train.step.StatsLayout`), gradients accumulated."""
    from dflash.train.step import drafter_forward_loss, drafter_step

    settings = step_settings()
    batch, anchors, valid = micro_batch(drafter, seed)
    weight = settings.position_weight("cpu")
    step_fn = step_fn or drafter_forward_loss
    return drafter_step(step_fn, drafter, heads, batch, anchors, valid, settings=settings, position_weight=weight)


def test_the_training_step_applies_the_drafters_transforms():
    """A multiplier m is the head times m and an embedding scale s the embedding times s, selector
    included: the step reads both from the drafter's config."""
    plain = _random_dflash2()
    shaped = _with_transforms(plain, output_multiplier=0.6, input_embedding_scale=1.7)
    heads = random_heads(plain.config)
    ours = _step(shaped, heads)
    with torch.no_grad():
        heads.lm_head.weight.mul_(0.6)
        heads.embed_tokens.weight.mul_(1.7)
    scaled = _step(plain, heads)
    torch.testing.assert_close(ours, scaled, rtol=1e-5, atol=1e-5)  # losses, the selector's, correct counts
    for (name, p), q in zip(shaped.named_parameters(), plain.parameters()):
        # Rounding apart (logits times m, or the head's rows times m): relative to the largest entry.
        assert (p.grad - q.grad).abs().max() <= 1e-5 * q.grad.abs().max(), name


def test_the_compiled_step_of_a_drafter_with_transforms_is_the_eager_step():
    """The regional compile (:mod:`dflash.train.regions`: layers, loss chunks, the selector's loss)
    takes the transforms as the eager step does."""
    from dflash.train.regions import compile_step

    eager = _with_transforms(_random_dflash2(), **FIXTURE, input_embedding_scale=1.3).train()
    regional = copy.deepcopy(eager)
    heads = random_heads(eager.config)
    step_fn, _ = compile_step("regional", 960, "aot_eager")
    torch.testing.assert_close(_step(regional, heads, step_fn=step_fn), _step(eager, heads), rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(eager.named_parameters(), regional.parameters()):
        assert (p.grad - q.grad).abs().max() <= 1e-5 * p.grad.abs().max(), name


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _ops(drafter, heads) -> list[str]:
    context, block, head = _block()
    with _Ops() as recorded:
        drafter.draft_block(context, block, head, torch.tensor([5]))
        _step(drafter, heads)
    return recorded.ops


def test_transforms_at_their_identity_add_no_operation():
    """The published Qwen drafters set none; a config spelling out the identity (multiplier 1, cap 0
    or null, scale 1) runs the very same operations in decoding and in a training step."""
    plain = _random_dflash2()
    heads = random_heads(plain.config)
    baseline = _ops(plain, heads)
    for identity in (
        {"output_multiplier": 1.0, "final_logit_softcapping": None, "input_embedding_scale": 1.0},
        {"output_multiplier": 1, "final_logit_softcapping": 0},
    ):
        assert _ops(_with_transforms(plain, **identity), heads) == baseline
    assert len(_ops(_with_transforms(plain, **FIXTURE), heads)) > len(baseline)


def test_a_drafter_with_zlabs_transforms_fine_tunes_evaluates_and_exports(tmp_path, capsys):
    """``dflash train --init-from`` a DFlash2 directory whose config carries z-lab's fixture's
    transforms (and an embedding scale), then ``dflash eval`` (speculative output equal to greedy)
    and ``dflash export``: the checkpoint and the export keep all three."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from dflash.cli import main
    from dflash.drafter.model import create_drafter_config

    target, data = make_target(tmp_path / "target", num_layers=5), write_chat_data(tmp_path / "chats.jsonl")
    transforms = {**FIXTURE, "input_embedding_scale": 1.5}
    config = create_drafter_config(
        AutoConfig.from_pretrained(target),
        1,
        block_size=4,
        target_layer_ids=[1, 3],
        mask_token_id=3,
        intermediate_size=48,
        arch="dflash2",
    )
    raw = {k: v for k, v in config.to_dict().items() if k not in ("block_size", "auto_map")}
    raw["dflash_config"] |= transforms
    published = tmp_path / "Tiny-DFlash2"
    published.mkdir()
    (published / "config.json").write_text(json.dumps(raw))
    torch.manual_seed(4)
    weights = AnchoredDrafter._from_config(config).state_dict()
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()}, str(published / "model.safetensors"))

    run = tmp_path / "run"
    flags = ["--target", str(target), "--data", str(data), "--out", str(run), "--init-from", str(published)]
    flags += ["--arch", "dflash2", "--steps", "2", "--seq-len", "48", "--batch-size", "2", "--max-anchors", "4"]
    flags += ["--gamma", "2", "--save-every", "2", "--eval-prompts", "1", "--eval-max-new-tokens", "4"]
    assert main(["train", *flags, "--cpu-threads", "1", "--no-progress"]) == 0
    saved = json.loads((run / "checkpoints" / "step_00000002" / "config.json").read_text())
    assert {k: saved["dflash_config"][k] for k in transforms} == transforms
    capsys.readouterr()
    argv = ["eval", "--drafter", str(run), "--data", str(data), "--device", "cpu", "--cpu-threads", "1"]
    assert main([*argv, "--num-prompts", "2", "--max-new-tokens", "10", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mismatches"] == 0 and report["num_prompts"] == 2
    exported = tmp_path / "tiny-dflash2"
    assert main(["export", str(run), "--out", str(exported)]) == 0
    served = json.loads((exported / "config.json").read_text())
    assert {k: served["dflash_config"][k] for k in transforms} == transforms
    assert "SGLang 0.5.19 does not apply this drafter's `input_embedding_scale`" in (exported / "README.md").read_text()

"""Chunked loss, position weights, soft labels and D-PACE (dflash/train/loss.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from tiny import loss_settings

from dflash import masks
from dflash.drafter.modeling_dflash import LogitTransform
from dflash.train import loss as L

B, N, BS, H, V, S = 2, 5, 4, 16, 40, 22


def _settings(**flags):
    """The loss settings of a run with block size BS, gamma 2 and ``flags`` (TrainConfig field names)."""
    return loss_settings(block_size=BS, gamma=2.0, **flags)


def _loss(hidden, weight, labels, label_mask, **flags):
    settings = _settings(**flags)
    return L.dflash_loss(hidden, weight, labels, label_mask, settings.position_weight("cpu"), settings)


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, N * BS, H, generator=gen).requires_grad_(True)
    weight = torch.randn(V, H, generator=gen)
    input_ids = torch.randint(0, V, (B, S), generator=gen)
    loss_mask = torch.rand(B, S, generator=gen) < 0.8
    anchors, valid = masks.sample_anchors(loss_mask, N, generator=gen)
    labels, label_mask = masks.build_labels(input_ids, loss_mask, anchors, valid, BS)
    teacher = torch.randn(B, S, H, generator=gen)
    return hidden, weight, labels, label_mask, anchors, teacher


def _reference(
    hidden,
    weight,
    labels,
    label_mask,
    slot_weights,
    *,
    soft=0.0,
    teacher_rows=None,
    dpace=False,
    alpha=0.5,
    transform=lambda logits: logits,
):
    """Unchunked loss written out directly: full logits for every draft slot at once (the drafter's
    after ``transform``, the teacher's as they are)."""
    logits = transform((hidden @ weight.t()).float()).view(B, N, BS, V)
    log_probs = logits.log_softmax(-1)
    ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view(B, N, BS)
    token = ce
    if soft:
        t = (teacher_rows @ weight.t()).float().log_softmax(-1)
        kl = F.kl_div(log_probs, t, log_target=True, reduction="none").sum(-1)
        token = (1 - soft) * ce + soft * kl
    if dpace:  # SpecForge / speculators: smoothed confidences, unsupervised slots pass through
        c = torch.where(label_mask, (1 - alpha) * (-ce).exp().detach() + alpha, 1.0)
        w = torch.zeros(B, N, BS)
        for k in range(BS):
            w[..., k] = sum(torch.prod(c[..., : j + 1], dim=-1) * label_mask[..., j] for j in range(k, BS))
        normaliser = label_mask.sum().float()
    else:
        w = slot_weights.expand(B, N, BS)
        normaliser = (w * label_mask).sum()
    w = w * label_mask
    correct = ((logits.argmax(-1) == labels) & label_mask).sum((0, 1))
    return (w * token).sum(), normaliser, correct


@pytest.mark.parametrize("transform", [None, LogitTransform(0.7, 3.0)], ids=["plain", "transformed"])
@pytest.mark.parametrize("chunk_blocks", [1, 3, 100])
@pytest.mark.parametrize("mode", ["decay", "soft", "dpace"])
def test_chunked_loss_equals_unchunked_reference(chunk_blocks, mode, transform):
    """``transform``: a DFlash2 drafter's logit transform (z-lab's multiplier and cap), in its bend here."""
    hidden, weight, labels, label_mask, anchors, teacher = _inputs()
    soft = 0.3 if mode == "soft" else 0.0
    alpha = 0.3
    settings = _settings(
        loss_chunk_blocks=chunk_blocks, dpace=mode == "dpace", dpace_alpha=alpha, soft_label_weight=soft
    )
    slot_weights = settings.position_weight("cpu")
    out = L.dflash_loss(
        hidden,
        weight,
        labels,
        label_mask,
        slot_weights,
        settings,
        teacher_hidden=teacher,
        anchors=anchors,
        logit_transform=transform,
    )
    (grad,) = torch.autograd.grad(out.loss_sum, hidden)

    # Teacher for slot k of anchor a: the target's state at a + k - 1 (it predicts x[a + k]).
    pos = (anchors[:, :, None] + torch.arange(BS) - 1).clamp(0, S - 1)
    teacher_rows = teacher[torch.arange(B)[:, None, None], pos]
    ref_loss, ref_weight, ref_correct = _reference(
        hidden,
        weight,
        labels,
        label_mask,
        slot_weights,
        soft=soft,
        teacher_rows=teacher_rows,
        dpace=mode == "dpace",
        alpha=alpha,
        **({"transform": transform} if transform else {}),
    )
    (ref_grad,) = torch.autograd.grad(ref_loss, hidden)
    torch.testing.assert_close(out.loss_sum, ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.weight_sum, ref_weight, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)
    assert torch.equal(out.correct, ref_correct)
    assert torch.equal(out.total, label_mask.sum((0, 1)))
    assert out.total[0] == 0 and out.correct[0] == 0  # slot 0 is never supervised


def test_soft_labels_against_an_exact_teacher_give_zero_kl():
    hidden, weight, _, _, _, _ = _inputs()
    # Blocks BS apart, so no two supervised slots share a teacher position a + k - 1.
    anchors = (torch.arange(N) * BS).expand(B, N).contiguous()
    valid = torch.ones(B, N, dtype=torch.bool)
    input_ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(5))
    labels, label_mask = masks.build_labels(input_ids, torch.ones(B, S, dtype=torch.bool), anchors, valid, BS)
    # Teacher = the drafter's own hidden state at each slot: KL(p || p) = 0 wherever supervised.
    teacher = torch.zeros(B, S, H)
    for b in range(B):
        for n in range(N):
            for k in range(1, BS):
                if label_mask[b, n, k]:
                    teacher[b, int(anchors[b, n]) + k - 1] = hidden[b, n * BS + k].detach()
    settings = _settings(soft_label_weight=1.0)
    out = L.dflash_loss(
        hidden,
        weight,
        labels,
        label_mask,
        settings.position_weight("cpu"),
        settings,
        teacher_hidden=teacher,
        anchors=anchors,
    )
    assert out.weight_sum > 0 and abs(out.loss_sum.item()) < 1e-4


def test_chunks_never_save_full_logits_for_backward():
    """Only one chunk's logits may exist: nothing of size >= (chunk rows) x V is kept for backward."""
    hidden, weight, labels, label_mask, _, _ = _inputs()
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = _loss(hidden, weight, labels, label_mask, loss_chunk_blocks=1)
    out.loss_sum.backward()
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()
    assert saved, "the hook saw nothing: the test would not detect saved logits"
    logits_like = [shape for shape in saved if shape[-1] == V]
    assert not logits_like, f"tensors with a vocabulary axis were kept for backward: {logits_like}"


def test_the_backward_gathers_the_chunks_gradients_once_not_once_per_chunk():
    """Each chunk's gradient must land in ``hidden``'s in one gather: a slice per chunk makes
    autograd build a zero tensor of ``hidden``'s full size per chunk and add them all up, work
    that grows with chunks x tokens and runs eager between the regional compile's graphs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    hidden, weight, labels, label_mask, _, _ = _inputs()
    out = _loss(hidden, weight, labels, label_mask, loss_chunk_blocks=1)
    full_shapes = {tuple(hidden.shape), (B * N, BS, H)}
    written = []

    class FullSizeWrites(TorchDispatchMode):
        """Ops that write a new tensor of the rows' full shape (views and aliases write nothing)."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            if isinstance(result, torch.Tensor) and tuple(result.shape) in full_shapes and not func.is_view:
                written.append(str(func))
            return result

    with FullSizeWrites():
        out.loss_sum.backward()
    assert B * N == 10 and hidden.grad is not None
    assert len(written) == 1, f"{len(written)} full-size tensors written for {B * N} chunks: {written}"


def test_dpace_weights_pin_specforge_and_speculators():
    """Their definition (SpecForge ``_dpace_weight``, speculators ``dpace_loss_decay``), by hand.

    One block of 5 slots, label probabilities q = 0.9, 0.5, 0.3, 0.2, 0.4; slot 0 is the anchor and
    slot 2's label is outside the loss mask. Supervised slots get c = (1 - alpha) q + alpha, the
    others pass through (c = 1); prefix P_j = prod_{i <= j} c_i; w_k = sum of P_j over supervised
    j >= k, 0 on unsupervised slots.
    alpha 0.5: c = 1, .75, 1, .6, .7 -> P = 1, .75, .75, .45, .315 -> w = 0, 1.515, 0, .765, .315.
    alpha 0.2: c = 1, .6, 1, .36, .52 -> P = 1, .6, .6, .216, .11232 -> w = 0, .92832, 0, .32832, .11232.
    """
    probs = torch.tensor([[0.9, 0.5, 0.3, 0.2, 0.4]])
    mask = torch.tensor([[False, True, False, True, True]])
    alpha = _settings().dpace_alpha  # --dpace-alpha's default, SpecForge's and speculators'
    assert alpha == 0.5
    w = L._dpace_weights(probs.log(), mask, alpha)
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.515, 0.0, 0.765, 0.315]]))
    w = L._dpace_weights(probs.log(), mask, 0.2)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.92832, 0.0, 0.32832, 0.11232]]))


def test_dpace_loss_is_a_mean_over_supervised_slots():
    """speculators' reduction: sum(CE * w) / number of supervised slots (not / sum(w))."""
    hidden = torch.zeros(1, 5, 2)
    lm_head = torch.zeros(3, 2)  # uniform logits: every label has probability 1/3, CE = log 3
    labels = torch.zeros(1, 1, 5, dtype=torch.long)
    mask = torch.tensor([[[False, True, False, True, True]]])
    settings = loss_settings(block_size=5, gamma=2.0, dpace=True)
    out = L.dflash_loss(hidden, lm_head, labels, mask, torch.ones(5), settings)
    c = 0.5 / 3 + 0.5
    weights = (c + c**2 + c**3) + (c**2 + c**3) + c**3
    torch.testing.assert_close(out.loss_sum, torch.tensor(math.log(3) * weights))
    assert out.weight_sum == 3


def test_bad_inputs_raise():
    hidden, weight, labels, label_mask, anchors, teacher = _inputs()
    soft = _settings(soft_label_weight=0.5)
    w = soft.position_weight("cpu")
    with pytest.raises(ValueError, match="teacher_hidden"):
        L.dflash_loss(hidden, weight, labels, label_mask, w, soft)
    with pytest.raises(ValueError, match=r"anchors \[B, N\] = \(2, 5\), got \(2, 3\)"):
        L.dflash_loss(hidden, weight, labels, label_mask, w, soft, teacher_hidden=teacher, anchors=anchors[:, :3])
    with pytest.raises(ValueError, match="labels/label_mask"):
        L.dflash_loss(hidden, weight, labels[:, :-1], label_mask[:, :-1], w, _settings())


@pytest.mark.parametrize("vocab, k", [(4096, 16), (248320, 16), (151936, 16), (1000, 5), (128 * 7, 7)])
def test_top_k_by_blocks_equals_topk(vocab, k):
    from dflash.train import loss

    gen = torch.Generator().manual_seed(vocab)
    through_blocks = math.gcd(vocab, loss.TOP_K_BLOCK) >= loss.TOP_K_MIN_BLOCK
    assert through_blocks == (vocab != 1000)  # 1000 = 8 x 125: the whole row's topk
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, 3, vocab, generator=gen).to(dtype)
        x[0, 0, -3:] = 50.0  # the largest entries in the last block, tied
        x[0, 1, : 2 * k] = torch.linspace(10, 20, 2 * k).to(dtype)  # all in the first blocks
        x[1, 0] = float("-inf")
        x[1, 0, 5:8] = 1.0  # fewer than k finite entries: the rest ties at -inf
        ours = loss.top_k_indices(x, k)
        want = x.topk(k, dim=-1)
        assert ours.shape == want.indices.shape and int(ours.max()) < vocab
        torch.testing.assert_close(x.gather(-1, ours), want.values, rtol=0, atol=0)  # the same values, in order
        if dtype == torch.float32:  # ties only among the planted values, all chosen but the -infs
            assert torch.equal(ours[:, 1:].sort(-1).values, want.indices[:, 1:].sort(-1).values)

"""flex_attention reads the sparsity hint ``annotate`` binds inside ``preserve_node_meta()`` (patch 0008).

torch 2.13+'s ``torch/_higher_order_ops/flex_attention.py`` read it from ``current_meta`` imported
by value at its import; with node metadata per thread (0008), that name is the importing thread's
outer dict, while ``preserve_node_meta()`` binds a copy that ``annotate`` writes: the first 0008
made the forward record 0.0. 0008 now makes it call ``get_current_meta()``.

Integration tier: fresh interpreters.
"""

from __future__ import annotations

import pytest
from packaging.version import Version
from tiny import script_result

torch = pytest.importorskip("torch")

SPARSITY_HINTS = r"""
import json, sys, warnings
import torch
import torch.fx.traceback as fx_traceback
import torch._higher_order_ops.flex_attention  # noqa: F401
import torch.nn.attention.flex_attention as nn_flex

fa = sys.modules["torch._higher_order_ops.flex_attention"]
warnings.simplefilter("ignore")
nn_flex._validate_device = lambda *args: None  # eager CPU refuses inputs that require grad; forward is enough here
hints = []
forward = fa.FlexAttentionAutogradOp.forward


def recording_forward(ctx, *args):
    result = forward(ctx, *args)
    hints.append(ctx._sparsity_hint)
    return result


fa.FlexAttentionAutogradOp.forward = staticmethod(recording_forward)
q, k, v = (torch.randn(1, 1, 16, 8, requires_grad=True) for _ in range(3))
for block in range(2):
    with fx_traceback.preserve_node_meta(), fx_traceback.annotate({"sparsity_hint": 0.5}):
        nn_flex.flex_attention(q, k, v)
print(json.dumps(hints))
"""


@pytest.mark.skipif(
    Version(torch.__version__).release < (2, 13),
    reason="flex_attention reads a sparsity hint from torch 2.13",
)
@pytest.mark.parametrize("patched", [False, True], ids=["plain", "patched"])
def test_flex_attention_reads_the_sparsity_hint_annotate_binds(patched):
    hints = script_result(SPARSITY_HINTS, patched=patched, timeout_s=600)
    assert hints and all(hint == 0.5 for hint in hints), hints

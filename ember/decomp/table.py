"""ATen -> ember primitives. TABLE maps an OpOverload (or a whole OpOverloadPacket) to a function of the op's
arguments (TensorBoxes for tensors) returning TensorBoxes; returning NotImplemented (or raising) keeps the
op as an ATen call for that node. EXTERN lists the library calls that stay calls on purpose (not fallbacks).

Dtypes follow the node's meta value (`out()`): decompositions compute in the result dtype, or in float32/64
where eager does internally, and the lowering checks every result's shape and dtype against the meta value.

TABLE is assembled here from the families' ENTRIES (pointwise, views, reductions, norms, nn; foreach last, as
its decompositions call the others'). A later family's entry for an op replaces an earlier one's: views'
aten.add.Tensor (an embedding gradient added into another gradient) wraps pointwise's.
"""
from __future__ import annotations

import torch

from ember.decomp import foreach, nn, norms, pointwise, reductions, views

aten = torch.ops.aten
TABLE: dict = {**pointwise.ENTRIES, **views.ENTRIES, **reductions.ENTRIES, **norms.ENTRIES, **nn.ENTRIES}
TABLE.update(foreach.entries(TABLE))
EXTERN = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.convolution.default,
          aten._scaled_dot_product_flash_attention_for_cpu.default, aten._convolution.default,
          aten.convolution_backward.default, aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
          aten._scaled_dot_product_efficient_attention.default,
          aten._scaled_dot_product_efficient_attention_backward.default,
          aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_flash_attention_backward.default}

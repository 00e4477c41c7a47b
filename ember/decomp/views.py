"""Views, indexing and scatters: reshapes, permutes, slices, concatenation, padding, index/gather, embedding
and their gradients (select/slice backward, an embedding's weight gradient added into another)."""
from __future__ import annotations

import sympy
import torch

from ember import ir
from ember.errors import CannotLower
from ember.ir import TensorBox, symbols
from ember.decomp import pointwise
from ember.decomp import prims as P
from ember.decomp.common import odt, out, registrar

aten = torch.ops.aten
ENTRIES: dict = {}   # this family's part of decomp.table.TABLE
reg = registrar(ENTRIES)


@reg(aten.view.default, aten.reshape.default)
def _view(x, size):
    return P.reshape(x, size)


ENTRIES[aten.permute.default] = lambda x, perm: P.permute(x, perm)
ENTRIES[aten.expand.default] = lambda x, size, implicit=False: P.expand(x, size)
ENTRIES[aten.unsqueeze.default] = lambda x, d: P.unsqueeze(x, d)
ENTRIES[aten.squeeze.default] = lambda x: P.squeeze(x)
ENTRIES[aten.squeeze.dim] = lambda x, d: P.squeeze(x, [d]) if x.ndim else x
ENTRIES[aten.squeeze.dims] = lambda x, ds: P.squeeze(x, ds) if x.ndim else x
ENTRIES[aten.flip.default] = lambda x, dims: P.flip(x, dims)
ENTRIES[aten.select.int] = lambda x, d, i: P.select(x, d, i)


@reg(aten.t.default)
def _t(x):
    return P.permute(x, [1, 0]) if x.ndim == 2 else x


@reg(aten.transpose.int)
def _transpose(x, a, b):
    if x.ndim == 0:
        return x
    perm = list(range(x.ndim))
    perm[a % x.ndim], perm[b % x.ndim] = perm[b % x.ndim], perm[a % x.ndim]
    return P.permute(x, perm)


@reg(aten.slice.Tensor)
def _slice(x, dim=0, start=None, end=None, step=1):
    n = x.size[dim % x.ndim]
    n = int(n) if symbols.is_static(n) else n
    start = 0 if start is None else start
    end = n if end is None else end
    return P.slice_(x, dim, start, end, step)


@reg(aten.narrow.default)
def _narrow(x, dim, start, length):
    return P.slice_(x, dim, start, start + length)


@reg(aten.split.Tensor, aten.split_with_sizes.default)
def _split(x, sizes, dim=0):
    dim = dim % x.ndim
    n = int(x.size[dim])
    if isinstance(sizes, int):
        sizes = [min(sizes, n - i) for i in range(0, n, sizes)] if sizes else [n]
    outs, s = [], 0
    for k in sizes:
        outs.append(P.slice_(x, dim, s, s + k))
        s += k
    return outs


@reg(aten.unbind.int)
def _unbind(x, dim=0):
    return [P.select(x, dim, i) for i in range(int(x.size[dim % x.ndim]))]


@reg(aten.cat.default)
def cat(xs: list, dim: int = 0):
    """A piecewise loader over the non-empty pieces (codegen's cat_chains.lower_cat chooses first)."""
    xs = [x for x in xs if not (x.ndim == 1 and symbols.same(x.size[0], 0))]
    if not xs:
        return NotImplemented
    return P.cat(xs, dim, odt())


@reg(aten.stack.default)
def _stack(xs, dim=0):
    dim = dim % (xs[0].ndim + 1)
    return P.cat([P.unsqueeze(x, dim) for x in xs], dim, odt())


@reg(aten.constant_pad_nd.default)
def _pad(x, pad, value=0):
    return P.pad(x, pad, value)


@reg(aten.as_strided.default)
def _as_strided(x, size, stride, storage_offset=None):
    if (x.strided is not None and x.strided[2] != 0) or storage_offset is not None:
        return NotImplemented  # offsets are absolute in the storage, which only eager's tensor knows
    want = getattr(x, "eager_stride", None)
    static = all(symbols.is_static(v) for v in (*size, *stride, *x.size))
    if want is not None and static:
        # it addresses x's storage, which eager lays out by x's strides (a transposed view of a product reads in
        # the product's order, not the view's): x is stored in eager's layout unless it already is (strides of
        # size-1 dims aside); a window past x's elements would read storage that only eager's tensor has
        if sum((int(n) - 1) * int(s) for n, s in zip(size, stride)) >= ir.numel([int(n) for n in x.size]):
            return NotImplemented
        if x.strided is None or not all(int(a) == int(b) for a, b, n in zip(x.strided[1], want, x.size) if int(n) != 1):
            x = ir.GRAPH.realize(TensorBox(x.size, x.dtype, x.loader), stride=want)
    elif ir.GRAPH.reads_layout_changed(x):
        # (a channels-last buffer, eager's layout not known: the ATen call)
        return NotImplemented
    return P.as_strided(x, size, stride, 0)


@reg(aten.repeat.default)
def _repeat(x, reps):
    k = len(reps) - x.ndim
    size = tuple(sympy.Integer(r) * (x.size[d - k] if d >= k else 1) for d, r in enumerate(reps))
    return TensorBox(size, x.dtype, lambda idx: x.loader([ir.ModIndex(idx[d + k], x.size[d]) for d in range(x.ndim)]))


@reg(aten.index.Tensor)
def _index(x, indices):
    if any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in indices):
        return NotImplemented  # boolean masks make data-dependent shapes
    return P.index(x, list(indices) + [None] * (x.ndim - len(indices)))


@reg(aten.index_select.default)
def _index_select(x, dim, idx):
    if x.ndim == 0:
        return NotImplemented
    dim = dim % x.ndim
    return P.index(x, [None] * dim + [P.reshape(idx, [-1]) if idx.ndim == 0 else idx] + [None] * (x.ndim - dim - 1))


@reg(aten.gather.default)
def _gather(x, dim, idx, sparse_grad=False):
    return P.gather(x, dim, idx)


@reg(aten.embedding.default)
def _embedding(w, idx, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return P.index(w, [idx, None])


@reg(aten.embedding_dense_backward.default)
def _embedding_dense_backward(grad, idx, num_weights, padding_idx, scale_grad_by_freq):
    """An embedding's weight gradient that one add reads, added to another gradient of the weight (GPT-2's
    tied token embedding and LM head): not zeros with the rows scattered in, then the sum (three passes over
    the whole [50257, 768] table: a fill, ATen's kernel, the add), but the
    rows added into a copy of the other gradient (`_add_scattered_rows`: ATen's index_put with accumulate,
    which adds a token's rows in order, deterministically; eager sums them first, a rounding's difference).
    Any other embedding backward is ATen's."""
    node, v = ir.GRAPH.node, out()
    user = next(iter(node.users)) if node is not None and len(node.users) == 1 else None
    if scale_grad_by_freq or padding_idx != -1 or user is None or user.target is not aten.add.Tensor \
            or len(user.args) != 2 or user.kwargs or user.args[0] is user.args[1]:
        return NotImplemented
    other = user.args[1] if user.args[0] is node else user.args[0]
    ov, uv = getattr(other, "meta", {}).get("val"), user.meta.get("val")
    if not all(isinstance(t, torch.Tensor) and symbols.sym_sizes(t.shape) == symbols.sym_sizes(v.shape)
                and t.dtype == v.dtype for t in (ov, uv)):
        return NotImplemented

    def unread(idx):
        raise CannotLower("an embedding gradient read other than by its add")
    box = TensorBox(v.shape, v.dtype, unread)
    box.scattered_rows = (grad, idx)
    return box


# pointwise's add: this family's aten.add.Tensor replaces it in decomp.table.TABLE (assembled after pointwise)
_add_tensor = pointwise.ENTRIES[aten.add.Tensor]


@reg(aten.add.Tensor)
def _add_scattered_rows(a, b, *, alpha=1):
    """other + (rows scattered into zeros) as index_put(other, [idx], rows, accumulate=True); any other add as
    the other binary ops."""
    if not any(hasattr(x, "scattered_rows") for x in (a, b)):
        return _add_tensor(a, b, alpha=alpha)
    rows, other = (a, b) if hasattr(a, "scattered_rows") else (b, a)
    grad, idx = rows.scattered_rows
    n = ir.prod(idx.size)
    flat_idx = P.reshape(idx, [n])
    flat_grad = P.reshape(grad, [n, grad.size[-1]])
    return ir.GRAPH.extern(aten.index_put.default, (other, [flat_idx], flat_grad, True), {}, fallback=False)


@reg(aten.select_backward.default)
def _select_backward(g, size, dim, index):
    dim = dim % len(size)
    index = index % size[dim]
    gx = P.unsqueeze(g, dim)
    hit = P.pointwise("eq", P.iota(size, dim), index)
    return P.where(hit, P.expand(gx, size), 0.0, dtype=odt())


@reg(aten.slice_backward.default)
def _slice_backward(g, size, dim, start, end, step):
    dim = dim % len(size)
    n = size[dim]
    start, end, _ = slice(start, end, step).indices(n)
    pads = [0, 0] * (len(size) - 1 - dim) + [start, n - start - int(g.size[dim] - 1) * step - 1]
    if step != 1:
        return NotImplemented
    return P.pad(g, pads, 0)

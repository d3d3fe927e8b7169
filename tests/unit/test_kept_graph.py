"""A kept graph's saved tensors as one blob (``engine/saved.py``): each comes back with its own values, shape and
strides (a transpose stays a transpose), a tensor saved twice goes in once, views of the unit's weights stay
references, and what cannot move as one span stays as it is; the backward through the blob equals the one
through the tensors themselves, bit for bit."""

from __future__ import annotations

import torch
from torch import nn

from lightning_greedysnake.engine.saved import BLOB_ALIGN, KeptGraph, _dense
from lightning_greedysnake.models.discovery import Unit


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        t = y.transpose(-1, -2)  # (saved by the matmul below as a transposed view)
        z = torch.tanh(t @ y)  # (tanh saves its output)
        return (z * z).sum() + (x * x).sum()  # (z saved twice by the product: once in the blob)


def _grads(block: Block, x: torch.Tensor, graph: KeptGraph | None) -> list[torch.Tensor]:
    leaf = x.detach().requires_grad_()
    hooks = graph.hooks() if graph is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    with hooks:
        out = block(leaf)
    if graph is not None:
        blob = graph.seal()
        assert blob is not None and blob.dtype == torch.uint8
        graph.blob = blob.clone()  # (what the store would read back: other memory, the same bytes)
        del blob
    out.sum().backward()
    return [leaf.grad, *(p.grad for p in block.parameters())]


def test_the_backward_through_the_blob_equals_the_one_through_the_graph_held():
    torch.manual_seed(0)
    block, x = Block(), torch.randn(3, 4, 6)
    held = _grads(block, x, None)
    block.zero_grad(set_to_none=True)
    graph = KeptGraph(Unit(0, (0,), (block,)), torch.device("cpu"))
    got = _grads(block, x, graph)
    assert all(torch.equal(a, b) for a, b in zip(got, held, strict=True))
    parts = graph._parts
    assert any(p.stride != tuple(torch.empty(p.size).stride()) for p in parts)  # a transpose came back as one
    assert all(p.offset % BLOB_ALIGN == 0 for p in parts)
    assert [p.offset for p in parts] == sorted({p.offset for p in parts})  # (each part its own bytes, in order)


def test_a_tensor_saved_twice_goes_in_once_and_weights_stay_references():
    lin = nn.Linear(4, 4)
    graph = KeptGraph(Unit(0, (0,), (lin,)), torch.device("cpu"))
    x = torch.randn(2, 4, requires_grad=True)
    assert graph.pack(x) == graph.pack(x) == 0
    assert not isinstance(graph.pack(lin.weight.t()), int)  # a view of the unit's weight: a reference
    assert graph.pack(x.t()) == 1  # (another view of the same storage: its own part)


def test_what_cannot_move_as_one_span_stays_as_it_is():
    graph = KeptGraph(Unit(0, (0,), (nn.Linear(2, 2),)), torch.device("cpu"))
    strided = torch.randn(4, 4)[:, ::2]
    expanded = torch.randn(4, 1).expand(4, 3)
    assert not _dense(strided) and not _dense(expanded) and _dense(torch.randn(3, 5).t())
    assert graph.pack(strided) is strided and graph.pack(expanded) is expanded
    assert KeptGraph(Unit(0, (0,), ()), None).pack(torch.ones(3)).shape == (3,)  # (not offloading: as it is)
    assert graph.seal() is None

"""Qwen 3.5's Gated DeltaNet op (shaders/linear_attention.wgsl through ops/linear_attention.py) against the float64
numpy reference `testing.references.gated_delta_net` (transformers' torch_recurrent_gated_delta_rule and
causal_conv1d_update): a forward's rows (a chain or a token tree, from a nonzero committed state and conv window),
then the commit of the rows kept.

Tolerance: 2e-4 absolute on outputs of O(1) (the gated RMSNorm makes every head's output unit-RMS times weights near
1), 1e-4 on the state and window: float32 accumulation over at most 128 key dims and 7 sequential updates.
Shapes are awkward on purpose: 168 channels (not a multiple of the 64-wide conv workgroups), value heads of 40 (a
partial workgroup of 128), 3 value heads over 1 key head, 3 taps; and the kernel's limits (key and value dims 128).
"""

from __future__ import annotations

import numpy as np
import pytest

from doppler_py.gpu.tensor import Tensor
from doppler_py.model.config import LinearAttention
from doppler_py.ops.linear_attention import GatedDeltaNet, RecurrentState, l2_norm_weight
from doppler_py.ops.tree import MAX_TREE_ROWS, compaction_moves, layout_words
from doppler_py.testing.references import gated_delta_net

SHAPES = {
    "awkward": LinearAttention(conv_taps=3, key_heads=1, value_heads=3, key_dim=24, value_dim=40),
    "widest": LinearAttention(conv_taps=4, key_heads=2, value_heads=4, key_dim=128, value_dim=128),
}
EPS = 1e-6
MAX_ROWS = 16


def reference(shape, mix, conv_w, conv_state, state, gates, parents=None):
    return gated_delta_net(shape, mix, conv_w, gates, conv_state=conv_state, state=state, parents=parents, eps=EPS)


class Layer:
    """One GatedDeltaNet op over a fresh RecurrentState with random weights, state and conv window."""

    def __init__(self, gpu, registry, shape, rng):
        self.shape = shape
        self.mix = Tensor.empty(gpu, (MAX_ROWS, shape.mix_width))
        self.out = Tensor.empty(gpu, (MAX_ROWS, shape.value_width))
        self.tree = Tensor.empty(gpu, (MAX_TREE_ROWS, 2), "u32")
        self.conv_w = as_f32(rng.standard_normal((shape.channels, shape.conv_taps)) * 0.5)
        nv = shape.value_heads
        self.gates = as_f32(
            np.concatenate(
                [
                    -rng.uniform(0.05, 2.0, nv),
                    rng.standard_normal(nv) * 0.5,
                    1.0 + 0.1 * rng.standard_normal(shape.value_dim),
                ]
            )
        )
        self.recurrent = RecurrentState(gpu, shape, 1, MAX_ROWS)
        layer = self.recurrent.layers[0]
        self.state = as_f32(rng.standard_normal((nv, shape.key_dim, shape.value_dim)) * 0.3)
        self.conv_state = as_f32(rng.standard_normal((shape.conv_taps - 1, shape.channels)))
        layer.state.write(self.state.astype(np.float32))
        layer.conv_state.write(self.conv_state.astype(np.float32))
        self.tensors = [
            Tensor.from_numpy(gpu, self.conv_w.astype(np.float32), "f32"),
            Tensor.from_numpy(gpu, self.gates.astype(np.float32), "f32"),
            Tensor.from_numpy(gpu, l2_norm_weight(shape), "f32"),
        ]
        self.op = GatedDeltaNet(
            registry,
            shape,
            layer,
            self.recurrent.order,
            mix=self.mix,
            out=self.out,
            conv=self.tensors[0],
            gates=self.tensors[1],
            l2_weight=self.tensors[2],
            tree=self.tree,
            eps=EPS,
            max_rows=MAX_ROWS,
        )
        self.registry = registry

    def forward(self, mix, parents=None, row0=0):
        """Out of the rows `mix`, placed at rows row0.. of the op's mix and read back from the same rows of out."""
        rows = mix.shape[0]
        placed = np.zeros((row0 + rows, self.shape.mix_width), np.float32)
        placed[row0:] = mix
        self.mix.view(placed.shape).write(placed)
        if parents is not None:
            self.tree.view((rows, 2)).write(layout_words(parents))
        rec = self.registry.recorder()
        self.op.record(rec, rows, tree=parents is not None, row0=row0)
        rec.submit()
        return self.out.numpy()[row0 : row0 + rows]

    def commit(self, kept, moves=()):
        if moves:
            self.recurrent.reorder(moves)
        rec = self.registry.recorder()
        self.op.record_commit(rec, kept, self.recurrent.ordered)
        rec.submit()
        layer = self.recurrent.layers[0]
        return layer.state.numpy(), layer.conv_state.numpy()

    def close(self):
        self.op.release(self.registry)
        self.recurrent.close()
        self.registry.release_tensors(self.mix, self.out, self.tree, *self.tensors)


@pytest.fixture
def layer(gpu, registry, rng, request):
    made = Layer(gpu, registry, SHAPES[request.param], rng)
    yield made
    made.close()


def as_f32(x):
    """x rounded to float32 (what the GPU holds), kept in float64 for the reference."""
    return x.astype(np.float32).astype(np.float64)


def random_mix(rng, shape, rows):
    return as_f32(rng.standard_normal((rows, shape.mix_width)))


@pytest.mark.parametrize("layer", sorted(SHAPES), indirect=True)
@pytest.mark.parametrize("rows, kept, row0", [(1, 1, 0), (7, 0, 0), (7, 4, 0), (7, 7, 0), (5, 3, 9)])
def test_chain_rows_and_the_commit_of_those_kept_match_numpy(layer, rng, rows, kept, row0):
    """row0 > 0: the rows are one sequence's segment of a batched forward, further down mix and out."""
    mix = random_mix(rng, layer.shape, rows)
    out, states = reference(layer.shape, mix, layer.conv_w, layer.conv_state, layer.state, layer.gates)
    np.testing.assert_allclose(layer.forward(mix, row0=row0), out, atol=2e-4, rtol=0)
    if kept == 0:
        return
    state, conv_state = layer.commit(kept)
    np.testing.assert_allclose(state, states[kept - 1], atol=1e-4, rtol=0)
    window = np.concatenate([layer.conv_state, mix[:kept, : layer.shape.channels]])[-(layer.shape.conv_taps - 1) :]
    np.testing.assert_allclose(conv_state, window, atol=0, rtol=0)
    # The next forward starts from the committed state: one more row, as decode after a step.
    more = random_mix(rng, layer.shape, 1)
    out, _ = reference(layer.shape, more, layer.conv_w, window, states[kept - 1], layer.gates)
    np.testing.assert_allclose(layer.forward(more), out, atol=2e-4, rtol=0)


TREES = {
    "two-branches": [-1, 0, 1, -1, 3, 0],  # rows 1-2-3 and 4-5 under the root, 6 under 1
    "deep": [-1, 0, 1, 2, 3, 4, 0, 6],  # a chain deeper than the conv window, a side branch
}


@pytest.mark.parametrize("layer", ["awkward"], indirect=True)
@pytest.mark.parametrize("tree", sorted(TREES))
def test_tree_rows_follow_their_ancestors_and_a_side_path_commits_in_order(layer, rng, tree):
    parents = TREES[tree]
    mix = random_mix(rng, layer.shape, len(parents) + 1)
    out, states = reference(layer.shape, mix, layer.conv_w, layer.conv_state, layer.state, layer.gates, parents)
    np.testing.assert_allclose(layer.forward(mix, parents), out, atol=2e-4, rtol=0)
    # Accept the last node's path (a side branch: its rows are not 1, 2, ...).
    path, node = [], len(parents) - 1
    while node >= 0:
        path.insert(0, node + 1)
        node = parents[node]
    state, conv_state = layer.commit(len(path) + 1, compaction_moves(path))
    np.testing.assert_allclose(state, states[path[-1]], atol=1e-4, rtol=0)
    kept_rows = [0, *path]
    window = np.concatenate([layer.conv_state, mix[kept_rows, : layer.shape.channels]])[-(layer.shape.conv_taps - 1) :]
    np.testing.assert_allclose(conv_state, window, atol=0, rtol=0)

"""Port of the examples in the docstrings of ``flax.linen.scan`` and
``flax.linen.remat_scan`` (google/flax ``flax/linen/transforms.py``, flax 0.12.8): an LSTM
scanned over time with ``variable_broadcast="params"`` (the weights shared by every
step), a residual MLP scanned over layers with ``variable_axes={'params': 0}`` (a weight
per layer), and ``remat_scan`` of ``nn.Dense`` (100 layers as a 10x10 nested scan, each
level rematerialized).

Kept from the source: the three modules as written there (the LSTM's ``features`` and
input shape scaled down, the ``remat_scan`` stack to 3x3 layers, and ``ResidualMLPBlock``'s
width of 2). Added around them: the pmap-style train step every data-parallel user writes
(``value_and_grad`` of a squared loss, ``lax.pmean`` of the gradients and the loss, SGD),
run against ``jax.pmap`` for N in {2, 8} and against one device's ``jax.jit`` on the global
batch. Their backward passes are scans that add every step's weight gradient to an
accumulator (LSTM) or stack one per layer (the layer scans, inside ``jax.checkpoint``
regions for ``remat_scan``): the compiled step must all-reduce them once after each loop,
not in every step (``hoist-collectives``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

import runtime as rt
from compiler.hlo_report import while_bodies
from tests.clients._harness import REPLICAS, Port, Split, check_port

GLOBAL_BATCH = 16


class LSTM(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x):
        ScanLSTM = nn.scan(
            nn.LSTMCell, variable_broadcast="params",
            split_rngs={"params": False}, in_axes=1, out_axes=1)

        lstm = ScanLSTM(self.features)
        input_shape = x[:, 0].shape
        carry = lstm.initialize_carry(jax.random.key(0), input_shape)
        carry, x = lstm(carry, x)
        return x


class ResidualMLPBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = nn.Dense(features=2)(x)
        h = nn.relu(h)
        return x + h, None


class ResidualMLP(nn.Module):
    n_layers: int = 4

    @nn.compact
    def __call__(self, x):
        ScanMLP = nn.scan(
            ResidualMLPBlock, variable_axes={'params': 0},
            variable_broadcast=False, split_rngs={'params': True},
            length=self.n_layers)
        x, _ = ScanMLP()(x, None)
        return x


class BigModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        DenseStack = nn.remat_scan(nn.Dense, lengths=(3, 3))
        # 9x dense with O(sqrt(N)) memory for gradient computation
        return DenseStack(8, name="dense_stack")(x)


# model, the shape of one example, the shape of one target
MODELS = {
    "lstm": (LSTM(features=8), (5, 7), (5, 8)),       # [time, features] per example
    "residual_mlp": (ResidualMLP(n_layers=4), (2,), (2,)),
    "remat_scan": (BigModel(), (8,), (8,)),
}


def make_train_step(model):
    def train_step(params, batch):
        def loss_fn(p):
            y = model.apply({"params": p}, batch["x"])
            return jnp.mean((y - batch["y"]) ** 2)
        loss, grads = jax.value_and_grad(loss_fn)(params)
        grads = jax.lax.pmean(grads, axis_name="batch")
        params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        return params, jax.lax.pmean(loss, axis_name="batch")
    return train_step


def _setup(name):
    model, x_shape, y_shape = MODELS[name]
    rng = np.random.default_rng(0)
    batches = [{"x": rng.normal(size=(GLOBAL_BATCH,) + x_shape).astype(np.float32),
                "y": rng.normal(size=(GLOBAL_BATCH,) + y_shape).astype(np.float32)}
               for _ in range(2)]
    params = jax.jit(model.init)(jax.random.key(1), batches[0]["x"][:1])["params"]
    return model, params, batches


@pytest.mark.parametrize("n", REPLICAS)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_flax_scan_example(name, n):
    model, params, batches = _setup(name)
    port = Port(step=make_train_step(model), state=(params,),
                inputs=lambda i: ((Split(batches[i]),), {}))
    check_port(port, n, oracle=True, oracle_metrics=lambda m: m)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_flax_scan_example_all_reduces_once_per_loop(name):
    """The compiled step has no all-reduce inside a while loop's body: the gradients
    accumulated (or stacked) by the backward scans are summed once, after them."""
    n = 4
    model, params, batches = _setup(name)
    step = rt.replicate(make_train_step(model), num_replicas=n, axis_name="batch")
    compiled = step.lower(params, rt.distribute(batches[0], n)).compile()
    bodies = while_bodies(compiled.as_text())
    assert bodies, "the step has no loop: the port lost its scan"
    in_loops = [c.name for c in compiled.collectives()
                if c.kind == "all-reduce" and c.computation in bodies]
    assert in_loops == []

"""Processes that call one replicated step with different argument shapes (issue: exact
results; found by a probe): each would compile its own program and their collectives
would not match (process 1 returned its weights unchanged with no error, process 0 failed
30 s later in gloo). Every process must raise ``ProcessMismatchError`` with the numbers.

    python -m tools.launch -n 2 --devices-per-process 4 tests/mp/mismatch.py MODE

MODE: ``all``: ``rows`` (3 rows a replica on process 0, 2 on process 1), ``empty`` (0 on
process 1), ``mirrored`` (the weights' shapes differ), one after the other; ``later`` (the first call agrees; in the
second, process 0's shapes are new and process 1's those of the first call: a cache hit
there, so process 0 waits for it in vain, RT_ARGUMENTS_TIMEOUT_S)."""
import os
import sys

# the repository's root on the path, as a test's own run has it (no install needed)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import runtime as rt  # noqa: E402

rt.initialize_distributed()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

mode, pid = sys.argv[1], jax.process_index()


def step(w, x, y):
    loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
    return w - 0.1 * g, loss


s = rt.replicate(step, num_replicas=8)


def call(rows, wrows=4):
    xs = [np.ones((rows, wrows), np.float32)] * 4
    ys = [np.zeros((rows, 1), np.float32)] * 4
    w2, _ = s(jnp.ones((wrows, 1)), rt.PerReplica(xs), rt.PerReplica(ys))
    return np.asarray(w2)


def mismatched(mode):
    if mode == "rows":
        call(3 if pid == 0 else 2)
    elif mode == "empty":
        call(3 if pid == 0 else 0)
    elif mode == "mirrored":
        call(3, wrows=4 if pid == 0 else 5)
    elif mode == "later":
        w = call(3)
        print(f"first call agrees: {w.ravel().tolist()}", flush=True)
        call(2 if pid == 0 else 3)


# (each mismatch raises on every process before anything is traced: the next can follow)
for m in (["rows", "empty", "mirrored"] if mode == "all" else [mode]):
    try:
        mismatched(m)
        print(f"{m}: NO ERROR", flush=True)
    except rt.ProcessMismatchError as e:
        print(f"{m}: ProcessMismatchError: {e}", flush=True)
        if m == "later":  # (process 1 waits in gloo, and so would this one's exit: the
            os._exit(4)   # launcher ends the rest when one process fails)

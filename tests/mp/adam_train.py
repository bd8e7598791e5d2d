"""Train an MLP with Adam for a few steps on deterministic synthetic data and write the
final parameters to the .npz named by argv[1].

Under ``python -m tools.launch -n P`` (``RT_NUM_PROCESSES`` set) it joins the other
processes with ``rt.initialize_distributed()`` and replicates over every process's devices;
each process passes only its local replicas' shards. Run plainly, it uses this process's
devices. Either way the numbers must be the same.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import runtime as rt  # noqa: E402

if os.environ.get("RT_NUM_PROCESSES"):
    rt.initialize_distributed()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from tests.models import init_mlp, make_data, mse_loss, optax_step  # noqa: E402

STEPS = 4


def main(out_path: str) -> None:
    n = len(jax.devices())                       # every process's devices
    model, params = init_mlp(d_in=4, features=8, out=2)
    tx = optax.adam(1e-2)
    step = rt.replicate(optax_step(mse_loss(model), tx), num_replicas=n)
    mine = step.local_replicas
    print(f"process {jax.process_index()}/{jax.process_count()}: {n} replicas, local {list(mine)}",
          flush=True)
    p, s = params, tx.init(params)
    data = [make_data(n=4 * n, d_in=4, d_out=2, seed=t) for t in range(STEPS)]
    # half the steps: this process's replicas' shards of each global batch, by hand
    for t in range(STEPS // 2):
        shards = rt.distribute(data[t], n).values
        p, s, loss = step(p, s, rt.PerReplica([shards[r] for r in mine]))
        assert len(loss.values) == len(mine)
    # the other half through the prefetching iterator (every process reads the same data)
    with rt.distribute_iterator(iter(data[STEPS // 2:]), step=step) as it:
        for batch in it:
            p, s, loss = step(p, s, batch)
    print(f"final mean loss {float(rt.reduce('mean', loss)):.6f}", flush=True)
    # reductions over every process's replicas (collectives: every process calls them),
    # of replica r's value r: the same numbers as one process of 8 replicas
    x = rt.distribute(np.arange(n, dtype=np.float32).reshape(n, 1), n).values
    mine_x = rt.PerReplica([x[r] for r in mine])
    own = rt.replicate(lambda v: v[0, 0], num_replicas=n)(mine_x)
    add = lambda t, v: t + v[0, 0] + 1  # noqa: E731
    acc, first = rt.replicate(lambda a, b, v: (a.update(lambda t: add(t, v)),
                                               b.update(lambda t: add(t, v))), num_replicas=n)(
        rt.SyncOnRead(np.float32(0), "sum", num_replicas=len(mine)),
        rt.SyncOnRead(np.float32(0), "only_first_replica", num_replicas=len(mine)), mine_x)
    # an accumulator made outside a step holds this process's replicas: its read() and
    # assign() are over every process's (fresh: 1 per replica; 10 assigned, then a step)
    fresh = rt.SyncOnRead(np.float32(1), "sum", num_replicas=len(mine))
    same = rt.replicate(lambda a: a.update(lambda t: t), num_replicas=n)
    assigned = same(fresh.assign(np.float32(10)))
    counted = same(rt.SyncOnRead(np.int32(0), "sum", num_replicas=len(mine)).assign(np.int32(10)))
    print("reductions: " + " ".join(f"{op} {float(rt.reduce(op, own)):g}"
                                    for op in ("sum", "mean", "max", "min"))
          + f" read {float(acc.read()):g} first {float(first.read()):g}"
          + f" fresh {float(fresh.read()):g} assigned {float(assigned.read()):g}"
          + f" counted {int(counted.read())}", flush=True)
    flat = {jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_flatten_with_path(p)[0]}
    # process 0 writes out_path; the others out_path.p<id>.npz (mirrored results are the
    # same in every process: the test compares them)
    pid = jax.process_index()
    np.savez(out_path if pid == 0 else f"{out_path}.p{pid}.npz", **flat)


if __name__ == "__main__":
    main(sys.argv[1])

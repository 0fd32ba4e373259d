"""Data-parallel training with nothing but numpy and horovod.numpy.

Each rank fits a linear model on its own shard of a synthetic regression problem; gradients are averaged
with ``hvd.allreduce`` every step, so all ranks hold identical weights that converge to the true ones.

    horovodrun -np 2 python examples/numpy/train_linear.py
"""

import numpy as np

import horovod.numpy as hvd


def main(steps: int = 200, lr: float = 0.1, features: int = 16, samples: int = 4096) -> None:
    hvd.init()
    rng = np.random.default_rng(0)  # same problem on every rank
    true_w = rng.normal(size=features)
    x = rng.normal(size=(samples, features))
    y = x @ true_w + 0.01 * rng.normal(size=samples)
    shard = slice(hvd.rank(), samples, hvd.size())  # each rank trains on its own rows
    x, y = x[shard], y[shard]

    w = np.zeros(features) if hvd.rank() == 0 else np.random.default_rng(hvd.rank()).normal(size=features)
    w = hvd.broadcast(w, root_rank=0, name="initial_weights")  # start from rank 0's weights
    for step in range(steps):
        grad = 2 * x.T @ (x @ w - y) / len(y)
        grad = hvd.allreduce(grad, name="grad")  # average over ranks
        w -= lr * grad
        if step % 50 == 0 or step == steps - 1:
            loss = hvd.allreduce(np.array([np.mean((x @ w - y) ** 2)]), name="loss")[0]
            if hvd.rank() == 0:
                print(f"step {step:4d}  loss {loss:.6f}")
    error = float(np.max(np.abs(w - true_w)))
    weights = hvd.allgather_object(w.tolist())
    if hvd.rank() == 0:
        same = all(np.array_equal(weights[0], wr) for wr in weights)
        print(f"ranks={hvd.size()} max |w - w_true| = {error:.4f}; weights identical on all ranks: {same}")
    hvd.shutdown()


if __name__ == "__main__":
    main()

"""A stateful Horovod worker on Ray: ``start(executable_cls=...)`` builds one object per actor, and
``execute`` / ``execute_single`` call methods on it, keeping its state between calls.

    pip install 'horovod[ray]'
    python examples/ray/ray_stateful_executor.py
"""

import numpy as np
import ray

from horovod.ray import RayExecutor


class LinearTrainer:
    """Lives in each actor: a linear model trained on this rank's shard, step by step."""

    def __init__(self, features: int, lr: float) -> None:
        import horovod.numpy as hvd

        hvd.init()
        self.hvd = hvd
        rng = np.random.default_rng(0)
        self.true_w = rng.normal(size=features)
        x = rng.normal(size=(1024, features))
        y = x @ self.true_w
        self.x, self.y = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]
        self.w = hvd.broadcast(np.zeros(features), root_rank=0, name="w0")
        self.lr = lr

    def steps(self, n: int) -> float:
        for _ in range(n):
            grad = 2 * self.x.T @ (self.x @ self.w - self.y) / len(self.y)
            self.w -= self.lr * self.hvd.allreduce(grad, name="grad")
        return float(np.max(np.abs(self.w - self.true_w)))


def main() -> None:
    ray.init(num_cpus=3, include_dashboard=False)
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=3)
    executor.start(executable_cls=LinearTrainer, executable_kwargs={"features": 8, "lr": 0.1})
    try:
        for round_ in range(3):
            errors = executor.execute(lambda trainer: trainer.steps(20))  # every rank, results in rank order
            print(f"round {round_}: max |w - w_true| per rank {np.round(errors, 5).tolist()}")
        weights = executor.execute_single(lambda trainer: trainer.w.tolist())  # rank 0 only
        print("rank 0's weights:", np.round(weights, 3).tolist())
    finally:
        executor.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()

"""Data-parallel torch training on Ray: every rank is a Ray actor, Horovod averages the gradients.

Runs as written on a laptop (it starts a local Ray with 2 CPUs) or on a cluster you are connected to:

    pip install 'horovod[ray,torch]'
    python examples/ray/ray_torch.py                  # local Ray, 2 workers
    python examples/ray/ray_torch.py --address auto --num-workers 8    # an existing cluster (ray start ...)
"""

import argparse

import ray

from horovod.ray import RayExecutor


def train(epochs: int, lr: float) -> dict:
    """Runs in every actor: the usual Horovod script, as a function."""
    import torch

    import horovod.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    true_w = torch.randn(16, 1)
    x = torch.randn(2048, 16)
    y = x @ true_w + 0.01 * torch.randn(2048, 1)
    shard = slice(hvd.rank(), None, hvd.size())  # each rank trains on its own rows
    dataset = torch.utils.data.TensorDataset(x[shard], y[shard])
    loader = torch.utils.data.DataLoader(dataset, batch_size=64, shuffle=False)

    model = torch.nn.Linear(16, 1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr * hvd.size()),
                                   named_parameters=model.named_parameters())
    for epoch in range(epochs):
        total = 0.0
        for xb, yb in loader:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            opt.step()
            total += loss.item()
        avg = hvd.allreduce(torch.tensor(total / len(loader)), name="epoch_loss").item()
        if hvd.rank() == 0:
            print(f"epoch {epoch}: loss {avg:.5f}", flush=True)
    error = (model.weight.detach().t() - true_w).abs().max().item()
    return {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(), "max_weight_error": error}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default=None, help="Ray cluster address (default: start a local Ray)")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=args.num_workers, include_dashboard=False)

    settings = RayExecutor.create_settings(timeout_s=60)
    executor = RayExecutor(settings, num_workers=args.num_workers, cpus_per_worker=1, use_gpu=False)
    executor.start()
    try:
        results = executor.run(train, kwargs={"epochs": args.epochs, "lr": 0.05})
        second = executor.run(train, kwargs={"epochs": 1, "lr": 0.01})  # the same actors, Horovod still up
    finally:
        executor.shutdown()
    for r in results:
        print(r)
    assert [r["rank"] for r in results] == list(range(args.num_workers))
    assert len(second) == args.num_workers
    print(f"all {args.num_workers} ranks agree on the model: "
          f"{len({round(r['max_weight_error'], 6) for r in results}) == 1}")
    ray.shutdown()


if __name__ == "__main__":
    main()

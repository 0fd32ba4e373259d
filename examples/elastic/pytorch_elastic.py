"""Elastic PyTorch training that survives workers coming and going and counts every sample once.

Run on this machine as two "hosts" (see docs/elastic.md)::

    printf 'localhost:1\n127.0.0.1:1\n' > hosts.txt
    horovodrun -np 2 --min-np 1 --max-np 2 --host-discovery-script "cat hosts.txt" \
        python examples/elastic/pytorch_elastic.py

then ``kill -9`` one of the workers, or edit hosts.txt: the job continues, and at the end rank 0 reports
how often each sample was used (exactly ``--epochs`` times each).
"""

import argparse
import time

import torch

import horovod.torch as hvd

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--samples", type=int, default=512)
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--step-sleep", type=float, default=0.02, help="slow down so there is time to kill")
args = parser.parse_args()

hvd.init()
torch.manual_seed(0)
features = torch.randn(args.samples, 8)
targets = features @ torch.arange(1.0, 9.0).unsqueeze(1) + 0.5
dataset = torch.utils.data.TensorDataset(features, targets, torch.arange(args.samples))

model = torch.nn.Linear(8, 1)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr),
                                     named_parameters=model.named_parameters(), op=hvd.Sum)
# Batch mode: every rank gets the same number of steps, no padding, no duplicates.
sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=42, batch_size=args.batch_size)
loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0,
                               uses=torch.zeros(args.samples, dtype=torch.int64))


def on_reset():
    print(f"reset: now rank {hvd.rank()} of {hvd.size()}", flush=True)


state.register_reset_callbacks([on_reset])


@hvd.elastic.run
def train(state):
    while state.epoch < args.epochs:
        state.sampler.set_epoch(state.epoch)  # keeps the progress of an epoch interrupted by a reset
        loss = None  # a reset after the epoch's last batch resumes with no batch left to run
        for step, (x, y, idx) in enumerate(loader):
            optimizer.zero_grad()
            # Sum of per-sample losses, summed over ranks and divided by the global batch: the update does
            # not depend on how the global batch is split over the ranks.
            loss = torch.nn.functional.mse_loss(model(x), y, reduction="sum") / (args.batch_size * hvd.size())
            loss.backward()
            optimizer.step()
            state.uses += hvd.allreduce(torch.bincount(idx, minlength=args.samples), op=hvd.Sum, name="uses")
            state.sampler.record_batch(step, args.batch_size)
            time.sleep(args.step_sleep)
            state.commit()  # after the optimizer step: these samples are now done
        if hvd.rank() == 0:
            last = "" if loss is None else f", loss {loss.item():.4f}"
            print(f"epoch {state.epoch} done on {hvd.size()} workers{last}", flush=True)
        state.epoch += 1
        state.commit()


train(state)
if hvd.rank() == 0:
    counts = torch.bincount(state.uses, minlength=args.epochs + 2).tolist()
    exact = bool((state.uses == args.epochs).all())
    print(f"every sample used exactly {args.epochs} times: {exact} (histogram of uses: {counts})", flush=True)

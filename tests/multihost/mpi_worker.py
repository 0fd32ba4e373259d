"""Worker of the MPI tests: ``mpirun -np 4 python tests/multihost/mpi_worker.py <mode>``."""

import sys

import numpy as np

import horovod.numpy as hvd

mode = sys.argv[1]
if mode == "threads-off":  # before mpi4py is imported: Horovod initialises MPI itself
    hvd.init()
    assert hvd.mpi_enabled() and not hvd.mpi_threads_supported()
    assert hvd.allreduce(np.ones(4), op=hvd.Sum, name="t")[0] == hvd.size()
    print("THREADS-OFF-OK", hvd.rank())
    sys.exit(0)

from mpi4py import MPI  # noqa: E402

world = MPI.COMM_WORLD
if mode == "mix":
    hvd.init()
    assert hvd.mpi_enabled() and hvd.mpi_threads_supported() and not hvd.gloo_enabled()
    handles = [hvd.allreduce_async(np.full(50_000, hvd.rank(), np.float64), op=hvd.Sum, name=f"m{i}")
               for i in range(20)]
    total = 0
    for i in range(50):  # the user's own MPI traffic while Horovod's engine thread is busy
        total += world.allreduce(i + world.Get_rank())
        world.Bcast(np.arange(3.0), root=0)
    outs = [hvd.synchronize(h) for h in handles]
    n = hvd.size()
    assert all((o == n * (n - 1) / 2).all() for o in outs)
    assert total == sum(i * n + n * (n - 1) // 2 for i in range(50))
    print("MIX-OK", hvd.rank())
elif mode == "ranks":
    if world.Get_rank() in (0, 2):
        hvd.init(comm=[0, 2])
        assert hvd.size() == 2 and hvd.rank() == [0, 2].index(world.Get_rank())
        out = hvd.allreduce(np.array([world.Get_rank()], np.int64), op=hvd.Sum, name="x")
        assert out[0] == 2, out
        print("RANKS-OK", hvd.rank())
        hvd.shutdown()
    world.Barrier()
elif mode == "ranks-unordered":
    # upstream's MPI_Group_incl keeps the list's order: world rank 3 is Horovod rank 0 (ranks were sorted)
    order = [3, 1]
    if world.Get_rank() in order:
        hvd.init(comm=order)
        assert hvd.size() == 2 and hvd.rank() == order.index(world.Get_rank()), (hvd.rank(), world.Get_rank())
        got = hvd.broadcast(np.array([world.Get_rank()], np.int64), root_rank=0, name="b")
        assert got[0] == order[0], got
        gathered = hvd.allgather(np.array([world.Get_rank()], np.int64), name="g")
        assert gathered.tolist() == order, gathered
        print("RANKS-UNORDERED-OK", hvd.rank())
        hvd.shutdown()
    world.Barrier()
elif mode == "comm":
    sub = world.Split(color=world.Get_rank() % 2, key=world.Get_rank())
    hvd.init(comm=sub)
    assert hvd.size() == sub.Get_size() and hvd.rank() == sub.Get_rank()
    out = hvd.allgather(np.array([world.Get_rank()]), name="g")
    assert out.tolist() == [r for r in range(world.Get_size()) if r % 2 == world.Get_rank() % 2], out
    print("COMM-OK", world.Get_rank(), out.tolist())
    hvd.shutdown()
elif mode == "gloo-ops":
    hvd.init()
    from horovod.common import basics
    name = type(basics.engine()._communicator(0)).__name__
    assert hvd.mpi_enabled() and name == "ShmCommunicator", name
    assert hvd.allreduce(np.ones(100_000), op=hvd.Sum, name="t")[0] == hvd.size()
    print("GLOO-OPS-OK", hvd.rank())

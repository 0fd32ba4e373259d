"""``RayExecutor``: a Horovod job whose ranks are Ray actors (upstream's API, horovod/ray/runner.py).

How a job is put together (docs/ray.md has the user's view):

* ``start()`` reserves resources in a placement group (one bundle per worker, ``PACK``; or ``num_hosts``
  bundles of ``num_workers_per_host`` workers, ``STRICT_SPREAD``; or the caller's current placement group),
  creates one :class:`~horovod.ray.worker.BaseHorovodWorker` actor per rank and asks each for its Ray node.
* Ranks are grouped by node in rank order: ``local_rank`` is the position on the node, ``cross_rank`` the
  node's index among the nodes with that local rank (upstream's rule).
* The driver process runs Horovod's authenticated rendezvous store (:mod:`horovod.runner.rendezvous`) on its
  node's address, with a fresh key per ``start()``; every actor gets the launcher's variables
  (``HOROVOD_RANK``..., ``HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT``, ``HOROVOD_SECRET_KEY``) through Ray, then
  ``extra_env_vars``, then ``HOROVOD_GLOO_IFACE``/``NCCL_SOCKET_IFNAME`` from ``nics``.
* ``run``/``execute`` call the function in every actor and return the results in rank order.  The user's
  function calls ``hvd.init()``; the actors live until ``shutdown()``, so a second ``run`` finds Horovod
  initialised (upstream's behaviour), and one that called ``hvd.shutdown()`` starts a new generation.
* A rank whose function raises leaves the Horovod job (its peers' collectives fail at once instead of
  waiting); the driver re-raises that rank's exception (Ray's ``RayTaskError`` of the original type, its
  text naming the rank) after every rank returned, and re-aligns the ranks so the executor can run again.
  A rank whose actor dies ends the job: every actor is stopped and the error names the rank.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import ray

from horovod.ray.adapter import BaseParams, _ExecutorAdapter
from horovod.ray.strategy import _resources, create_placement_group, share_node_gpus
from horovod.ray.worker import BaseHorovodWorker

__all__ = ["RayExecutor", "MiniSettings", "WorkerDiedError", "Coordinator", "StaticAdapter", "StaticParams"]

logger = logging.getLogger(__name__)

EARLY_RETURN_GRACE_S = 5.0
"""How long after a rank's function returned the others may still run before the returned ranks leave the job
(see :meth:`RayExecutor._leave_after_return`)."""

_STATE_KEY = "init/state.{rank}"  # horovod.common.bootstrap: what a rank publishes about its init() attempts


class WorkerDiedError(RuntimeError):
    """The actor of a rank died (killed, crashed, or its node was lost); ``rank`` says which."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


@dataclasses.dataclass
class MiniSettings:
    """Upstream's minimal settings for Ray (``RayExecutor.create_settings``).

    ``key`` is accepted for compatibility and not used: every ``start()`` makes a fresh job key.
    """

    nics: set | None = None
    verbose: int = 1
    key: Any = None
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    timeout_s: int = 300
    placement_group_timeout_s: int = 100
    elastic: bool = False

    @property
    def start_timeout(self) -> Any:
        from horovod.runner.common.util.timeout import Timeout

        return Timeout(self.timeout_s, message="Timed out waiting for {activity}. Please check connectivity "
                       "between servers. You may need to increase the --start-timeout parameter if you have "
                       "too many servers.")


class Coordinator:
    """Upstream's ``horovod.ray.runner.Coordinator``: forms a job of Ray actors started by someone else.

    Ray Train's ``HorovodTrainer`` (``ray.train.horovod.config``) imports it and drives it as upstream's::

        coordinator = Coordinator(settings)
        for rank, (hostname, node_id) in enumerate(zip(hostnames, node_ids)):
            coordinator.register(hostname, node_id, rank)
        per_rank = coordinator.finalize_registration()   # rank -> HOROVOD_LOCAL_*/HOROVOD_CROSS_*
        common = coordinator.establish_rendezvous()       # every rank's rendezvous variables

    Ranks are grouped by node in registration order (as :class:`RayExecutor`).  ``establish_rendezvous``
    starts the authenticated store in this process with a fresh key, which the returned variables carry
    (``HOROVOD_SECRET_KEY``: upstream's store had none), plus ``HOROVOD_START_TIMEOUT`` from
    ``settings.timeout_s``; the store serves until :meth:`shutdown` or this process exits.
    """

    rendezvous: Any = None
    global_rendezv_port: int | None = None
    nics: Any = None

    def __init__(self, settings: Any) -> None:
        self.settings = settings
        self.node_id_by_rank: dict[str, list[int]] = {}
        self._hostnames: set[str] = set()

    @property
    def world_size(self) -> int:
        return sum(len(ranks) for ranks in self.node_id_by_rank.values())

    @property
    def hostnames(self) -> set[str]:
        return self._hostnames

    @property
    def node_id_string(self) -> str:
        return ",".join(f"{node_id}:{len(ranks)}" for node_id, ranks in self.node_id_by_rank.items())

    def register(self, hostname: str, node_id: str, world_rank: int) -> None:
        self._hostnames.add(hostname)
        self.node_id_by_rank.setdefault(node_id, []).append(world_rank)

    def finalize_registration(self) -> dict[int, dict[str, int]]:
        """Every registered rank's ``HOROVOD_CROSS_RANK``, ``_CROSS_SIZE``, ``_LOCAL_RANK``, ``_LOCAL_SIZE``."""
        # Nodes in order of their first registration, a node's ranks in registration order (upstream's rule).
        cross_sizes: dict[int, int] = {}
        cross_ranks: dict[int, int] = {}
        for ranks in self.node_id_by_rank.values():
            for local_rank, rank in enumerate(ranks):
                cross_ranks[rank] = cross_sizes.get(local_rank, 0)
                cross_sizes[local_rank] = cross_ranks[rank] + 1
        return {rank: {"HOROVOD_CROSS_RANK": cross_ranks[rank], "HOROVOD_CROSS_SIZE": cross_sizes[local_rank],
                       "HOROVOD_LOCAL_RANK": local_rank, "HOROVOD_LOCAL_SIZE": len(ranks)}
                for ranks in self.node_id_by_rank.values() for local_rank, rank in enumerate(ranks)}

    def establish_rendezvous(self) -> dict[str, str]:
        """Start the job's store on this node's address; the variables every rank needs to reach it."""
        from horovod.base import auth
        from horovod.base.config import format_number
        from horovod.runner.rendezvous import RendezvousServer

        self.shutdown()
        key = auth.make_secret_key()
        tls_env, job_tls = _tls()
        addr = ray.util.get_node_ip_address()
        self.rendezvous = RendezvousServer(key, addr=addr, tls=job_tls)
        self.global_rendezv_port = self.rendezvous.start()
        timeout = float(getattr(self.settings, "timeout_s", 300) or 300)
        return {"HOROVOD_GLOO_RENDEZVOUS_ADDR": addr, "HOROVOD_GLOO_RENDEZVOUS_PORT": str(self.global_rendezv_port),
                "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
                "HOROVOD_START_TIMEOUT": format_number(timeout), auth.SECRET_KEY_ENV: key.hex(), **tls_env}

    def shutdown(self) -> None:
        """Stop the store (not upstream's: its HTTP server lived as long as the process)."""
        if self.rendezvous is not None:
            self.rendezvous.stop()
            self.rendezvous = None
            self.global_rendezv_port = None


class RayExecutor:
    """Job class for Horovod + Ray (upstream's constructor; see docs/ray.md).

    Args:
        settings: from :meth:`create_settings` (a horovod ``Settings`` object works too; missing fields take
            their defaults).
        num_workers: number of ranks (one placement-group bundle each, packed).
        num_hosts / num_workers_per_host: alternatively, ``num_hosts`` nodes with that many ranks each.
        cpus_per_worker / use_gpu / gpus_per_worker: Ray resources of each rank's actor.
        use_current_placement_group: inside a placement group (e.g. a Tune trial), use it.
        min_workers ... override_discovery: elastic jobs (:class:`horovod.ray.ElasticRayExecutor`).
    """

    @classmethod
    def create_settings(cls, timeout_s: int = 30, ssh_identity_file: str | None = None, ssh_str: str | None = None,
                        placement_group_timeout_s: int = 100, nics: set | None = None) -> MiniSettings:
        """Settings for :class:`RayExecutor` (upstream's signature).

        ``timeout_s`` bounds the ranks' rendezvous (``HOROVOD_START_TIMEOUT``); ``placement_group_timeout_s``
        the wait for the resources; ``nics`` names the interface(s) the ranks use.  ``ssh_str`` is written to
        a missing ``ssh_identity_file`` (mode 0600) as upstream does; nothing here uses ssh.
        """
        if ssh_str and ssh_identity_file and not os.path.exists(ssh_identity_file):
            fd = os.open(ssh_identity_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(ssh_str)
        return MiniSettings(ssh_identity_file=ssh_identity_file, timeout_s=timeout_s,
                            placement_group_timeout_s=placement_group_timeout_s, nics=nics)

    def __init__(self, settings: Any = None, num_workers: int | None = None, num_hosts: int | None = None,
                 num_workers_per_host: int = 1, cpus_per_worker: int = 1, use_gpu: bool = False,
                 gpus_per_worker: int | None = None, use_current_placement_group: bool = True,
                 min_workers: int | None = None, max_workers: int | None = None, reset_limit: int | None = None,
                 cooldown_range: list[int] | None = None, elastic_timeout: int = 600,
                 override_discovery: bool = True) -> None:
        if max_workers and (not min_workers or min_workers <= 0):
            raise ValueError("`max_workers` provided without any positive `min_workers`. Elastic workloads "
                             "require a positive `min_workers`")
        if min_workers and num_workers:
            raise ValueError("Both `min_workers` and `num_workers` provided. Only one of the above is allowed as "
                             "workloads cannot be elastic and non-elastic.")
        if gpus_per_worker and not use_gpu:
            raise ValueError("gpus_per_slot is set, but use_gpu is False. use_gpu must be True if gpus_per_slot "
                             "is set. ")
        if use_gpu and isinstance(gpus_per_worker, int) and gpus_per_worker < 1:
            raise ValueError(f"gpus_per_slot must be >= 1: Got {gpus_per_worker}.")
        self.workers: list[Any] = []
        self._pg: Any = None
        self._own_pg = False
        self._server: Any = None
        self._broken: str | None = None
        self._elastic: Any = None
        self._elastic_cls: Any = None
        if min_workers is not None:
            from horovod.ray.elastic import RayHostDiscovery, _ElasticJob

            self.settings = settings if settings is not None else MiniSettings()
            self.settings.elastic = True
            gpus = (gpus_per_worker or 1) * int(use_gpu)
            discovery = getattr(self.settings, "discovery", None)
            if override_discovery or discovery is None:
                discovery = RayHostDiscovery(use_gpu=use_gpu, cpus_per_worker=cpus_per_worker,
                                             gpus_per_worker=gpus or 1)
                self.settings.discovery = discovery
            self._elastic_args = dict(
                discovery=discovery, min_workers=min_workers, max_workers=max_workers, num_workers=min_workers,
                reset_limit=reset_limit, cooldown_range=cooldown_range, elastic_timeout=elastic_timeout,
                timeout_s=float(getattr(self.settings, "timeout_s", 30) or 30), cpus_per_worker=cpus_per_worker,
                gpus_per_worker=gpus, nics=getattr(self.settings, "nics", None))
            self._elastic_cls = _ElasticJob
            return
        if num_workers is not None and num_hosts is not None:
            raise AssertionError("num_workers and num_hosts are exclusive: give one of them")
        if num_workers is None and num_hosts is None and not (use_current_placement_group and _current_pg()):
            raise ValueError("RayExecutor needs num_workers, or num_hosts (with num_workers_per_host)")
        for name, value in (("num_workers", num_workers), ("num_hosts", num_hosts),
                            ("num_workers_per_host", num_workers_per_host)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a whole number >= 1: Got {value!r}.")
        self.settings = settings if settings is not None else MiniSettings()
        if hasattr(self.settings, "elastic"):
            self.settings.elastic = False
        self.num_workers = num_workers
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host
        self.cpus_per_worker = cpus_per_worker
        self.use_gpu = use_gpu
        self.gpus_per_worker = gpus_per_worker if gpus_per_worker is not None else int(use_gpu)
        self.use_current_placement_group = use_current_placement_group

    # ------------------------------------------------------------------ lifecycle
    def start(self, executable_cls: type | None = None, executable_args: list | None = None,
              executable_kwargs: dict | None = None, extra_env_vars: dict | None = None) -> None:
        """Reserve the resources, start one actor per rank, give each its Horovod environment, build
        ``executable_cls(*executable_args, **executable_kwargs)`` in every actor.

        Raises:
            TimeoutError: the placement group was not ready within ``placement_group_timeout_s``.
        """
        if self._elastic_cls_or_none() is not None:
            # Elastic: the actors start in run(), one per slot of the nodes discovery finds (upstream).
            self._elastic = self._elastic_cls(env_vars={k: str(v) for k, v in (extra_env_vars or {}).items()},
                                              **self._elastic_args)
            return
        if self.workers:
            raise RuntimeError("RayExecutor.start() called twice; call shutdown() first")
        try:
            self._start(executable_cls, executable_args, executable_kwargs, extra_env_vars or {})
        except BaseException:
            self.shutdown()
            raise

    def _start(self, executable_cls: type | None, executable_args: list | None, executable_kwargs: dict | None,
               extra_env_vars: dict) -> None:
        from horovod.base import auth
        from horovod.base.config import format_number
        from horovod.runner.rendezvous import RendezvousServer

        bundle_of = self._reserve()
        n = len(bundle_of)
        actor_cls = ray.remote(BaseHorovodWorker)
        gpus = self.gpus_per_worker * int(self.use_gpu)
        self.workers = [
            actor_cls.options(num_cpus=self.cpus_per_worker, num_gpus=gpus, scheduling_strategy=self._placement(b))
            .remote(world_rank=rank, world_size=n)
            for rank, b in enumerate(bundle_of)]
        timeout = float(getattr(self.settings, "timeout_s", 30) or 30)
        node_ids = self._get([w.node_id.remote() for w in self.workers], "report its Ray node")
        self.node_ids = node_ids
        layout = node_layout(node_ids)
        if self.use_gpu:
            visible = share_node_gpus(node_ids, self._get([w.get_gpu_ids.remote() for w in self.workers],
                                                          "report its GPUs"))
        key = auth.make_secret_key()
        tls_env, job_tls = _tls()
        addr = ray.util.get_node_ip_address()
        self._server = RendezvousServer(key, addr=addr, tls=job_tls)
        port = self._server.start()
        common = {"HOROVOD_GLOO_RENDEZVOUS_ADDR": addr, "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
                  "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
                  "HOROVOD_START_TIMEOUT": format_number(timeout), auth.SECRET_KEY_ENV: key.hex(), **tls_env}
        common.update({k: str(v) for k, v in extra_env_vars.items()})
        nics = sorted(getattr(self.settings, "nics", None) or [])
        if nics:
            common["HOROVOD_GLOO_IFACE"] = nics[0]
            common["NCCL_SOCKET_IFNAME"] = ",".join(nics)
        calls = []
        for rank, w in enumerate(self.workers):
            env = dict(zip(("HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE"),
                           layout[rank]))
            env.update(common)
            if self.use_gpu:
                env["CUDA_VISIBLE_DEVICES"] = visible[node_ids[rank]]
            calls.append(w.update_env_vars.remote(env))
        self._get(calls, "take its environment")
        self._get([w.start_executable.remote(executable_cls, executable_args, executable_kwargs)
                   for w in self.workers], "build the executable")
        self._broken = None
        logger.info("horovod.ray: %d ranks on %d node(s), rendezvous store %s:%d", n, len(set(node_ids)), addr, port)

    def _reserve(self) -> list[int]:
        """Create (or inherit) the placement group; the bundle index of every rank (-1: any bundle)."""
        pg = _current_pg() if self.use_current_placement_group else None
        wait = float(getattr(self.settings, "placement_group_timeout_s", 100) or 100)
        if pg is not None:
            logger.info("Found an existing placement group, inheriting. You can disable this behavior by setting "
                        "`use_current_placement_group=False`.")
            self._pg, self._own_pg = pg, False
            n = self.num_workers or self.num_workers_per_host * (self.num_hosts or 1)
            return [-1] * n
        gpus = self.gpus_per_worker * int(self.use_gpu)
        if self.num_workers:
            resources, count = _resources(self.cpus_per_worker, gpus), self.num_workers
            strategy, bundle_of = "PACK", list(range(self.num_workers))
        else:
            assert self.num_hosts is not None
            wph = self.num_workers_per_host
            resources, count = _resources(self.cpus_per_worker * wph, gpus * wph), self.num_hosts
            strategy, bundle_of = "STRICT_SPREAD", [b for b in range(self.num_hosts) for _ in range(wph)]
        self._pg, _ = create_placement_group(resources, count, wait, strategy)
        self._own_pg = True
        return bundle_of

    def _placement(self, bundle: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(placement_group=self._pg, placement_group_bundle_index=bundle)

    def _get(self, refs: list[Any], what: str) -> list[Any]:
        """``ray.get`` of one call per rank during start-up; a dead actor is named."""
        try:
            return ray.get(refs, timeout=max(60.0, float(getattr(self.settings, "placement_group_timeout_s", 100))))
        except ray.exceptions.RayActorError as e:
            rank = next((r for r, ref in enumerate(refs) if _failed(ref)), -1)
            raise WorkerDiedError(f"horovod.ray: the actor of rank {rank} died while starting (it was to {what}): "
                                  f"{_describe(e)}", rank) from e

    def shutdown(self) -> None:
        """Stop every actor (their processes exit), remove the placement group made by ``start()``, stop the
        store.  Safe to call twice; ``start()`` may be called again afterwards."""
        workers, self.workers = self.workers, []
        for w in workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception as e:  # noqa: BLE001 - already gone
                logger.debug("ray.kill: %s", e)
        if self._pg is not None and self._own_pg:
            try:
                ray.util.remove_placement_group(self._pg)
            except Exception as e:  # noqa: BLE001
                logger.debug("remove_placement_group: %s", e)
        self._pg = None
        if self._server is not None:
            self._server.stop()
            self._server = None

    # ------------------------------------------------------------------ running functions
    def _elastic_cls_or_none(self) -> Any:
        return self._elastic_cls

    def run(self, fn: Callable[..., Any], args: list | None = None, kwargs: dict | None = None,
            callbacks: list | None = None) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank; the results in rank order.

        Elastic (``min_workers``): runs the job until a worker of the final generation returns; the results of
        that generation's workers in rank order (``fn`` should use ``hvd.elastic.run``).  ``callbacks``: each
        is called on the driver with every dict a worker passes to :func:`horovod.ray.ray_logger.log`, in
        order, while the job runs, all delivered before ``run`` returns; a callback that raises stops the job
        (``RuntimeError`` from its error).  A static job ignores ``callbacks``, as upstream's.
        """
        if self._elastic_cls_or_none() is not None:
            if self._elastic is None:
                raise RuntimeError("horovod.ray: call RayExecutor.start() before running functions")
            args, kwargs = list(args or []), dict(kwargs or {})
            return self._elastic.run(lambda: fn(*args, **kwargs), callbacks)
        return self._collect(self.run_remote(fn, args, kwargs))

    def run_remote(self, fn: Callable[..., Any], args: list | None = None, kwargs: dict | None = None) -> list[Any]:
        """Start ``fn(*args, **kwargs)`` on every rank; the ObjectRefs in rank order (``ray.get`` them)."""
        self._not_elastic("run_remote")
        args, kwargs = list(args or []), dict(kwargs or {})
        return self._call(lambda _executable: fn(*args, **kwargs))

    def execute(self, fn: Callable[[Any], Any], callbacks: list | None = None) -> list[Any]:
        """``fn(executable)`` on every rank (the object ``start(executable_cls=...)`` built); rank order."""
        self._not_elastic("execute")
        return self._collect(self._call(fn))

    def _not_elastic(self, what: str) -> None:
        if self._elastic_cls_or_none() is not None:
            raise NotImplementedError(f"RayExecutor.{what} is not available for elastic jobs (min_workers); use run")

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` on rank 0 only."""
        self._not_elastic("execute_single")
        self._check_running()
        return self._collect([self.workers[0].run_guarded.remote(fn)], ranks=[0])[0]

    def _check_running(self) -> None:
        if self._broken:
            raise RuntimeError(f"horovod.ray: this executor's workers were stopped ({self._broken}); call start() "
                               "again")
        if not self.workers:
            raise RuntimeError("horovod.ray: call RayExecutor.start() before running functions")

    def _call(self, fn: Callable[[Any], Any]) -> list[Any]:
        self._check_running()
        return [w.run_guarded.remote(fn) for w in self.workers]

    def _collect(self, refs: list[Any], ranks: list[int] | None = None) -> list[Any]:
        """Every rank's result in order, or the root cause's error once every rank has returned."""
        ranks = list(range(len(refs))) if ranks is None else ranks
        rank_of = {ref: r for ref, r in zip(refs, ranks)}
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        pending = list(refs)
        first_return: float | None = None
        left: list[int] = []  # ranks that returned and then left the job, the others still running
        while pending:
            watching = bool(errors) or (bool(results) and not left)
            done, pending = ray.wait(pending, num_returns=1, timeout=0.5 if watching else None, fetch_local=False)
            for ref in done:
                rank = rank_of[ref]
                try:
                    results[rank] = ray.get(ref)
                except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as e:
                    errors[rank] = e
            for rank, e in errors.items():  # again each round: a peer may reach hvd.init() only later
                self._release_waiters(rank, e)
            if results and pending and not errors and not left:
                first_return = first_return or time.monotonic()
                if time.monotonic() - first_return > EARLY_RETURN_GRACE_S:
                    left = self._leave_after_return(sorted(results))
        if left:
            note = (f"horovod.ray: ranks {left} had returned from the function {EARLY_RETURN_GRACE_S:.0f} s before "
                    "the others and then left the job, as a process that exits does: a collective the others "
                    "were waiting in (or started later) could never complete")
            for e in errors.values():
                if hasattr(e, "add_note"):
                    e.add_note(note)
            if not errors:
                self._realign()  # the next run's init() is the same generation on every rank
        if not errors:
            return [results[r] for r in ranks]
        died = sorted(r for r, e in errors.items() if isinstance(e, ray.exceptions.RayActorError))
        if died:
            rank = died[0]
            reason = _describe(errors[rank])
            self._broken = f"the actor of rank {rank} died"
            self.shutdown()
            raise WorkerDiedError(f"horovod.ray: the actor of rank {rank} of {len(self.node_ids)} died: {reason}"
                                  + (f" (ranks {died} died)" if len(died) > 1 else "") + "; every actor of this "
                                  "executor is stopped: call start() again", rank) from errors[rank]
        self._realign()
        root = min(errors, key=lambda r: (_is_consequence(errors[r]), r))
        err = errors[root]
        others = sorted(r for r in errors if r != root)
        if others and hasattr(err, "add_note"):
            err.add_note(f"horovod.ray: ranks {others} failed too (their errors follow from rank {root}'s)")
        raise err

    def _leave_after_return(self, returned: list[int]) -> list[int]:
        """Ranks whose function returned while others still run leave the job (their actors are idle): a peer
        waiting in a collective they will never join fails at once, as when a process of a static job exits,
        instead of waiting for the stall deadline; a peer with only local work left is not affected."""
        ray.get([self.workers[r].leave_job.remote() for r in returned])
        logger.info("horovod.ray: ranks %s returned %.0f s before the others; they left the job", returned,
                    EARLY_RETURN_GRACE_S)
        return returned

    def _release_waiters(self, rank: int, error: BaseException) -> None:
        """A rank failed: if others wait in ``hvd.init()`` for it, tell them through the store at once."""
        server = self._server
        if server is None:
            return
        try:
            states = {}
            for r in range(len(self.workers)):
                raw = server.get(_STATE_KEY.format(rank=r))
                if raw:
                    states[r] = json.loads(raw)
            newest = max((s.get("generation", 0) for s in states.values()), default=0)
            mine = states.get(rank, {}).get("generation", 0)
            if newest > mine:
                server.put(_STATE_KEY.format(rank=rank), json.dumps(
                    {"generation": newest, "error": f"its function failed before it joined: {_describe(error)}"}
                ).encode())
        except Exception as e:  # noqa: BLE001 - only shortens the others' wait (they time out otherwise)
            logger.debug("could not publish rank %d's failure: %s", rank, e)

    def _realign(self) -> None:
        """After a failed run: every rank leaves the job and counts the same ``init()`` attempts."""
        states = ray.get([w.horovod_state.remote() for w in self.workers])
        newest = max(g for g, _ in states)
        ray.get([w.realign.remote(newest) for w in self.workers])


@dataclasses.dataclass
class StaticParams(BaseParams):
    """Parameters of a static job (upstream's; see :class:`RayExecutor` for each)."""

    num_workers: int | None = None
    num_hosts: int | None = None
    num_workers_per_host: int = 1
    use_current_placement_group: bool = True

    @property
    def elastic(self) -> bool:
        return False

    @property
    def adapter(self) -> type:
        return StaticAdapter


class StaticAdapter(_ExecutorAdapter):
    """Upstream's adapter of a static job: a :class:`RayExecutor` of these parameters (``self.executor``), its
    workers in ``self.workers`` once started."""

    def __init__(self, settings: Any, num_workers: int | None = None, num_hosts: int | None = None,
                 num_workers_per_host: int = 1, cpus_per_worker: int = 1, use_gpu: bool = False,
                 gpus_per_worker: int | None = None, use_current_placement_group: bool = True) -> None:
        self.settings = settings
        self.executor = RayExecutor(settings, num_workers=num_workers, num_hosts=num_hosts,
                                    num_workers_per_host=num_workers_per_host, cpus_per_worker=cpus_per_worker,
                                    use_gpu=use_gpu, gpus_per_worker=gpus_per_worker,
                                    use_current_placement_group=use_current_placement_group)
        self.num_workers, self.num_hosts, self.num_workers_per_host = num_workers, num_hosts, num_workers_per_host
        self.cpus_per_worker, self.use_gpu = cpus_per_worker, use_gpu
        self.gpus_per_worker = gpus_per_worker or 1
        self.use_current_placement_group = use_current_placement_group

    @property
    def workers(self) -> list[Any]:
        return self.executor.workers


def node_layout(node_ids: list[str]) -> list[tuple[int, int, int, int]]:
    """(local_rank, local_size, cross_rank, cross_size) of every rank, grouped by node in first-seen order."""
    by_node: dict[str, list[int]] = {}
    for rank, node in enumerate(node_ids):
        by_node.setdefault(node, []).append(rank)
    cross_sizes: dict[int, int] = {}
    out: dict[int, tuple[int, int, int, int]] = {}
    for ranks in by_node.values():
        for local_rank, rank in enumerate(ranks):
            out[rank] = (local_rank, len(ranks), cross_sizes.get(local_rank, 0), 0)
            cross_sizes[local_rank] = cross_sizes.get(local_rank, 0) + 1
    return [(lr, ls, cr, cross_sizes[lr]) for lr, ls, cr, _ in (out[r] for r in range(len(node_ids)))]


def _current_pg() -> Any:
    from ray.util import get_current_placement_group

    try:
        return get_current_placement_group()
    except Exception:  # noqa: BLE001 - outside a Ray worker or before ray.init
        return None


def _tls() -> tuple[dict[str, str], Any]:
    """``HOROVOD_TLS=1`` in the driver's environment: a job certificate for the store and the ranks."""
    from horovod.base.config import read_env

    if not read_env("HOROVOD_TLS"):
        return {}, None
    from horovod.transport import tls as tls_mod

    creds = tls_mod.make_credentials()
    return tls_mod.worker_env(creds), tls_mod.JobTls(creds)


def _failed(ref: Any) -> bool:
    try:
        ray.get(ref, timeout=0)
        return False
    except ray.exceptions.GetTimeoutError:
        return False
    except Exception:  # noqa: BLE001
        return True


def _describe(e: BaseException) -> str:
    """One line about a rank's failure: the user's exception, or why Ray says the actor died."""
    cause = getattr(e, "cause", None)
    if isinstance(e, ray.exceptions.RayTaskError) and isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}".splitlines()[0]
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    reason = [line for line in lines if "actor is dead because" in line.lower() or "died" in line.lower()]
    return (reason or lines or [type(e).__name__])[-1 if reason else 0]


def _is_consequence(e: BaseException) -> bool:
    """An error that only follows from another rank's failure (shut-down notice, generation mismatch)."""
    from horovod.base.exceptions import ShutdownError, follows_from_another_rank
    from horovod.common.bootstrap import GenerationMismatch

    cause = getattr(e, "cause", None)
    text = f"{type(cause).__name__}: {cause}" if cause is not None else str(e)
    return isinstance(cause, (ShutdownError, GenerationMismatch)) or follows_from_another_rank(text)

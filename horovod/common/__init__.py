"""The facade the framework adapters call: ``basics`` (init/rank/size), ``ops`` (one submit function per
collective), ``process_sets``, ``handles`` (the async API's integer handles) and ``bootstrap`` (how a process
joins the job), above the engine (``horovod.runtime``), the transport and the floor (``horovod.base``).

Upstream's module paths live here too (``horovod.common.util``, ``horovod.common.exceptions``, ...).
See docs/architecture.md (Layers, Facade → adapters).
"""

"""The floor every other layer stands on: definitions with no dependency inside the package.

``horovod.transport``, ``horovod.runtime``, the ``horovod.common`` facade and the launchers import from here;
nothing here imports from them.  See docs/architecture.md (Layers).
"""

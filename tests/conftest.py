"""Collection rules for the whole suite.

``tests/parallel/`` holds files that run on every rank in lockstep under the launcher
(``horovodrun -np N python -m pytest tests/parallel/<file>``); outside a launcher they are driven by
``tests/test_parallel.py``, so the normal run does not collect them directly.
"""

import os

collect_ignore_glob: list[str] = []
if not any(os.environ.get(v) for v in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")):  # + mpirun
    collect_ignore_glob.append("parallel/*")

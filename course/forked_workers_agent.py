"""torchrun's agent, started with what its forked workers will need already imported.

:func:`course.torchrun_runner.run_torchrun` starts agents as ``python -m
course.forked_workers_agent <torchrun flags>`` when workers are forked from their agent
(``--start-method=fork``): each worker is then a copy of this process, and whatever the agent
imported is in the worker's memory. ``torch._dynamo`` is the import that matters: the first
optimizer a process builds imports it (``torch.optim`` calls go through ``torch._disable_dynamo``,
which imports it on first use; torch/__init__.py), and so does DistributedDataParallel's
constructor: about 2.8 s of CPU on a 2-core machine, once per worker and per restart attempt,
against once per agent here. ``course.world``'s fork server preloads it for the same reason.

The agent itself is torchrun's own ``main`` (torch/distributed/run.py) reading the same argv:
rendezvous, restarts, logs and exit status are what ``python -m torch.distributed.run`` gives.
"""

from __future__ import annotations

import atexit
import gc

import torch._dynamo  # noqa: F401  (imported for the workers: see the docstring)
from torch.distributed.run import main

if __name__ == "__main__":
    # what the workers inherit stays out of their garbage collector's walks (see
    # course/world_preload.py); handed back at the agent's exit
    gc.freeze()
    atexit.register(gc.unfreeze)
    main()

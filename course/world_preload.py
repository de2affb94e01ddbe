"""Imported by the fork server of :mod:`course.world` only: it imports the modules a caller named.

Each rank of a world is a fork of one server process, so whatever the server imported before
forking is already in the rank's memory. The server imports torch itself; a caller adds the
modules its ranks will need with :func:`course.world.preload_in_worlds` (the tests add pytest and
the grader modules they selected: a rank unpickles its function from its grader's module, which
imports pytest and the course's helpers, about 0.2 s of CPU per rank on a 2-core machine, more
than the rank's own work in most tests).

The names travel in the environment (``course.world.PRELOAD_ENV``), since the server is a fresh
interpreter. A module that fails to import here is skipped without a word: the rank that needs it
imports it again and reports the error where it belongs.

Then every object the server holds is frozen (``gc.freeze()``, the recipe of the gc module's
documentation for processes that fork without exec): a rank's garbage collector no longer walks
the 340,000 objects torch and its friends left in the server, nor writes to their pages (which
copies each page into the rank). A full collection in a rank of exercise 4.7's world of 4 took
0.6 s of its 2.6 s of CPU before (2 cores; the notes on issue 26, 2026-11-28).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib

from course.world import preload_names

for _name in preload_names():
    # BaseException: a module may call pytest.skip at import (Skipped is not an Exception)
    with contextlib.suppress(BaseException):
        importlib.import_module(_name)

gc.freeze()  # last: see the module docstring
# At the server's exit the objects are handed back, so that the interpreter's shutdown frees them
# (else extensions such as triton's report them as leaked). Ranks leave with os._exit: no atexit.
atexit.register(gc.unfreeze)

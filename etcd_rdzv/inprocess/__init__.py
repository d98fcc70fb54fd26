"""Recovery without a restart: a training function run, and after a failure run
again, in the same process, through the rounds of a rendezvous.

:func:`run` joins a round, builds a :class:`Round` (rank, world size, the round's
store, the process group built on it) and calls the function with it; when the
function raises (a peer died, froze or failed, or its own error), the round is torn
down and the function called again in the next round, with the new rank and world
size. See docs/inprocess.md.

:mod:`.nvrx` (imported on its own, never from here) gives NVIDIA's in-process
``Wrapper`` its stores on etcd; it imports NVRx (see docs/inprocess-nvrx.md).

Importing this package does not import torch; :func:`run` does (through
:mod:`etcd_rdzv.torch`). The package imports the config, the rendezvous core and
the torch integration; nothing of the package imports it.
"""

from .round import DEFAULT_PG_TIMEOUT, Regroup, Round, RoundBroken
from .runner import DEFAULT_MAX_FAILURES, TooManyFailures, run

__all__ = [
    "DEFAULT_MAX_FAILURES",
    "DEFAULT_PG_TIMEOUT",
    "Regroup",
    "Round",
    "RoundBroken",
    "TooManyFailures",
    "run",
]

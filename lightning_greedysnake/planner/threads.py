"""How many intra-op threads the optimizer lane's kernels get (pure arithmetic over the machine's cores).

On a CPU run the training thread's kernels use every core: the lane takes one, as two full OpenMP teams
spinning against each other slow both down badly (measured on the 2-core machine this was built on). With
a GPU the training thread mostly launches kernels and the I/O threads mostly wait in O_DIRECT system
calls: the host optimizer step, which binds every host-tier placement there, gets the cores they do not
need. The planner and the roofline measure the optimizer's rate at this count (``optimizer_rate(threads=)``).
"""

from __future__ import annotations

TRAINING_THREAD_CORES = 1
"""With a GPU: the training thread (kernel launches, the Python of the engine) keeps one core."""

IO_CORES = 1
"""With a GPU: one core for the I/O threads and the copy-completion threads together (they block in the
kernel or the driver almost all the time)."""


def optimizer_threads(cores: int, *, device_tier: bool, local_processes: int = 1, given: int | None = None) -> int:
    """The lane's intra-op threads: ``given`` (``offload.optimizer_threads``) if set; else 1 when the model
    computes on the host (no ``device_tier``); else this process's share of ``cores`` (the node's
    processes split them evenly) less the training thread's and the I/O threads' cores, at least 1."""
    if given is not None:
        return given
    if not device_tier:
        return 1
    mine = max(1, cores // max(1, local_processes))
    return max(1, mine - TRAINING_THREAD_CORES - IO_CORES)

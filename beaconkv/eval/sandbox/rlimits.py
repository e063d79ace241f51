"""Resource limits of the program: the rlimits of the fallback containment (set between fork and exec) and the
stack size of the threads Python starts, so that threads fit under ``RLIMIT_AS``.

The namespace containment sets the same rlimits in the box's last process (:mod:`.namespaces`), with the
task cap defined here (``_MAX_TASKS``: 64 threads besides the main one).
"""

from __future__ import annotations

import resource

from .limits import SandboxLimits

_MAX_THREADS = 64  # threads the program may start besides its main thread when max_processes == 1
_MAX_TASKS = _MAX_THREADS + 1  # RLIMIT_NPROC / pids.max counts the main thread too
# Python threads' stack: 1/128 of the process's address space, so that _MAX_THREADS stacks take at
# most half of it, between these bounds (8 MiB is glibc's default, from RLIMIT_STACK).
_THREAD_STACK_SHARE = 128
_THREAD_STACK_MIN = 256 << 10
_THREAD_STACK_MAX = 8 << 20
_THREAD_STACK_ALIGN = 64 << 10  # a multiple of every page size (4, 16 and 64 KiB)


def _set_limits(limits: SandboxLimits) -> None:
    """Runs in the child between fork and exec (fallback path)."""
    cpu = limits.cpu_s if limits.cpu_s is not None else int(limits.timeout_s) + 2
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    if limits.memory_mb is not None:
        size = limits.memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (size, size))
    fsize = limits.file_size_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits.max_open_files, limits.max_open_files))


def _thread_stack_bytes(limits: SandboxLimits, namespaced: bool) -> int | None:
    """The stack of the threads Python starts in the program, or ``None`` for the platform's.

    Every thread reserves its whole stack in the address space that ``RLIMIT_AS`` bounds, and
    glibc's default is ``RLIMIT_STACK`` (8 MiB): 64 threads would reserve 512 MiB. A stack of
    1/128 of the process's address space (8 MiB at most, 256 KiB at least) keeps 64 threads within
    half of it: 4 MiB at ``memory_mb=512``, the platform's 8 MiB from 1024 MiB up. The main
    thread keeps its ``RLIMIT_STACK``; a program may still choose its own size
    (``threading.stack_size``).
    """
    if limits.memory_mb is None:
        return None
    share = limits.max_processes if (namespaced and limits.max_processes > 1) else 1
    size = ((limits.memory_mb << 20) // share) // _THREAD_STACK_SHARE
    size = size // _THREAD_STACK_ALIGN * _THREAD_STACK_ALIGN
    return max(_THREAD_STACK_MIN, min(_THREAD_STACK_MAX, size))

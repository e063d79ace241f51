"""What a sandboxed run is given and what it returns: :class:`SandboxLimits`, :class:`SandboxResult`, and
:class:`SandboxUnavailable` when the namespace containment asked for cannot start.

The containments themselves are described in :mod:`beaconkv.eval.sandbox`.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Literal

try:
    from ...errors import BeaconKVError
except ImportError:  # loaded by path as the box's own helper (``python -I -S helper.py``): the standard library only
    class BeaconKVError(Exception):  # type: ignore[no-redef]
        """Stands in for :class:`beaconkv.errors.BeaconKVError` inside the box, where nothing raises it."""

__all__ = ["SandboxLimits", "SandboxResult", "SandboxUnavailable"]

_CONTAINMENTS = ("namespaces", "rlimits")
_RLIMITS_OPT_IN = "SandboxLimits(containment='rlimits') (`beaconkv eval --sandbox rlimits`)"


class SandboxUnavailable(BeaconKVError, RuntimeError):
    """The namespace containment asked for cannot start here; nothing ran.

    The message names the reason (the probe's error) and the explicit opt-in for the rlimits-only
    fallback, which contains much less (see the module docstring).
    """


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits and containment of one sandboxed run.

    Attributes:
        timeout_s: Wall-clock limit in seconds.
        memory_mb: Memory limit in MiB: ``RLIMIT_AS`` per process, and the whole process tree's
            memory (see the module docstring for how); ``None`` for no limit.
        cpu_s: CPU-time limit in seconds; ``None`` means ``ceil(timeout_s) + 1``.
        file_size_mb: Largest file the program may write, stdout/stderr included (a stream that
            reaches it is reported as ``"output-limit"``); also the size of the working folder's
            tmpfs under namespace containment.
        max_open_files: ``RLIMIT_NOFILE``.
        network: ``"auto"``: a network namespace when available, else the Python-level block;
            ``"namespace"``: require the namespace (error if unavailable); ``"python"``: only the
            Python-level block.
        containment: ``"namespaces"`` (the default): the namespace containment, and
            :class:`SandboxUnavailable` where it cannot start; ``"rlimits"``: the rlimits-only
            fallback, an explicit opt-in (what it does not contain is listed in the module
            docstring).
        max_processes: Processes the program may run at once, itself included. ``1`` (the
            default): creating processes fails with ``PermissionError`` (up to 64 threads
            besides the main one work).
            ``n > 1``: at most ``n`` tasks (processes and threads together) and, without a cgroup,
            ``memory_mb / n`` of address space per process. Namespace containment only; the
            fallback caps nothing.
        cgroup_parent: A cgroup v2 directory whose ``cgroup.subtree_control`` enables ``memory``
            and ``pids`` and in which this process may create cgroups; each run then gets a child
            cgroup there. ``None``: the grader's own cgroup if it qualifies, else rlimits.
    """

    timeout_s: float = 6.0
    memory_mb: int | None = 1024
    cpu_s: int | None = None
    file_size_mb: int = 64
    max_open_files: int = 256
    network: Literal["auto", "namespace", "python"] = "auto"
    containment: Literal["namespaces", "rlimits"] = "namespaces"
    max_processes: int = 1
    cgroup_parent: str | None = None

    def __post_init__(self) -> None:
        if self.containment not in _CONTAINMENTS:
            hint = (" ('auto' is gone: it fell back to rlimits without a word; ask for 'rlimits' "
                    "explicitly where namespaces cannot work)" if self.containment == "auto" else "")
            raise ValueError(
                f"containment={self.containment!r} is not one of 'namespaces', 'rlimits'{hint}"
            )
        if self.network not in ("auto", "namespace", "python"):
            raise ValueError(f"network={self.network!r} is not one of 'auto', 'namespace', 'python'")
        if not isinstance(self.max_processes, int) or self.max_processes < 1:
            raise ValueError(
                f"max_processes={self.max_processes!r} must be an integer >= 1 "
                "(1 forbids creating processes)"
            )


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one sandboxed run.

    Attributes:
        returncode: Exit status (negative: killed by that signal).
        stdout: Captured stdout (decoded UTF-8, errors replaced), whole: the output cap
            (``file_size_mb``, 64 MiB by default) bounds it, which is the bound on what a run
            hands the grader: at most ``file_size_mb`` Mi characters, one byte each for ASCII
            output (up to four each where a character beyond U+FFFF widens the whole string).
            Lower ``file_size_mb`` to lower it. When ``output_limited``, only its first MiB.
        stderr: Captured stderr (decoded likewise), only its last MiB: it serves diagnostics
            (the end of a traceback), so megabytes of debug lines cost the grader one MiB.
        timed_out: Whether the wall or CPU limit was hit.
        wall_s: Elapsed seconds.
        containment: How the run was contained: ``"namespaces+cgroup"``, ``"namespaces+rlimit"``
            or ``"rlimits-only"`` (see the module docstring).
        output_limited: Whether stdout or stderr reached ``file_size_mb``.
        memory_exceeded: Whether the cgroup's memory limit killed a process of the run.
    """

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    wall_s: float
    containment: str = "rlimits-only"
    output_limited: bool = False
    memory_exceeded: bool = False

    @property
    def status(self) -> str:
        """One word: ``ok``, ``timeout``, ``memory``, ``output-limit`` or ``error``."""
        if self.output_limited:
            return "output-limit"
        if self.timed_out:
            return "timeout"
        if self.memory_exceeded:
            return "memory"
        if self.returncode == 0:
            return "ok"
        if self.returncode == -signal.SIGXFSZ:
            return "output-limit"
        if "MemoryError" in self.stderr[-2000:]:
            return "memory"
        return "error"

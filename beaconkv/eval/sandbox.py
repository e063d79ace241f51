"""Run untrusted Python (generated programs) in a contained subprocess with limits.

The graders run programs written by a model; this module keeps them from reading or changing the
host, from outliving the grading, from signalling the grader and from taking the machine's memory.
:func:`run_python` runs one of two containments, chosen by the caller
(:attr:`SandboxLimits.containment`), and names the one that ran in :attr:`SandboxResult.containment`.
Nothing degrades silently: when the namespace containment (the default) cannot start here,
:func:`run_python` raises :class:`SandboxUnavailable` with the reason and the explicit opt-in for the
weaker fallback (``SandboxLimits(containment="rlimits")``, ``beaconkv eval --sandbox rlimits``).

**Namespaces** (``"namespaces+cgroup"`` or ``"namespaces+rlimit"``), used where unprivileged user
namespaces work (Linux on x86-64 or aarch64; probed once per process, see
:func:`namespace_sandbox_available`). A helper
process (this file run as a script, so the grader stays single-purpose) creates new user, mount,
PID, IPC, UTS, cgroup and network namespaces, and then:

* **File system**: the program sees a fresh, read-only root that holds only the system directories
  (``/usr``, ``/bin``, ``/lib*``, ``/sbin``), the Python installation and virtual environment
  running the grader, the dynamic linker's files of ``/etc`` (plus a generated ``passwd`` and
  ``group``), ``/dev/{null,zero,full,random,urandom}`` (no ``/dev/shm``) and its own ``/proc``
  (read-only). The rest of the host (home directories, ``/tmp``, the project checkout,
  ``/etc/hostname``, other users' files) does not exist there. The only writable place is the
  working folder ``/sandbox`` (also ``HOME`` and ``TMPDIR``), a private tmpfs of
  ``file_size_mb`` MiB that holds a copy of the files and disappears with the run.
  Every bound path is resolved first (``realpath``), so a symlink cannot widen what is shown: the
  Python installation is the real binary's prefix, ``dirname(dirname(realpath(sys.executable)))``
  (a grader started through ``~/bin/python``, a link, shows the installation the link points to,
  not ``~``), with the standard library's prefix and the venv's folder (which holds
  ``pyvenv.cfg``); an installation that is ``/``, a home directory, the temporary folder or a
  folder holding one of them is refused (:class:`SandboxUnavailable`). An ``/etc`` file or
  ``/dev`` node that links elsewhere is shown as a link into what is already bound, as the file
  it names when that stays in ``/etc`` (``/dev``: a character device in ``/dev``), or not at
  all. Only plain files and folders are copied into the working folder.
* **Processes**: the program runs under an init process of its own PID namespace. When the program
  exits (or is killed at the timeout), the init exits and the kernel kills every process left in
  the namespace (``setsid``, double forks and daemons included) before :func:`run_python` returns.
  The grader and the helper are outside the namespace: their PIDs do not exist for the program, and
  the init ignores signals sent from inside.
* **Privileges**: when the grader runs as root, the program runs as an unprivileged host user
  (uid/gid :data:`SANDBOX_HOST_ID`, seen as 1000 inside); otherwise as the grader's own uid (seen
  as 0 inside). Either way it holds no capabilities, cannot gain any (``no_new_privs``, ``nosuid``
  mounts, an empty bounding set) and a seccomp filter refuses ``unshare``, ``setns``, ``clone3``,
  namespace flags to ``clone``, the kernel keyrings and io_uring (``io_uring_setup``,
  ``io_uring_enter``, ``io_uring_register`` fail with ``ENOSYS``).
* **Network**: a network namespace with no interface but a down loopback (unless
  ``network="python"``), in addition to the Python-level block.
* **Memory of the whole process tree**: with a cgroup v2 whose ``memory`` and ``pids`` controllers
  are delegated to this process (:attr:`SandboxLimits.cgroup_parent`, or the grader's own cgroup
  when its ``cgroup.subtree_control`` enables both), each run gets a child cgroup with
  ``memory.max`` (``memory_mb`` plus 16 MiB for the sandbox's own init processes),
  ``memory.swap.max = 0`` and ``pids.max``: ``"namespaces+cgroup"`` (cgroup v1 hierarchies are
  never used). Otherwise
  ``"namespaces+rlimit"``: ``RLIMIT_AS`` per process and a process cap, so that the tree's total
  address space stays within ``memory_mb``: with ``max_processes=1`` (the default) the seccomp filter
  refuses to create processes (up to 64 threads besides the main one are allowed and share the
  one address space); with
  ``max_processes=n > 1``, ``RLIMIT_NPROC`` caps the program at ``n`` tasks (processes and threads
  together) and each process gets ``memory_mb / n`` of address space. ``RLIMIT_NPROC`` is counted per
  user namespace, so concurrent runs do not share it (where it cannot apply, the program's host uid
  being 0, creating processes is refused whatever ``max_processes``).

**Fallback** (``"rlimits-only"``), only when asked for with ``SandboxLimits(containment="rlimits")``
(for a machine where namespaces are unavailable: ``unshare`` refused, e.g. in a container with the
default seccomp profile, or ``kernel.unprivileged_userns_clone=0``): the program runs directly under
``preexec_fn`` limits in its own session. What the fallback does **not** contain:

* the file system: everything the grader's user may read is readable (``/etc/hostname``, home
  directories, the project checkout, other runs' files), and everything it may write is writable;
  only the working directory is fresh;
* processes: a process that leaves the process group (``setsid``, a double fork) survives the run
  and keeps running after :func:`run_python` returns; there is no cap on the number of processes
  (``RLIMIT_NPROC`` counts all of the user's processes and root ignores it);
* the grader: the program runs as the grader's user and may signal it (``os.kill(os.getppid(),
  signal.SIGKILL)`` kills the grader) or any other process of that user;
* memory: ``RLIMIT_AS`` bounds each process, not the tree: ``k`` forked children may use ``k``
  times ``memory_mb``;
* the network: blocked only by the Python-level guard (bypassable through ``_socket`` or
  ``ctypes``) unless ``unshare --user --net`` works, in which case a network namespace is used.

What both containments enforce: the wall-clock limit (``timeout_s``; the fallback kills the
process group, the namespaces everything), the CPU limit (``RLIMIT_CPU``), ``RLIMIT_AS``,
``RLIMIT_FSIZE`` (also on stdout/stderr, which go to files outside the sandbox), ``RLIMIT_NOFILE``,
no core dumps, ``python -I -B`` with a minimal environment (no proxies, tokens or credentials of the
parent), the Python-level socket block, and the output cap: a program whose stdout or stderr
reaches ``file_size_mb`` gets the status ``"output-limit"``; what is read back into the grader is
bounded (stdout: at most ``file_size_mb`` MiB, only the first MiB past the cap; stderr: its last
MiB; see :class:`SandboxResult`).

Threads under ``RLIMIT_AS``: every thread reserves its whole stack in the address space, and glibc
gives threads malloc arenas of 64 MiB of address space each; at ``memory_mb=512`` that stopped a
program at 14 threads with most of its memory unused. So the program runs with
``MALLOC_ARENA_MAX=1`` and the threads Python starts get a stack of 1/128 of the process's memory
limit (at most the usual 8 MiB, 4 MiB at 512 MiB; the main thread keeps ``RLIMIT_STACK``): 64
threads then take at most half of the limit.

The namespace containment is a kernel-level sandbox, not a virtual machine: a kernel exploit
escapes it. Run evaluations of hostile code inside a VM if that matters.
"""

from __future__ import annotations

import functools
import json
import os
import re
import resource
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

try:
    from beaconkv.errors import BeaconKVError
except ImportError:  # run by path as the box's own helper (``python -I -S sandbox.py``): the standard library only
    class BeaconKVError(Exception):  # type: ignore[no-redef]
        """Stands in for :class:`beaconkv.errors.BeaconKVError` inside the box, where nothing raises it."""

__all__ = [
    "SANDBOX_HOST_ID",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailable",
    "check_containment",
    "namespace_sandbox_available",
    "network_namespace_available",
    "run_python",
]

#: Prepended to every sandboxed run: blocks the socket module before user code runs.
NETWORK_GUARD = '''\
import socket as _socket_module


def _beaconkv_no_network(*args, **kwargs):
    raise PermissionError("network access is disabled in the beaconkv sandbox")


class _BeaconkvNoSocket(_socket_module.socket):
    def __init__(self, *args, **kwargs):
        _beaconkv_no_network()


_socket_module.socket = _BeaconkvNoSocket
for _name in ("create_connection", "create_server", "getaddrinfo", "gethostbyname",
              "gethostbyname_ex", "gethostbyaddr", "socketpair", "fromfd"):
    if hasattr(_socket_module, _name):
        setattr(_socket_module, _name, _beaconkv_no_network)
del _name, _socket_module
'''

SANDBOX_HOST_ID = 2_000_000_000
"""Host uid and gid of sandboxed programs when the grader runs as root (1000 inside the sandbox).
Chosen far above ordinary users so that it owns no host file."""

_INSIDE_ID = 1000  # the program's uid/gid inside the namespace when SANDBOX_HOST_ID is mapped
_INSIDE_DIR = "/sandbox"  # the working folder, as the program sees it
_HELPER_FLAG = "--beaconkv-sandbox-helper"
_HELPER_GRACE_S = 10.0  # the helper's own start and teardown, beyond timeout_s
_KEPT_OUTPUT_BYTES = 1 << 20  # stdout that hit the output limit: its first MiB; stderr: its last MiB
_MAX_THREADS = 64  # threads the program may start besides its main thread when max_processes == 1
_MAX_TASKS = _MAX_THREADS + 1  # RLIMIT_NPROC / pids.max counts the main thread too
# Python threads' stack: 1/128 of the process's address space, so that _MAX_THREADS stacks take at
# most half of it, between these bounds (8 MiB is glibc's default, from RLIMIT_STACK).
_THREAD_STACK_SHARE = 128
_THREAD_STACK_MIN = 256 << 10
_THREAD_STACK_MAX = 8 << 20
_THREAD_STACK_ALIGN = 64 << 10  # a multiple of every page size (4, 16 and 64 KiB)
# What the sandbox's root shows of the host (see _mount_plan), besides the interpreter.
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_DEV_NODES = ("null", "zero", "full", "random", "urandom")
_ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime")
_HELPER_TASKS = 2  # the helper's two processes inside the user namespace (unshare-er and init)
_CGROUP_SLACK_MB = 16  # memory.max headroom for those two processes
#: Set by tests only: map just the grader's uid (what an unprivileged grader gets) even as root.
_FORCE_SINGLE_ID_MAP = False
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


@functools.cache
def network_namespace_available() -> bool:
    """Whether ``unshare --user --net`` can start a process here (cached).

    Returns:
        ``True`` if a network namespace can be created without privileges.
    """
    exe = shutil.which("unshare")
    if exe is None or not sys.platform.startswith("linux"):
        return False
    try:
        proc = subprocess.run(
            [exe, "--user", "--net", "--map-root-user", "true"],
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def namespace_sandbox_available() -> bool:
    """Whether the namespace containment works here (probed once per process with a tiny program).

    Returns:
        ``True`` if :func:`run_python` can contain programs with namespaces.
    """
    return _namespace_probe()[0]


def check_containment(limits: SandboxLimits | None = None) -> str:
    """The containment :func:`run_python` will use with these limits, or why it cannot run.

    Call it before work whose grading needs the sandbox (an evaluation run checks it before it
    generates anything).

    Args:
        limits: The limits (default :class:`SandboxLimits`).

    Returns:
        ``"namespaces+cgroup"``, ``"namespaces+rlimit"`` or ``"rlimits-only"``.

    Raises:
        SandboxUnavailable: The namespace containment is asked for and cannot start here.
        ValueError: ``limits.cgroup_parent`` is not a usable cgroup.
    """
    limits = limits or SandboxLimits()
    parent = _cgroup_parent(limits.cgroup_parent)  # a bad explicit cgroup is an error on every path
    if limits.containment == "rlimits":
        return "rlimits-only"
    works, why = _namespace_probe()
    if not works:
        raise SandboxUnavailable(
            f"the namespace sandbox cannot start here: {why}. Enable unprivileged user namespaces "
            "(sysctl kernel.unprivileged_userns_clone=1, user.max_user_namespaces > 0; in a container, "
            "a seccomp profile that allows unshare), or grade with the rlimits-only fallback, which "
            f"does not contain the file system, processes or signals: {_RLIMITS_OPT_IN}"
        )
    return "namespaces+cgroup" if parent is not None else "namespaces+rlimit"


@functools.cache
def _namespace_probe() -> tuple[bool, str]:
    """``(works, why not)``: runs ``print('ok')`` through the namespace path once."""
    if not sys.platform.startswith("linux"):
        return False, f"namespaces need Linux, this is {sys.platform}"
    if _machine() not in _SECCOMP_TABLES:
        return False, f"no seccomp syscall table for {_machine()!r} (known: {sorted(_SECCOMP_TABLES)})"
    try:
        result = _run(
            {"probe.py": "print('ok')"}, "probe.py", (), "", SandboxLimits(timeout_s=20.0),
            namespaced=True,
        )
    except (OSError, RuntimeError, ValueError) as exc:
        return False, str(exc)
    if result.returncode != 0 or result.stdout != "ok\n":
        return False, f"the probe program failed (exit {result.returncode}): {result.stderr[-500:]}"
    return True, ""


def _machine() -> str:
    return os.uname().machine


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


def _clean_env(home: str) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": home,
        "TMPDIR": home,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        # glibc gives each thread that allocates under contention an arena of its own, each
        # reserving 64 MiB of address space: under RLIMIT_AS that, not memory, capped a program at
        # about 14 threads. Python allocates under its GIL, so one arena costs next to nothing.
        "MALLOC_ARENA_MAX": "1",
    }


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


def _prelude(limits: SandboxLimits, namespaced: bool) -> str:
    """What is prepended to the script: the network guard and the threads' stack size."""
    stack = _thread_stack_bytes(limits, namespaced)
    if stack is None:
        return NETWORK_GUARD
    return NETWORK_GUARD + (
        f"import _thread as _beaconkv_thread\n_beaconkv_thread.stack_size({stack})\n"
        "del _beaconkv_thread\n"
    )


def run_python(
    files: Mapping[str, str],
    script: str,
    args: Sequence[str] = (),
    *,
    stdin: str = "",
    limits: SandboxLimits | None = None,
) -> SandboxResult:
    """Run a Python script in a fresh working folder, contained and under resource limits.

    The ``files`` are written into an empty folder, which becomes the working directory;
    ``script`` (one of them) runs with ``python -I -B -X utf8`` after the network guard
    (:data:`NETWORK_GUARD`) and, under a memory limit, a line that sets the stack of the threads
    it starts (1/128 of its memory, at most the usual 8 MiB: 64 threads fit in half the limit) have
    been prepended to it (so the script must not start with a ``from __future__`` import).
    Everything is deleted afterwards, and no process of the program survives the call under
    namespace containment. The fallback sets its limits in ``preexec_fn``; call this from the
    main thread of a process that does not fork concurrently.

    Args:
        files: File name (relative, no ``..``) -> content.
        script: The file of ``files`` to run.
        args: Command line arguments for the script.
        stdin: Text fed to the program's stdin.
        limits: Limits and containment (default :class:`SandboxLimits`).

    Returns:
        The :class:`SandboxResult`; its ``containment`` says which containment was used.

    Raises:
        ValueError: If ``script`` is not in ``files``, a file name escapes the directory, or
            ``limits.cgroup_parent`` is not a usable cgroup.
        SandboxUnavailable: If the namespace containment (the default) cannot start here.
        RuntimeError: If ``limits.network == "namespace"`` and that is unavailable, or if the
            namespace sandbox fails in a run after its probe worked.
    """
    limits = limits or SandboxLimits()
    if script not in files:
        raise ValueError(f"script {script!r} is not one of the files {sorted(files)}")
    containment = check_containment(limits)
    return _run(files, script, args, stdin, limits, namespaced=containment != "rlimits-only")


def _run(
    files: Mapping[str, str],
    script: str,
    args: Sequence[str],
    stdin: str,
    limits: SandboxLimits,
    *,
    namespaced: bool,
) -> SandboxResult:
    with tempfile.TemporaryDirectory(prefix="beaconkv-sandbox-") as root:
        work = Path(root, "work")
        io_dir = Path(root, "io")
        work.mkdir()
        io_dir.mkdir()
        for name, content in files.items():
            target = (work / name).resolve()
            if work.resolve() not in target.parents:
                raise ValueError(f"file name {name!r} escapes the sandbox directory")
            target.parent.mkdir(parents=True, exist_ok=True)
            if name == script:
                content = _prelude(limits, namespaced) + "\n" + content
            target.write_text(content, encoding="utf-8")
        (io_dir / "stdin").write_text(stdin, encoding="utf-8")
        start = time.monotonic()
        with (
            open(io_dir / "stdin", "rb") as fin,
            open(io_dir / "stdout", "wb") as fout,
            open(io_dir / "stderr", "wb") as ferr,
        ):
            if namespaced:
                returncode, timed_out, extra = _run_namespaced(
                    Path(root), work, script, args, limits, fin, fout, ferr
                )
            else:
                returncode, timed_out, extra = _run_rlimits(work, script, args, limits, fin, fout, ferr)
        wall = time.monotonic() - start
        if returncode in (-signal.SIGXCPU, -signal.SIGKILL) and wall >= limits.timeout_s:
            timed_out = True
        if returncode == -signal.SIGXCPU:
            timed_out = True
        cap = limits.file_size_mb * 1024 * 1024
        stdout, out_limited = _read_capped(io_dir / "stdout", cap)
        stderr, err_limited = _read_tail(io_dir / "stderr", cap)
    return SandboxResult(
        returncode, stdout, stderr, timed_out, wall,
        output_limited=out_limited or err_limited, **extra,
    )


def _read_capped(path: Path, cap: int) -> tuple[str, bool]:
    """Read captured stdout: whole if under ``cap`` bytes, else its first MiB and ``True``.

    ``RLIMIT_FSIZE`` stops the stream's file at exactly ``cap`` bytes, so reaching it means the
    program tried to write more. Reads exactly the bytes kept (``read(cap)`` would allocate
    ``cap`` bytes up front whatever the file's size).
    """
    size = path.stat().st_size
    limited = size >= cap
    with open(path, "rb") as f:
        data = f.read(_KEPT_OUTPUT_BYTES if limited else size)
    return data.decode("utf-8", errors="replace"), limited


def _read_tail(path: Path, cap: int) -> tuple[str, bool]:
    """Read captured stderr: its last MiB (where a traceback ends), and whether it reached ``cap``.

    Only diagnostics are read from stderr, so a program that writes megabytes of debug lines
    there costs the grader one MiB, not their size.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        f.seek(max(0, size - _KEPT_OUTPUT_BYTES))
        data = f.read()
    skip = 0
    while size > _KEPT_OUTPUT_BYTES and skip < min(3, len(data)) and 0x80 <= data[skip] < 0xC0:
        skip += 1  # cut inside a character: drop its continuation bytes
    return data[skip:].decode("utf-8", errors="replace"), size >= cap


def _run_rlimits(
    work: Path, script: str, args: Sequence[str], limits: SandboxLimits, fin: Any, fout: Any, ferr: Any
) -> tuple[int, bool, dict[str, Any]]:
    """The fallback: rlimits in ``preexec_fn``, the process group killed at the end."""
    prefix: list[str] = []
    use_ns = limits.network in ("auto", "namespace") and network_namespace_available()
    if limits.network == "namespace" and not use_ns:
        raise RuntimeError(
            "network='namespace' requested but `unshare --user --net` does not work here; "
            "use network='auto' or 'python', or enable unprivileged user namespaces"
        )
    if use_ns:
        prefix = [shutil.which("unshare") or "unshare", "--user", "--net", "--map-root-user"]
    cmd = [*prefix, sys.executable, "-I", "-B", "-X", "utf8", script, *args]
    timed_out = False
    proc = subprocess.Popen(
        cmd,
        cwd=work,
        env=_clean_env(str(work)),
        stdin=fin,
        stdout=fout,
        stderr=ferr,
        start_new_session=True,
        preexec_fn=functools.partial(_set_limits, limits),
    )
    try:
        timed_out = not _wait_for_exit(proc.pid, limits.timeout_s)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # also any children left in the group
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
    return proc.returncode, timed_out, {"containment": "rlimits-only"}


def _run_namespaced(
    root: Path,
    work: Path,
    script: str,
    args: Sequence[str],
    limits: SandboxLimits,
    fin: Any,
    fout: Any,
    ferr: Any,
) -> tuple[int, bool, dict[str, Any]]:
    """Start the helper (this file as a script) and turn its report into a result."""
    newroot = root / "newroot"  # empty mount point of the sandbox's root, inside its mount namespace
    newroot.mkdir()
    mounts, executable = _mount_plan()
    config = {
        "work": str(work),
        "newroot": str(newroot),
        "result": str(root / "result.json"),
        "argv": [executable, "-I", "-B", "-X", "utf8", script, *args],
        "env": _clean_env(_INSIDE_DIR),
        "mounts": mounts,
        "timeout_s": limits.timeout_s,
        "cpu_s": limits.cpu_s if limits.cpu_s is not None else int(limits.timeout_s) + 2,
        "memory_mb": limits.memory_mb,
        "file_size_mb": limits.file_size_mb,
        "max_open_files": limits.max_open_files,
        "max_processes": limits.max_processes,
        "network_namespace": limits.network != "python",
        "cgroup_parent": _cgroup_parent(limits.cgroup_parent),
        "single_id_map": _FORCE_SINGLE_ID_MAP,
        "grader_pid": os.getpid(),
    }
    (root / "config.json").write_text(json.dumps(config), encoding="utf-8")
    helper = [sys.executable, "-I", "-S", "-B", os.path.abspath(__file__), _HELPER_FLAG,
              str(root / "config.json")]
    proc = subprocess.Popen(
        helper, cwd=root, env={"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"},
        stdin=fin, stdout=fout, stderr=ferr, start_new_session=True,
    )
    if not _wait_for_exit(proc.pid, limits.timeout_s + _HELPER_GRACE_S):
        # Abnormal (the helper enforces timeout_s itself): killing it takes the namespace along,
        # through the parent-death signals of its children (asynchronously, in this case only).
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        memory = "cgroup" if config["cgroup_parent"] else "rlimit"
        return -signal.SIGKILL, True, {"containment": f"namespaces+{memory}"}
    proc.wait()
    try:
        report = json.loads((root / "result.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RuntimeError(
            f"the namespace sandbox helper exited with {proc.returncode} and no report ({exc}); "
            f"the rlimits-only fallback is {_RLIMITS_OPT_IN}"
        ) from exc
    if report["error"]:
        raise RuntimeError(
            f"the namespace sandbox failed to start: {report['error']}; the rlimits-only "
            f"fallback is {_RLIMITS_OPT_IN}"
        )
    extra = {
        "containment": f"namespaces+{report['memory']}",
        "memory_exceeded": report["oom_kills"] > 0,
    }
    return os.waitstatus_to_exitcode(report["status"]), report["timed_out"], extra


def _mount_plan() -> tuple[list[list[str]], str]:
    """What the sandbox's root shows of the host, and the interpreter path to run there.

    Returns:
        ``(mounts, executable)``. Each mount is ``["bind", source, target]`` (a read-only bind),
        ``["device", source, target]`` (a read-only bind of a character device) or
        ``["symlink", path, target]``; every bind source is a resolved path (``realpath``), so
        what is bound is what was checked. ``executable`` resolves inside the sandbox's root.

    Raises:
        SandboxUnavailable: The interpreter's installation is ``/``, a home directory, the
            temporary folder or a folder holding one of them, which the sandbox will not show.
    """
    plan: list[list[str]] = []
    trees: list[str] = []  # bound directories
    links: dict[str, str] = {}  # top-level symlinks recreated in the new root
    for top in _SYSTEM_DIRS:
        if os.path.islink(top):  # merged /usr: /bin -> usr/bin
            links[top] = os.readlink(top)
            plan.append(["symlink", top, links[top]])
        elif os.path.isdir(top):
            plan.append(["bind", top, top])
            trees.append(top)
    for root in _interpreter_roots():  # parents first
        if not _within(root, trees):
            plan.append(["bind", root, root])
            trees.append(root)
    plan += _host_files("/etc", _ETC_FILES, trees)
    plan += _host_files("/dev", _DEV_NODES, trees, devices=True)
    # As run (a venv's bin/python, next to the pyvenv.cfg that makes it the venv), if every link
    # on the way to the binary stays in what is bound; else the binary itself.
    as_run = os.path.join(os.path.realpath(os.path.dirname(sys.executable)),
                          os.path.basename(sys.executable))
    for executable in (as_run, os.path.realpath(sys.executable)):
        if _resolves_inside(executable, trees, links):
            return plan, executable
    raise SandboxUnavailable(
        f"the interpreter {sys.executable!r} (the binary {os.path.realpath(sys.executable)!r}) "
        f"does not resolve inside the sandbox's root, which shows {sorted(trees)}"
    )


def _host_files(folder: str, names: Sequence[str], trees: Sequence[str], *,
                devices: bool = False) -> list[list[str]]:
    """Mount plan entries that show ``folder/name`` for each of ``names`` that exists.

    Resolved first: a file that links into ``trees`` (shown already) becomes that same link
    (``/etc/localtime -> /usr/share/zoneinfo/...``), one that resolves inside ``folder`` is bound
    from where it resolves, and one that resolves anywhere else is left out. With ``devices``, only
    character devices are bound (as ``"device"`` entries, which keep device access).
    """
    plan: list[list[str]] = []
    inside = [os.path.realpath(folder)]
    for name in names:
        path = os.path.join(folder, name)
        real = os.path.realpath(path)
        try:
            mode = os.stat(real).st_mode
        except OSError:
            continue  # absent, or a dangling link
        if devices:
            if stat.S_ISCHR(mode) and _within(real, inside):
                plan.append(["device", real, path])
        elif real != path and _within(real, trees):
            plan.append(["symlink", path, real])
        elif _within(real, inside):
            plan.append(["bind", real, path])
    return plan


def _interpreter_roots() -> list[str]:
    """The resolved installation folders of the running interpreter, parents first.

    The binary's prefix (``dirname(dirname(realpath(sys.executable)))``, never that of a link to
    it: ``~/bin/python`` would make it ``~``), the standard library's prefix, and the virtual
    environment's folder when one is active (it must hold ``pyvenv.cfg``). Each is checked
    against :func:`_refused_root`.
    """
    import sysconfig

    real_exe = os.path.realpath(sys.executable) if sys.executable else ""
    if not real_exe or not os.path.isfile(real_exe):
        raise SandboxUnavailable(
            f"sys.executable={sys.executable!r} names no interpreter binary; run the grader with a "
            "Python whose sys.executable is set"
        )
    roots = {os.path.dirname(os.path.dirname(real_exe)): f"binary {real_exe}"}
    for key in ("stdlib", "platstdlib"):  # <prefix>/lib/pythonX.Y
        library = os.path.realpath(sysconfig.get_path(key))
        roots.setdefault(os.path.dirname(os.path.dirname(library)), f"standard library {library}")
    for prefix in {sys.prefix, sys.exec_prefix} - {sys.base_prefix, sys.base_exec_prefix}:
        venv = os.path.realpath(prefix)
        if not os.path.isfile(os.path.join(venv, "pyvenv.cfg")):
            raise SandboxUnavailable(
                f"sys.prefix={prefix!r} differs from sys.base_prefix={sys.base_prefix!r} but holds "
                "no pyvenv.cfg: not a virtual environment the sandbox can show; run the grader "
                "with a venv's interpreter or the base one"
            )
        roots.setdefault(venv, f"virtual environment {venv}")
    for root, what in roots.items():
        refused = _refused_root(root)
        if refused:
            raise SandboxUnavailable(
                f"the interpreter's installation {root!r} (holding its {what}) is {refused}; the "
                "sandbox shows the interpreter's installation to the program and will not show "
                "that. Run the grader with a Python installed in a folder of its own (such as "
                "/usr, /opt/python3, ~/.pyenv/versions/X.Y.Z) or a venv made from one"
            )
    return sorted(roots, key=len)


def _refused_root(root: str) -> str:
    """Why ``root`` may not be bound into the sandbox (``""`` if it may): ``/``, a home directory,
    the temporary folder, or a folder holding one of them."""
    if root == "/":
        return "the root of the file system"
    for kind, protected in (("the home directory", _home_dirs()),
                            ("the temporary folder", [os.path.realpath(tempfile.gettempdir())])):
        for path in protected:
            if _within(path, [root]):
                return f"{kind} {path!r}" if path == root else f"a folder holding {kind} {path!r}"
    return ""


def _home_dirs() -> list[str]:
    """Resolved home directories: the grader's (``$HOME`` and its account's), root's, and those of
    login accounts (uid 1000 and up)."""
    homes = {os.environ.get("HOME", ""), os.path.expanduser("~"), *_account_homes()}
    return sorted({os.path.realpath(h) for h in homes if h and os.path.isabs(h)})


@functools.cache
def _account_homes() -> tuple[str, ...]:
    try:
        import pwd
    except ImportError:
        return ()
    homes = [entry.pw_dir for entry in pwd.getpwall()
             if entry.pw_uid in (0, os.geteuid()) or 1000 <= entry.pw_uid < 65534]
    return tuple(homes)


def _within(path: str, trees: Sequence[str]) -> bool:
    """Whether ``path`` is one of ``trees`` or lies below one (all absolute, normalised)."""
    return any(path == tree or path.startswith(tree.rstrip("/") + "/") for tree in trees)


def _resolves_inside(path: str, trees: Sequence[str], links: Mapping[str, str]) -> bool:
    """Whether ``path`` names a file in the sandbox's root: following each symlink as the kernel
    would there, where only ``trees``, the folders above them and the top-level ``links`` exist."""
    parts = [part for part in path.split("/") if part]
    current, hops = "/", 0
    while parts:
        name = parts.pop(0)
        if name in ("", "."):
            continue
        if name == "..":
            current = os.path.dirname(current)
            continue
        candidate = os.path.join(current, name)
        if candidate in links:
            target = links[candidate]
        elif _within(candidate, trees) and os.path.islink(candidate):
            target = os.readlink(candidate)
        elif _within(candidate, trees) or any(_within(tree, [candidate]) for tree in trees):
            current = candidate
            continue
        else:
            return False
        hops += 1
        if hops > 40:
            return False
        parts[:0] = [part for part in target.split("/") if part]
        if target.startswith("/"):
            current = "/"
    return _within(current, trees) and os.path.isfile(current)


@functools.cache
def _own_cgroup() -> str | None:
    """The cgroup v2 directory of this process, or ``None`` (no cgroup v2, or not found)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        mountinfo = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    relative = next((line[3:] for line in lines if line.startswith("0::")), None)
    mount = next(
        (_unescape(line.split()[4]) for line in mountinfo if " - cgroup2 " in line), None
    )
    if relative is None or mount is None:
        return None
    return os.path.join(mount, relative.lstrip("/"))


def _cgroup_usable(path: str) -> bool:
    try:
        enabled = Path(path, "cgroup.subtree_control").read_text().split()
    except OSError:
        return False
    return {"memory", "pids"} <= set(enabled) and os.access(path, os.W_OK | os.X_OK)


def _cgroup_parent(explicit: str | None) -> str | None:
    if explicit is not None:
        if not _cgroup_usable(explicit):
            raise ValueError(
                f"cgroup_parent={explicit!r} is not a writable cgroup v2 directory whose "
                "cgroup.subtree_control enables memory and pids; create one and run "
                f"`echo '+memory +pids' > {explicit}/cgroup.subtree_control` (it must hold no "
                "process itself), or pass cgroup_parent=None"
            )
        return explicit
    own = _own_cgroup()
    return own if own is not None and _cgroup_usable(own) else None


def _unescape(path: str) -> str:
    """Decode the octal escapes (``\\040`` for a space) of /proc/self/mountinfo."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), path)


# ---------------------------------------------------------------------------------------------
# The helper: everything below runs in the helper process (this file run as a script) and in the
# processes it forks. It uses only the standard library and ctypes: run by path with ``python -S``,
# it imports neither beaconkv nor torch and starts in tens of milliseconds.
#
#   helper H (host namespaces; reaps everything, enforces timeout_s, writes result.json)
#     └─ A: unshare(user, mount, pid, ipc, uts, cgroup, net); H writes A's uid/gid maps
#          └─ B: PID 1 of the new PID namespace; builds the root, forks the program, reaps
#               └─ C: limits, drops privileges, seccomp, execve(python ...)
# ---------------------------------------------------------------------------------------------

_CLONE_THREAD = 0x00010000
_CLONE_NEWNS = 0x00020000
_CLONE_NEWCGROUP = 0x02000000
_CLONE_NEWUTS = 0x04000000
_CLONE_NEWIPC = 0x08000000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_NAMESPACE_FLAGS = (_CLONE_NEWNS | _CLONE_NEWCGROUP | _CLONE_NEWUTS | _CLONE_NEWIPC
                    | _CLONE_NEWUSER | _CLONE_NEWPID | _CLONE_NEWNET)

_MS_RDONLY = 1
_MS_NOSUID = 2
_MS_NODEV = 4
_MS_NOEXEC = 8
_MS_REMOUNT = 32
_MS_NOATIME = 1024
_MS_NODIRATIME = 2048
_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18
_MS_RELATIME = 1 << 21
_MS_STRICTATIME = 1 << 24
_MNT_DETACH = 2
# Per-mount options (/proc/self/mountinfo field 6) a user namespace must keep when remounting.
_LOCKABLE_OPTIONS = {"nosuid": _MS_NOSUID, "nodev": _MS_NODEV, "noexec": _MS_NOEXEC,
                     "noatime": _MS_NOATIME, "nodiratime": _MS_NODIRATIME,
                     "relatime": _MS_RELATIME}

_PR_SET_PDEATHSIG = 1
_PR_SET_SECCOMP = 22
_PR_CAPBSET_DROP = 24
_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_SECCOMP_MODE_FILTER = 2

# Per architecture: audit arch, syscall numbers (pivot_root and capset have no glibc wrapper).
_SECCOMP_TABLES: dict[str, dict[str, int]] = {
    "x86_64": {
        "arch": 0xC000003E, "x32_bit": 0x40000000, "clone": 56, "fork": 57, "vfork": 58,
        "clone3": 435, "unshare": 272, "setns": 308, "add_key": 248, "request_key": 249,
        "keyctl": 250, "pivot_root": 155, "capset": 126, "io_uring_setup": 425,
        "io_uring_enter": 426, "io_uring_register": 427,
    },
    "aarch64": {
        "arch": 0xC00000B7, "clone": 220, "clone3": 435, "unshare": 97, "setns": 268,
        "add_key": 217, "request_key": 218, "keyctl": 219, "pivot_root": 41, "capset": 91,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    },
}



class _Libc:
    """The few libc calls the helper needs, with argument types set (varargs trap: an untyped
    Python int is passed as a 32-bit int, leaving garbage in the upper half of the register)."""

    def __init__(self) -> None:
        import ctypes

        self.ctypes = ctypes
        self.lib = ctypes.CDLL(None, use_errno=True)
        c = ctypes
        self.lib.mount.argtypes = [c.c_char_p, c.c_char_p, c.c_char_p, c.c_ulong, c.c_char_p]
        self.lib.umount2.argtypes = [c.c_char_p, c.c_int]
        self.lib.unshare.argtypes = [c.c_int]
        self.lib.sethostname.argtypes = [c.c_char_p, c.c_size_t]
        self.lib.prctl.argtypes = [c.c_int, c.c_ulong, c.c_ulong, c.c_ulong, c.c_ulong]
        self.nr = _SECCOMP_TABLES[_machine()]

    def _check(self, ret: int, what: str) -> int:
        if ret < 0:
            err = self.ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")
        return ret

    def mount(self, source: str | None, target: str, fstype: str | None, flags: int,
              data: str | None = None) -> None:
        def enc(text: str | None) -> bytes | None:
            return None if text is None else text.encode()

        what = f"mount({source!r}, {target!r}, {fstype!r}, {flags:#x}, {data!r})"
        self._check(self.lib.mount(enc(source), target.encode(), enc(fstype), flags, enc(data)), what)

    def umount2(self, target: str, flags: int) -> None:
        self._check(self.lib.umount2(target.encode(), flags), f"umount2({target!r})")

    def unshare(self, flags: int) -> None:
        self._check(self.lib.unshare(flags), f"unshare({flags:#x})")

    def sethostname(self, name: str) -> None:
        self._check(self.lib.sethostname(name.encode(), len(name)), "sethostname")

    def prctl(self, option: int, a: int = 0, b: int = 0, c: int = 0, d: int = 0) -> int:
        return self._check(self.lib.prctl(option, a, b, c, d), f"prctl({option})")

    def pivot_root(self, new_root: str, put_old: str) -> None:
        c = self.ctypes
        ret = self.lib.syscall(c.c_long(self.nr["pivot_root"]), c.c_char_p(new_root.encode()),
                               c.c_char_p(put_old.encode()))
        self._check(ret, "pivot_root")

    def drop_capabilities(self) -> None:
        """Empty the bounding, ambient, effective, permitted and inheritable sets (so that even
        an execve as uid 0 gains nothing)."""
        c = self.ctypes
        try:
            last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
        except (OSError, ValueError):
            last = 63
        for cap in range(last + 1):
            if self.lib.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) < 0 and c.get_errno() != 22:
                self._check(-1, f"PR_CAPBSET_DROP {cap}")  # EINVAL: no such capability
        self.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL)

        class Header(c.Structure):
            _fields_ = [("version", c.c_uint32), ("pid", c.c_int)]

        class Data(c.Structure):
            _fields_ = [("effective", c.c_uint32), ("permitted", c.c_uint32),
                        ("inheritable", c.c_uint32)]

        header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
        ret = self.lib.syscall(c.c_long(self.nr["capset"]), c.byref(header), c.byref(data))
        self._check(ret, "capset")

    def install_seccomp(self, deny_processes: bool) -> None:
        c = self.ctypes
        program = _seccomp_program(self.nr, deny_processes)

        class Prog(c.Structure):
            _fields_ = [("len", c.c_ushort), ("filter", c.c_void_p)]

        buffer = c.create_string_buffer(program, len(program))
        prog = Prog(len(program) // 8, c.addressof(buffer))
        self.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, c.addressof(prog))


def _seccomp_program(nr: dict[str, int], deny_processes: bool) -> bytes:
    """A classic-BPF seccomp filter (``struct sock_filter`` array) for the program.

    Refused with ``EPERM``: ``unshare``, ``setns``, the keyring calls, ``clone`` with namespace
    flags, and, when ``deny_processes``, ``fork``/``vfork``/``clone`` without ``CLONE_THREAD``.
    ``clone3`` gets ``ENOSYS`` (its flags sit in memory, out of the filter's reach), which makes
    glibc fall back to ``clone``. ``io_uring_setup``, ``io_uring_enter`` and ``io_uring_register``
    get ``ENOSYS``, what a kernel without io_uring answers (libraries then fall back to ordinary
    I/O): io_uring is a large kernel attack surface and no graded program needs it. Calls of
    another ABI (i386, x32 on x86_64) get ``ENOSYS``.
    """
    import struct

    ld_abs, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, errno = 0x7FFF0000, 0x00050000
    eperm, enosys = 1, 38
    code: list[tuple[int, Any, Any, int]] = []  # (opcode, jump-if-true, jump-if-false, k)
    labels: dict[str, int] = {}

    def op(opcode: int, k: int, true: str | None = None, false: str | None = None) -> None:
        code.append((opcode, true, false, k))

    op(ld_abs, 4)  # seccomp_data.arch
    op(jeq, nr["arch"], None, "enosys")
    op(ld_abs, 0)  # seccomp_data.nr
    if "x32_bit" in nr:
        op(jge, nr["x32_bit"], "enosys", None)
    for name in ("clone3", "io_uring_setup", "io_uring_enter", "io_uring_register"):
        op(jeq, nr[name], "enosys", None)
    for name in ("unshare", "setns", "add_key", "request_key", "keyctl"):
        op(jeq, nr[name], "eperm", None)
    if deny_processes:
        for name in ("fork", "vfork"):
            if name in nr:
                op(jeq, nr[name], "eperm", None)
    op(jeq, nr["clone"], "clone", "allow")
    labels["allow"] = len(code)
    op(ret, allow)
    labels["clone"] = len(code)
    op(ld_abs, 16)  # low 32 bits of seccomp_data.args[0]: clone's flags
    op(jset, _NAMESPACE_FLAGS, "eperm", None)
    op(jset, _CLONE_THREAD, "thread", None)
    op(ret, (errno | eperm) if deny_processes else allow)
    labels["thread"] = len(code)  # BPF jumps only forward: a second "allow" for threads
    op(ret, allow)
    labels["eperm"] = len(code)
    op(ret, errno | eperm)
    labels["enosys"] = len(code)
    op(ret, errno | enosys)

    out = b""
    for index, (opcode, true, false, k) in enumerate(code):
        jt = 0 if true is None else labels[true] - index - 1
        jf = 0 if false is None else labels[false] - index - 1
        out += struct.pack("=HBBI", opcode, jt, jf, k)
    return out


def _helper_main(config_path: str) -> int:
    """Entry point of the helper process; writes ``result.json`` and returns the exit code."""
    config = json.loads(Path(config_path).read_text(encoding="utf-8"))
    report: dict[str, Any] = {"status": None, "timed_out": False, "memory": "rlimit",
                              "oom_kills": 0, "error": None}
    try:
        _supervise(config, report)
    except BaseException as exc:  # noqa: BLE001 - reported to the grader, which raises
        report["error"] = report["error"] or f"{type(exc).__name__}: {exc}"
    tmp = config["result"] + ".tmp"
    Path(tmp).write_text(json.dumps(report), encoding="utf-8")
    os.replace(tmp, config["result"])
    return 0


def _supervise(config: dict[str, Any], report: dict[str, Any]) -> None:
    """Helper H: fork A, map its ids, wait with the timeout, reap everything, read the status."""
    libc = _Libc()
    _die_with_parent(libc, config["grader_pid"])  # a dead grader takes the whole run along
    # Orphans of A (B, if A dies first) are reparented here, so nothing escapes the final reaping.
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1)
    cgroup = _make_cgroup(config) if config["cgroup_parent"] else None
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    status_r, status_w = os.pipe()
    helper_pid = os.getpid()
    pid_a = os.fork()
    if pid_a == 0:
        try:
            os.close(ready_r)
            os.close(go_w)
            os.close(status_r)
            _stage_a(config, libc, helper_pid, ready_w, go_r, status_w)
        except BaseException as exc:  # noqa: BLE001 - the child must never return into H's code
            _send(status_w, "error", f"{type(exc).__name__}: {exc}")
        os._exit(70)
    os.close(ready_w)
    os.close(go_r)
    os.close(status_w)
    try:
        if os.read(ready_r, 1) == b"r":  # A has unshared; nothing ran in its namespaces yet
            memory = "rlimit"
            if cgroup is not None:
                try:
                    Path(cgroup, "cgroup.procs").write_text(str(pid_a))
                    memory = "cgroup"
                except OSError:
                    memory = "rlimit"
            single = _write_id_maps(pid_a, config["single_id_map"])
            # RLIMIT_NPROC is ignored for the host's uid 0: cap processes by seccomp instead.
            nproc_works = not (single and os.geteuid() == 0 and _initial_user_namespace())
            os.write(go_w, json.dumps({"memory": memory, "single": single,
                                       "nproc_works": nproc_works}).encode() + b"\n")
            report["memory"] = memory
            report["timed_out"] = not _wait_for_exit(pid_a, config["timeout_s"])
    finally:
        os.close(go_w)
        _kill_and_reap_children(libc, helper_pid, pid_a)
        with os.fdopen(status_r, "rb") as status:
            lines = status.read().decode("utf-8", errors="replace").splitlines()
        if cgroup is not None:
            report["oom_kills"] = _remove_cgroup(cgroup)
    for line in lines:
        kind, _, payload = line.partition(" ")
        if kind == "exit":
            report["status"] = int(payload)
        elif kind == "error" and report["error"] is None:
            report["error"] = payload
    if report["status"] is None and report["error"] is None:
        if report["timed_out"]:
            report["status"] = signal.SIGKILL  # a raw wait status: killed by SIGKILL
        else:
            report["error"] = "the sandbox's init exited without reporting the program's status"


def _send(fd: int, kind: str, payload: object) -> None:
    """One line on the status pipe (short enough to be written atomically)."""
    text = str(payload).replace("\n", " ")[:2000]
    try:
        os.write(fd, f"{kind} {text}\n".encode("utf-8", errors="replace"))
    except OSError:
        pass


def _initial_user_namespace() -> bool:
    try:
        return Path("/proc/self/uid_map").read_text().split() == ["0", "0", "4294967295"]
    except OSError:
        return False


def _write_id_maps(pid: int, force_single: bool) -> bool:
    """Write A's uid/gid maps; returns whether only the grader's own ids are mapped.

    As root, inside 0 -> host 0 (the helper processes) and inside 1000 -> :data:`SANDBOX_HOST_ID`
    (the program). Otherwise (or if that is refused), the unprivileged form: inside 0 -> the
    grader's uid, with ``setgroups`` denied as the kernel requires. Each map must be written in a
    single ``write`` and can be written only once.
    """
    uid, gid = os.geteuid(), os.getegid()
    proc = f"/proc/{pid}"
    if uid == 0 and not force_single:
        try:
            _write_once(f"{proc}/uid_map", f"0 {uid} 1\n{_INSIDE_ID} {SANDBOX_HOST_ID} 1\n")
        except OSError:
            pass  # e.g. root of a container whose own user namespace lacks that uid
        else:
            _write_once(f"{proc}/gid_map", f"0 {gid} 1\n{_INSIDE_ID} {SANDBOX_HOST_ID} 1\n")
            return False
    _write_once(f"{proc}/setgroups", "deny")
    _write_once(f"{proc}/uid_map", f"0 {uid} 1\n")
    _write_once(f"{proc}/gid_map", f"0 {gid} 1\n")
    return True


def _write_once(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _wait_for_exit(pid: int, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for a child to exit, without reaping it.

    A pidfd wakes up as soon as the child exits (``Popen.wait(timeout)`` sleeps in steps of up to
    50 ms, which would add to every run).
    """
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    if fd is not None:
        try:
            return bool(select.select([fd], [], [], timeout)[0])
        finally:
            os.close(fd)
    deadline = time.monotonic() + timeout  # kernels before 5.3: poll
    while time.monotonic() < deadline:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return True
        time.sleep(0.002)
    return False


def _kill_and_reap_children(libc: _Libc, helper_pid: int, pid_a: int) -> None:
    """SIGKILL A and anything reparented here, and reap until no child is left.

    Killing B (the namespace's init) makes the kernel kill every process of the namespace, and
    B's exit completes only once they are all gone: when this returns, nothing of the run lives.
    """
    try:
        os.kill(pid_a, signal.SIGKILL)
    except ProcessLookupError:
        pass
    while True:
        for pid in _children(helper_pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.wait()
        except ChildProcessError:
            return


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _make_cgroup(config: dict[str, Any]) -> str | None:
    """Create the run's child cgroup with its limits, or return ``None`` if that fails."""
    path = os.path.join(config["cgroup_parent"], f"beaconkv-sandbox-{os.getpid()}")
    tasks = _HELPER_TASKS + (config["max_processes"] if config["max_processes"] > 1 else _MAX_TASKS)
    try:
        os.mkdir(path)
        if config["memory_mb"] is not None:
            Path(path, "memory.max").write_text(str((config["memory_mb"] + _CGROUP_SLACK_MB) << 20))
            if os.path.exists(os.path.join(path, "memory.swap.max")):
                Path(path, "memory.swap.max").write_text("0")
        Path(path, "pids.max").write_text(str(tasks))
    except OSError:
        _remove_cgroup(path)
        return None
    return path


def _remove_cgroup(path: str) -> int:
    """Remove the run's cgroup; returns how many processes its memory limit killed."""
    oom_kills = 0
    try:
        for line in Path(path, "memory.events").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                oom_kills = int(value)
    except (OSError, ValueError):
        pass
    for _ in range(100):
        try:
            os.rmdir(path)
            break
        except FileNotFoundError:
            break
        except OSError:
            try:
                Path(path, "cgroup.kill").write_text("1")
            except OSError:
                pass
            time.sleep(0.01)
    return oom_kills


def _die_with_parent(libc: _Libc, parent: int | None) -> None:
    """SIGKILL this process when its parent dies (checked once, for the race with fork)."""
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent is not None and os.getppid() != parent:
        os._exit(70)


def _stage_a(config: dict[str, Any], libc: _Libc, helper_pid: int, ready_w: int, go_r: int,
             status_w: int) -> None:
    """Process A: create the namespaces, wait for the id maps, fork the init, wait for it."""
    _die_with_parent(libc, helper_pid)
    flags = (_CLONE_NEWUSER | _CLONE_NEWNS | _CLONE_NEWPID | _CLONE_NEWIPC | _CLONE_NEWUTS
             | _CLONE_NEWCGROUP)
    if config["network_namespace"]:
        flags |= _CLONE_NEWNET
    libc.unshare(flags)
    os.write(ready_w, b"r")
    os.close(ready_w)
    with os.fdopen(go_r, "rb") as go:
        line = go.readline()
    if not line:
        os._exit(0)  # the helper gave up (its error is in the report)
    plan = json.loads(line)
    a_pid = os.getpid()
    pid_b = os.fork()
    if pid_b == 0:
        try:
            _stage_b(config, libc, plan, a_pid, status_w)
        except BaseException as exc:  # noqa: BLE001
            _send(status_w, "error", f"{type(exc).__name__}: {exc}")
        os._exit(70)
    os.close(status_w)
    os.waitpid(pid_b, 0)  # B's exit completes only once its namespace is empty
    os._exit(0)


def _stage_b(config: dict[str, Any], libc: _Libc, plan: dict[str, Any], parent: int,
             status_w: int) -> None:
    """Process B, PID 1 of the namespace: build the root, run the program, reap, report."""
    _die_with_parent(libc, None)  # its parent is outside the PID namespace: getppid() is 0
    # Python's own SIGINT handler would let the program interrupt its init; with the default
    # disposition, the kernel drops signals sent to a namespace's init from inside.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    inside_id = 0 if plan["single"] else _INSIDE_ID
    _build_root(config, libc, inside_id)
    libc.sethostname("sandbox")
    pid_c = os.fork()
    if pid_c == 0:
        try:
            _stage_c(config, libc, plan, status_w)
        except BaseException as exc:  # noqa: BLE001
            _send(status_w, "error", f"{type(exc).__name__}: {exc}")
        os._exit(71)
    while True:  # as init, also reap the program's orphans
        pid, status = os.wait()
        if pid == pid_c:
            break
    _send(status_w, "exit", status)
    os._exit(0)  # the kernel now kills whatever is left in the namespace


def _build_root(config: dict[str, Any], libc: _Libc, inside_id: int) -> None:
    """Mount a fresh root (tmpfs) with read-only host paths, /dev, /proc, /etc and the working
    folder, pivot into it and make it read-only."""
    new = config["newroot"]
    libc.mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing propagates back to the host
    libc.mount("tmpfs", new, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
    for kind, source, target in config["mounts"]:  # see _mount_plan
        if kind == "symlink":
            os.makedirs(os.path.dirname(new + source), exist_ok=True)
            os.symlink(target, new + source)
        else:
            # A device node needs nodev off; read-only keeps the host's nodes from being chmod'ed.
            _bind_readonly(libc, source, new + target, nodev=kind != "device")
    os.makedirs(new + "/dev", exist_ok=True)  # the plan may have made some of these
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{new}/dev/{name}")
    os.makedirs(new + "/proc", exist_ok=True)
    try:
        # Before the pivot: the kernel lets a user namespace mount proc only while a full proc
        # mount is visible. Not essential: skipped where refused (e.g. a masked /proc in Docker).
        libc.mount("proc", new + "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
        _make_readonly(libc, new + "/proc")  # no sysctl, sysrq-trigger or other /proc writes
    except OSError:
        pass
    os.makedirs(new + "/etc", exist_ok=True)
    Path(new, "etc/passwd").write_text(
        f"root:x:0:0:root:/root:/bin/sh\nsandbox:x:{_INSIDE_ID}:{_INSIDE_ID}::{_INSIDE_DIR}:/bin/sh\n"
    )
    Path(new, "etc/group").write_text(f"root:x:0:\nsandbox:x:{_INSIDE_ID}:\n")
    os.makedirs(new + "/tmp", exist_ok=True)  # exists already when the interpreter lives under /tmp
    os.makedirs(new + _INSIDE_DIR, exist_ok=True)
    size = config["file_size_mb"]
    libc.mount("tmpfs", new + _INSIDE_DIR, "tmpfs", _MS_NOSUID | _MS_NODEV,
               f"size={size}m,nr_inodes=16384,mode=0700,uid={inside_id},gid={inside_id}")
    _copy_tree(config["work"], new + _INSIDE_DIR, inside_id)
    os.chdir(new)
    libc.pivot_root(".", ".")  # the old root ends up stacked on "/"; detach it
    libc.umount2(".", _MNT_DETACH)
    os.chdir("/")
    libc.mount(None, "/", None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)


def _bind_readonly(libc: _Libc, source: str, target: str, *, nodev: bool = True) -> None:
    """Bind ``source`` (with its submounts) at ``target`` and make every mount there read-only.

    ``source`` must be a resolved path (the plan's are): a bind follows symlinks, so a link
    swapped in since the plan was checked would show its target instead.
    """
    if os.path.realpath(source) != source:
        raise OSError(f"bind source {source!r} now resolves to {os.path.realpath(source)!r}")
    if not os.path.lexists(target):
        if os.path.isdir(source):
            os.makedirs(target)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            Path(target).touch()
    libc.mount(source, target, None, _MS_BIND | _MS_REC)
    _make_readonly(libc, target, nodev=nodev)


def _make_readonly(libc: _Libc, target: str, *, nodev: bool = True) -> None:
    """Remount every mount at or below ``target`` read-only (and nosuid, and nodev if asked)."""
    for mount_point, options in _mounts_under(target):
        # In a user namespace a remount must keep the flags the mount came with (nosuid, nodev,
        # noexec, the atime mode): they are locked, and changing them is EPERM.
        flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | (_MS_NODEV if nodev else 0)
        options_set = set(options.split(","))
        for option, flag in _LOCKABLE_OPTIONS.items():
            if option in options_set:
                flags |= flag
        if not options_set & {"noatime", "relatime"}:
            flags |= _MS_STRICTATIME
        libc.mount(None, mount_point, None, flags)


def _mounts_under(path: str) -> list[tuple[str, str]]:
    """``(mount point, per-mount options)`` of the mounts at or below ``path``, parents first."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        point = _unescape(fields[4])
        if point == path or point.startswith(path.rstrip("/") + "/"):
            found.append((point, fields[5]))
    return found


def _copy_tree(source: str, target: str, owner: int) -> None:
    """Copy the run's files into the working folder: folders and regular files only.

    This runs with the helper's access to the host, so a symlink among the files would copy
    whatever it names into the sandbox: anything that is not a plain file or folder is refused
    (the grader writes only plain files there; nothing else is expected).
    """
    for folder, dirs, names in os.walk(source):
        relative = os.path.relpath(folder, source)
        destination = os.path.normpath(os.path.join(target, relative))
        for name in dirs + names:
            path = os.path.join(folder, name)
            mode = os.lstat(path).st_mode
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                raise OSError(f"{path!r} is neither a regular file nor a folder (mode {mode:#o}); "
                              "the sandbox copies only those")
        for name in dirs:
            os.mkdir(os.path.join(destination, name))
            os.chown(os.path.join(destination, name), owner, owner)
        for name in names:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as src, open(os.path.join(destination, name), "xb") as dst:
                shutil.copyfileobj(src, dst)
            os.chown(os.path.join(destination, name), owner, owner)


def _stage_c(config: dict[str, Any], libc: _Libc, plan: dict[str, Any], status_w: int) -> None:
    """Process C: limits, no privileges, seccomp, then exec the program."""
    os.chdir(_INSIDE_DIR)
    os.closerange(3, status_w)  # status_w is close-on-exec: it reports a failed execve
    os.closerange(status_w + 1, 1 << 16)
    processes = config["max_processes"]
    deny_processes = processes == 1 or (plan["memory"] == "rlimit" and not plan["nproc_works"])
    tasks = processes if processes > 1 else _MAX_TASKS
    if plan["single"]:
        tasks += _HELPER_TASKS  # A and B count against the same uid's RLIMIT_NPROC
    cpu = config["cpu_s"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    if config["memory_mb"] is not None:
        share = processes if (processes > 1 and plan["memory"] == "rlimit") else 1
        size = (config["memory_mb"] << 20) // share
        resource.setrlimit(resource.RLIMIT_AS, (size, size))
    fsize = config["file_size_mb"] << 20
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (config["max_open_files"], config["max_open_files"]))
    resource.setrlimit(resource.RLIMIT_NPROC, (tasks, tasks))
    if plan["single"]:
        libc.drop_capabilities()  # stays uid 0 of the namespace, with nothing to show for it
    else:
        os.setgroups([])
        os.setresgid(_INSIDE_ID, _INSIDE_ID, _INSIDE_ID)
        os.setresuid(_INSIDE_ID, _INSIDE_ID, _INSIDE_ID)  # clears every capability
    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1)
    libc.install_seccomp(deny_processes)
    os.execve(config["argv"][0], config["argv"], config["env"])


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != _HELPER_FLAG:
        raise SystemExit(f"usage: python {__file__} {_HELPER_FLAG} CONFIG.json (internal helper)")
    sys.exit(_helper_main(sys.argv[2]))

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
process (:mod:`~beaconkv.eval.sandbox.helper` run as a script, so the grader stays single-purpose)
creates new user, mount, PID, IPC, UTS, cgroup and network namespaces, and then:

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

One module per mechanism: :mod:`~beaconkv.eval.sandbox.runner` (:func:`run_python`, the containment check,
starting a run), :mod:`~beaconkv.eval.sandbox.limits` (the settings and the result),
:mod:`~beaconkv.eval.sandbox.rlimits`, :mod:`~beaconkv.eval.sandbox.mounts` (what the box shows of the host),
:mod:`~beaconkv.eval.sandbox.cgroups`, :mod:`~beaconkv.eval.sandbox.namespaces` (the helper process and its
children), :mod:`~beaconkv.eval.sandbox.seccomp`, :mod:`~beaconkv.eval.sandbox.libc` and
:mod:`~beaconkv.eval.sandbox.helper` (the helper's entry point).
"""

from .limits import SandboxLimits, SandboxResult, SandboxUnavailable
from .namespaces import SANDBOX_HOST_ID
from .runner import (
    NETWORK_GUARD,  # noqa: F401 - public as before, outside __all__
    check_containment,
    namespace_sandbox_available,
    network_namespace_available,
    run_python,
)

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

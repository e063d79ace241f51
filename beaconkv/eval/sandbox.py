"""Run untrusted Python (generated programs) in a subprocess with limits.

What is enforced:

* **Wall time**: the process group is killed with ``SIGKILL`` after ``timeout_s``.
* **CPU time** (``RLIMIT_CPU``), **address space** (``RLIMIT_AS``, i.e. memory), **file size**
  (``RLIMIT_FSIZE``: also caps stdout/stderr, which go to files), **open files** (``RLIMIT_NOFILE``),
  no core dumps; set in ``preexec_fn`` before ``exec``.
* **A clean temporary directory** as the working directory and ``HOME``/``TMPDIR``, deleted after.
* **Isolated interpreter**: ``python -I`` (no ``PYTHON*`` variables, no user site, no script
  directory on ``sys.path``), ``-B`` (no ``.pyc``), and a minimal environment (no proxies, tokens
  or credentials of the parent).
* **No network**: when ``unshare --user --net`` works (Linux with unprivileged user namespaces),
  the program runs in a new network namespace that has no interface but a down loopback — a real
  kernel-level block. Always, in addition, the harness replaces ``socket.socket`` and friends with
  functions that raise ``PermissionError`` before the program runs.

What is **not** enforced: the Python-level socket block can be bypassed by a determined program
(``_socket``, ``ctypes``) when no network namespace is available; the file system outside the
temporary directory is readable (and writable where the user may write) — there is no chroot;
the number of processes is not limited (``RLIMIT_NPROC`` counts all of the user's processes, and
root ignores it), although a fork bomb dies with the process group at the timeout. Run
evaluations of untrusted code inside a container or VM if that matters.
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = ["SandboxLimits", "SandboxResult", "network_namespace_available", "run_python"]

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


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandboxed run.

    Attributes:
        timeout_s: Wall-clock limit in seconds.
        memory_mb: Address-space limit in MiB (``RLIMIT_AS``); ``None`` for no limit.
        cpu_s: CPU-time limit in seconds; ``None`` means ``ceil(timeout_s) + 1``.
        file_size_mb: Largest file the program may write, stdout/stderr included.
        max_open_files: ``RLIMIT_NOFILE``.
        network: ``"auto"``: a network namespace when available, else the Python-level block;
            ``"namespace"``: require the namespace (error if unavailable); ``"python"``: only the
            Python-level block.
    """

    timeout_s: float = 6.0
    memory_mb: int | None = 1024
    cpu_s: int | None = None
    file_size_mb: int = 64
    max_open_files: int = 256
    network: Literal["auto", "namespace", "python"] = "auto"


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one sandboxed run.

    Attributes:
        returncode: Exit status (negative: killed by that signal).
        stdout: Captured stdout (decoded UTF-8, errors replaced).
        stderr: Captured stderr.
        timed_out: Whether the wall or CPU limit was hit.
        wall_s: Elapsed seconds.
    """

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    wall_s: float

    @property
    def status(self) -> str:
        """One word: ``ok``, ``timeout``, ``memory``, ``output-limit`` or ``error``."""
        if self.timed_out:
            return "timeout"
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


def _set_limits(limits: SandboxLimits) -> None:
    """Runs in the child between fork and exec."""
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
    }


def run_python(
    files: Mapping[str, str],
    script: str,
    args: Sequence[str] = (),
    *,
    stdin: str = "",
    limits: SandboxLimits | None = None,
) -> SandboxResult:
    """Run a Python script in a fresh temporary directory under resource limits.

    The ``files`` are written into an empty temporary directory, which becomes the working
    directory; ``script`` (one of them) runs with ``python -I -B -X utf8`` after the network guard
    (:data:`NETWORK_GUARD`) has been prepended to it (so the script must not start with a
    ``from __future__`` import). Everything is deleted afterwards. Limits are set in
    ``preexec_fn``; call this from the main thread of a process that does not fork concurrently.

    Args:
        files: File name (relative, no ``..``) -> content.
        script: The file of ``files`` to run.
        args: Command line arguments for the script.
        stdin: Text fed to the program's stdin.
        limits: Resource limits (default :class:`SandboxLimits`).

    Returns:
        The :class:`SandboxResult`.

    Raises:
        ValueError: If ``script`` is not in ``files`` or a file name escapes the directory.
        RuntimeError: If ``limits.network == "namespace"`` and no network namespace is available.
    """
    limits = limits or SandboxLimits()
    if script not in files:
        raise ValueError(f"script {script!r} is not one of the files {sorted(files)}")
    prefix: list[str] = []
    use_ns = limits.network in ("auto", "namespace") and network_namespace_available()
    if limits.network == "namespace" and not use_ns:
        raise RuntimeError(
            "network='namespace' requested but `unshare --user --net` does not work here; "
            "use network='auto' or 'python', or enable unprivileged user namespaces"
        )
    if use_ns:
        prefix = [shutil.which("unshare") or "unshare", "--user", "--net", "--map-root-user"]
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
                content = NETWORK_GUARD + "\n" + content
            target.write_text(content, encoding="utf-8")
        (io_dir / "stdin").write_text(stdin, encoding="utf-8")
        cmd = [*prefix, sys.executable, "-I", "-B", "-X", "utf8", script, *args]
        start = time.monotonic()
        timed_out = False
        with (
            open(io_dir / "stdin", "rb") as fin,
            open(io_dir / "stdout", "wb") as fout,
            open(io_dir / "stderr", "wb") as ferr,
        ):
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
                proc.wait(timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # also any children it left behind
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
        wall = time.monotonic() - start
        if proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL) and wall >= limits.timeout_s:
            timed_out = True
        if proc.returncode == -signal.SIGXCPU:
            timed_out = True
        stdout = (io_dir / "stdout").read_bytes().decode("utf-8", errors="replace")
        stderr = (io_dir / "stderr").read_bytes().decode("utf-8", errors="replace")
    return SandboxResult(proc.returncode, stdout, stderr, timed_out, wall)

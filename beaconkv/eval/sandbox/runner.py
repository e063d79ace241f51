"""Running one program: :func:`run_python`, the containment check, and the two ways a run is contained (the
namespace helper, or rlimits only when asked for).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .cgroups import _cgroup_parent
from .limits import _RLIMITS_OPT_IN, SandboxLimits, SandboxResult, SandboxUnavailable
from .mounts import _INSIDE_DIR, _mount_plan
from .namespaces import _HELPER_FLAG, _wait_for_exit
from .rlimits import _set_limits, _thread_stack_bytes
from .seccomp import _SECCOMP_TABLES, _machine

__all__ = [
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

_HELPER_GRACE_S = 10.0  # the helper's own start and teardown, beyond timeout_s
_KEPT_OUTPUT_BYTES = 1 << 20  # stdout that hit the output limit: its first MiB; stderr: its last MiB
#: Set by tests only: map just the grader's uid (what an unprivileged grader gets) even as root.
_FORCE_SINGLE_ID_MAP = False


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
    """Start the helper (``helper.py`` run as a script) and turn its report into a result."""
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
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helper.py")
    helper = [sys.executable, "-I", "-S", "-B", script, _HELPER_FLAG,
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

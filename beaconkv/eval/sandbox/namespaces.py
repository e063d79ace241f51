"""The namespace containment's helper process and its children: new user, mount, PID, IPC, UTS, cgroup and
network namespaces, the id maps, the box's init, and the program's last steps (limits, no privileges,
seccomp, execve).

The grader starts it through :mod:`.helper` (run by path); :func:`beaconkv.eval.sandbox.run_python` reads
its report.
"""

from __future__ import annotations

import json
import os
import resource
import select
import signal
import time
from pathlib import Path
from typing import Any

from .cgroups import _HELPER_TASKS, _make_cgroup, _remove_cgroup
from .libc import _PR_SET_CHILD_SUBREAPER, _PR_SET_NO_NEW_PRIVS, _PR_SET_PDEATHSIG, _Libc
from .mounts import _INSIDE_DIR, _INSIDE_ID, _build_root
from .rlimits import _MAX_TASKS
from .seccomp import (
    _CLONE_NEWCGROUP,
    _CLONE_NEWIPC,
    _CLONE_NEWNET,
    _CLONE_NEWNS,
    _CLONE_NEWPID,
    _CLONE_NEWUSER,
    _CLONE_NEWUTS,
)

__all__ = ["SANDBOX_HOST_ID"]


# ---------------------------------------------------------------------------------------------
# The helper: everything here runs in the helper process (helper.py run as a script) and in the
# processes it forks. It uses only the standard library and ctypes: run by path with ``python -S``,
# it imports neither beaconkv nor torch and starts in tens of milliseconds.
#
#   helper H (host namespaces; reaps everything, enforces timeout_s, writes result.json)
#     └─ A: unshare(user, mount, pid, ipc, uts, cgroup, net); H writes A's uid/gid maps
#          └─ B: PID 1 of the new PID namespace; builds the root, forks the program, reaps
#               └─ C: limits, drops privileges, seccomp, execve(python ...)
# ---------------------------------------------------------------------------------------------


SANDBOX_HOST_ID = 2_000_000_000
"""Host uid and gid of sandboxed programs when the grader runs as root (1000 inside the sandbox).
Chosen far above ordinary users so that it owns no host file."""

_HELPER_FLAG = "--beaconkv-sandbox-helper"


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

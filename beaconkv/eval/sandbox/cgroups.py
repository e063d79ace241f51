"""Memory and task limits of the whole process tree through a cgroup v2: finding a delegated parent (the
grader's side) and each run's child cgroup, created and removed by the helper.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path
from typing import Any

from .mounts import _unescape
from .rlimits import _MAX_TASKS

_HELPER_TASKS = 2  # the helper's two processes inside the user namespace (unshare-er and init)
_CGROUP_SLACK_MB = 16  # memory.max headroom for those two processes


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

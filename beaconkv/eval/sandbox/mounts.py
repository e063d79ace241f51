"""The box's file system: the mount plan (what the root shows of the host, every path resolved and checked, on
the grader's side) and the root built from it inside the mount namespace (in the helper's process B).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import stat
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .libc import _Libc
from .limits import SandboxUnavailable

_INSIDE_ID = 1000  # the program's uid/gid inside the namespace when SANDBOX_HOST_ID is mapped
_INSIDE_DIR = "/sandbox"  # the working folder, as the program sees it
# What the sandbox's root shows of the host (see _mount_plan), besides the interpreter.
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_DEV_NODES = ("null", "zero", "full", "random", "urandom")
_ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime")

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


def _unescape(path: str) -> str:
    """Decode the octal escapes (``\\040`` for a space) of /proc/self/mountinfo."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), path)


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

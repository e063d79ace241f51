"""The few libc calls the box's helper makes (mount, unshare, pivot_root, prctl, capabilities, seccomp),
through ctypes with their argument types set.

Runs in the helper process (standard library only).
"""

from __future__ import annotations

import os
from pathlib import Path

from .seccomp import _SECCOMP_TABLES, _machine, _seccomp_program

_PR_SET_PDEATHSIG = 1
_PR_SET_SECCOMP = 22
_PR_CAPBSET_DROP = 24
_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_SECCOMP_MODE_FILTER = 2


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

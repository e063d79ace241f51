"""The seccomp filter of the box's program: a classic-BPF program built per architecture from its syscall
numbers, refusing new namespaces, the kernel keyrings, io_uring and (when asked) new processes.

Runs in the helper process (standard library only). The ``clone`` namespace flags are defined here: the
filter refuses them, and :mod:`.namespaces` unshares them.
"""

from __future__ import annotations

import os
from typing import Any

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


def _machine() -> str:
    return os.uname().machine


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

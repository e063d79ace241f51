"""Builds and loads the CPU kernels (``beaconkv_cpu::*``) once per process.

The sources (``csrc/*.cpp``, AVX2 + FMA intrinsics) ship with the package and are compiled at first
use with ``torch.utils.cpp_extension`` — about 50 s once per machine, then cached in torch's
extensions folder. Where they cannot be built (no C++ compiler or ninja, not an x86 CPU with AVX2)
:func:`kernels_status` says why, and every caller falls back to PyTorch's own operators.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import torch
from torch import Tensor

from ..errors import BeaconKVError

SOURCES = tuple(Path(__file__).with_name("csrc") / name for name in ("bf16w_linear.cpp", "mixed_attention.cpp"))
"""The kernels' C++ sources, shipped with the package (with the header they share, ``csrc/avx2_bf16.h``)."""

_BUILD_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]
STALE_LOCK_S = 600.0
"""Age after which torch's build lock is taken for a leftover of an interrupted build (a build takes ~50 s)."""
_lock = threading.Lock()
_status: dict[str, str | None] = {}


class KernelBuildError(BeaconKVError, RuntimeError):
    """A CPU kernel cannot run here (see the message for why and what to use instead)."""


def _unsupported_reason() -> str | None:
    """Why the kernels cannot be built on this machine, or None."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"this CPU's vector capability is {capability}, the kernels need AVX2 and FMA"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r}) on the PATH; install one (e.g. g++) or set CXX"
    if _ninja_dir() is None:
        return "torch builds C++ extensions with ninja, which is not on the PATH; pip install ninja"
    return None


def _ninja_dir() -> str | None:
    """The folder of a ``ninja`` executable: on the PATH, or next to this interpreter (an unactivated venv)."""
    found = shutil.which("ninja")
    if found is not None:
        return os.path.dirname(found)
    beside = Path(sys.executable).parent
    return str(beside) if (beside / "ninja").is_file() else None


def _sources_digest() -> str:
    """A short digest of every file in ``csrc/``: the build's name, so that a changed header rebuilds too
    (torch's cache of built extensions compares the listed sources only)."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).with_name("csrc").iterdir()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def clear_stale_lock(build_dir: str | os.PathLike[str], max_age_s: float = STALE_LOCK_S) -> bool:
    """Removes torch's build lock of ``build_dir`` when it is older than any build takes.

    torch's extension builder holds a ``lock`` file while one process builds and makes every other
    process wait for it to go, with no time limit: a build killed midway (Ctrl-C, a killed test run)
    leaves the file behind and every later process waits forever, silently. A lock older than
    ``max_age_s`` is such a leftover; it is removed, with a line on stderr naming it.

    Args:
        build_dir: The extension's build folder.
        max_age_s: Age in seconds past which the lock is stale.

    Returns:
        Whether a stale lock was removed.
    """
    lock = Path(build_dir) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < max_age_s:
        return False
    lock.unlink(missing_ok=True)
    print(f"beaconkv: removed the stale build lock {lock} ({age / 60:.0f} min old: an interrupted build left it)",
          file=sys.stderr, flush=True)
    return True


def _build() -> str | None:
    """Builds and loads the extension; returns why it failed, or None."""
    reason = _unsupported_reason()
    if reason is not None:
        return reason
    from torch.utils import cpp_extension

    print("beaconkv: loading the CPU kernels (built once per machine, about 50 s)…", file=sys.stderr, flush=True)
    ninja = _ninja_dir()
    if ninja is not None and shutil.which("ninja") is None:  # torch looks for it on the PATH only
        os.environ["PATH"] = ninja + os.pathsep + os.environ.get("PATH", "")
    name = f"beaconkv_cpu_kernels_{_sources_digest()}"
    try:
        clear_stale_lock(cpp_extension._get_build_directory(name, verbose=False))
    except (AttributeError, OSError):  # another torch's layout, or an unwritable folder: torch reports it below
        pass
    try:
        cpp_extension.load(name=name, sources=[str(s) for s in SOURCES],
                           extra_cflags=_BUILD_FLAGS, extra_ldflags=["-fopenmp"], is_python_module=False,
                           verbose=False)
    except (RuntimeError, OSError, ImportError) as err:  # a compiler or linker failure
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return f"building the CPU kernels failed: {first[:300]}"

    @torch.library.register_fake("beaconkv_cpu::bf16w_linear")
    def _linear_shape(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return x.new_empty(x.shape[0], weight.shape[0])

    @torch.library.register_fake("beaconkv_cpu::mixed_attention")
    def _attention_shape(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
        return q.new_empty(q.shape)

    return None


def kernels_status(build: bool = True) -> str | None:
    """None when the kernels are loaded (building them first if ``build``), else why they are not.

    The first call with ``build=True`` compiles the extension (about 50 s on a 2-core machine, then
    cached on disk across processes); later calls return at once.
    """
    with _lock:
        if "reason" not in _status:
            if not build:
                return _unsupported_reason() or "not built yet in this process"
            _status["reason"] = _build()
        return _status["reason"]

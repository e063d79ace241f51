"""Where ``torch.compile`` keeps what it compiled, so that a second process starts warm.

Two mechanisms of torch, named here so that a user finds them:

* **inductor's cache directory** (``TORCHINDUCTOR_CACHE_DIR``; by default a ``torchinductor_<user>`` folder
  under the system's temporary directory): every graph inductor compiles is written there (its FX graph
  cache, generated kernels, Triton's binaries), and a later process with the same torch, device and code
  loads them instead of generating code again. :func:`set_compile_cache_dir` (or
  :attr:`CompileConfig.cache_dir <beaconkv.execution.CompileConfig>`) points it at a folder that survives
  (``/tmp`` may not);
* **portable artifacts** (``torch.compiler.save_cache_artifacts`` / ``load_cache_artifacts``, torch 2.7 and
  later): the compiled artifacts of this process as one blob, to carry to another machine with the same
  software and GPU and load there before the first compile — :func:`save_compile_artifacts` and
  :func:`load_compile_artifacts`.

Neither matters to the CUDA default, which compiles nothing (:class:`~beaconkv.execution.GraphExecutor`): its
graphs are recorded from the eager code in seconds in every process.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

__all__ = ["compile_cache_dir", "load_compile_artifacts", "save_compile_artifacts", "set_compile_cache_dir"]


def set_compile_cache_dir(path: str | os.PathLike[str]) -> Path:
    """Makes inductor keep its compiled graphs in ``path`` (created if missing) for the rest of this process.

    Inductor reads ``TORCHINDUCTOR_CACHE_DIR`` whenever it looks for a cached graph, so this takes effect for
    every later compile; graphs already compiled in this process stay where they were written.

    Args:
        path: The folder.

    Returns:
        The absolute folder.
    """
    folder = Path(path).expanduser().absolute()
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    return folder


def compile_cache_dir() -> Path:
    """The folder inductor uses now (``TORCHINDUCTOR_CACHE_DIR``, or torch's default)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


def save_compile_artifacts(path: str | os.PathLike[str]) -> bool:
    """Writes the artifacts this process compiled (``torch.compiler.save_cache_artifacts``) to ``path``.

    Args:
        path: The file to write.

    Returns:
        Whether anything was written (False: this torch cannot save artifacts, or nothing was compiled).
    """
    save = getattr(torch.compiler, "save_cache_artifacts", None)
    saved = save() if save is not None else None
    if not saved:
        return False
    blob, _info = saved
    Path(path).write_bytes(blob)
    return True


def load_compile_artifacts(path: str | os.PathLike[str]) -> bool:
    """Loads artifacts :func:`save_compile_artifacts` wrote (``torch.compiler.load_cache_artifacts``): the next
    compiles of the same graphs on the same software and device read them instead of generating code.

    Args:
        path: The file.

    Returns:
        Whether they were loaded (False: this torch cannot load artifacts).

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    blob = Path(path).read_bytes()
    load = getattr(torch.compiler, "load_cache_artifacts", None)
    if load is None:
        return False
    load(blob)
    return True

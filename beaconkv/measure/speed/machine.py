"""The machine side of a benchmark: streaming bandwidth, peak memory, bytes a decode step reads, inputs."""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import threading
import time
from pathlib import Path

import torch

from ...errors import BeaconKVError
from ...models.config import ModelConfig
from ...models.decoder import CausalLM

#: Short dtype names of the bench's options.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class BenchError(BeaconKVError, ValueError):
    """Inconsistent benchmark settings."""


def sync(device: torch.device) -> None:
    """Waits for the device (CUDA) so that host clocks measure device time."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def streaming_bandwidth(device: torch.device | str = "cpu", nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """The machine's streaming bandwidth in GB/s, the roofline a decode step is compared with.

    A decode step streams the weights and the KV cache once, so the reference is the faster of two
    passes over a buffer far larger than the caches: a read-only reduction (``sum``) and a copy
    (STREAM's *copy*, read + write bytes). Best of ``repeats`` each.

    Args:
        device: Where to measure.
        nbytes: Buffer size (default 1 GiB).
        repeats: Passes per kernel; the fastest counts.
    """
    device = torch.device(device)
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    best = 0.0
    for kernel, moved in ((lambda: x.sum(), x.nbytes), (lambda: y.copy_(x), 2 * x.nbytes)):
        kernel()
        for _ in range(repeats):
            sync(device)
            t0 = time.perf_counter()
            kernel()
            sync(device)
            best = max(best, moved / (time.perf_counter() - t0) / 1e9)
    return best


def rss_bytes() -> int:
    """This process's resident memory in bytes (``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _malloc_trim() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class PeakMemory:
    """Context manager measuring peak memory: CUDA peak allocated, else the peak process RSS.

    On CPU a thread samples ``/proc/self/statm`` every millisecond (freed heap is first returned to
    the system with ``malloc_trim`` so the baseline is honest).

    Attributes:
        peak: Peak bytes (allocated on CUDA, resident on CPU) during the block.
        baseline: Bytes at entry.
    """

    def __init__(self, device: torch.device | str = "cpu", interval_s: float = 0.001) -> None:
        self.device, self.interval = torch.device(device), interval_s
        self.peak = self.baseline = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, rss_bytes())

    def __enter__(self) -> PeakMemory:  # noqa: PYI034 - Python 3.10 has no typing.Self
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = self.peak = torch.cuda.memory_allocated(self.device)
        elif os.path.exists("/proc/self/statm"):
            _malloc_trim()
            self.baseline = self.peak = rss_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        elif self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, rss_bytes())

    @property
    def increase(self) -> int:
        """Peak minus baseline bytes."""
        return self.peak - self.baseline


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of keys + values one token occupies in every layer's cache."""
    elem = torch.empty((), dtype=dtype).element_size()
    return config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * elem


def weight_bytes_per_step(model: CausalLM, batch: int) -> int:
    """Weight bytes a decode step reads: every parameter once (a tied embedding through the LM head);
    an untied embedding only for the ``batch`` looked-up rows."""
    seen: dict[int, torch.Tensor] = {p.data_ptr(): p for p in model.parameters()}
    total = sum(p.nbytes for p in seen.values())
    emb = model.model.embed_tokens.weight
    if emb.data_ptr() != model.lm_head.weight.data_ptr():
        total -= emb.nbytes - batch * emb.shape[1] * emb.element_size()
    return total


def random_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``batch`` prompts of ``length`` random ids (ids 0-2 avoided: special tokens of most vocabularies)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g).tolist()



def cpu_name() -> str:
    """The CPU's model name (from ``/proc/cpuinfo``), for reports."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "CPU"

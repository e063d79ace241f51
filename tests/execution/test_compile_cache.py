"""Where torch.compile keeps what it compiled (:mod:`beaconkv.execution.compile_cache`)."""

from __future__ import annotations

import pytest

from beaconkv.execution import CompileConfig, CompiledExecutor


def test_the_compile_cache_dir_is_set_for_the_process(tmp_path, monkeypatch):
    from beaconkv.execution.compile_cache import compile_cache_dir, load_compile_artifacts, set_compile_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/nonexistent-before")
    folder = set_compile_cache_dir(tmp_path / "inductor")
    assert folder.is_dir() and compile_cache_dir() == folder
    CompiledExecutor(CompileConfig(backend="aot_eager", cache_dir=str(tmp_path / "other")), "cpu")
    assert compile_cache_dir() == tmp_path / "other"
    with pytest.raises(FileNotFoundError):
        load_compile_artifacts(tmp_path / "missing.bin")

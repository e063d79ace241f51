"""Building the CPU kernels: a build that was killed midway must not hang every later process."""

from __future__ import annotations

import os
import time

from beaconkv.kernels import build


def _lock(folder, age_s: float):
    lock = folder / "lock"
    lock.touch()
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


def test_a_lock_left_by_an_interrupted_build_is_removed_and_named(tmp_path, capsys):
    lock = _lock(tmp_path, build.STALE_LOCK_S + 60)
    assert build.clear_stale_lock(tmp_path)
    assert not lock.exists() and str(lock) in capsys.readouterr().err


def test_the_lock_of_a_build_under_way_is_left_alone(tmp_path, capsys):
    lock = _lock(tmp_path, 5)
    assert not build.clear_stale_lock(tmp_path)
    assert lock.exists() and capsys.readouterr().err == ""


def test_no_lock_is_nothing_to_do(tmp_path):
    assert not build.clear_stale_lock(tmp_path)

"""Containment of the code sandbox: each escape a user found against the grader, as a test.

The escapes: reading host files and writing outside the working folder; a ``setsid``
double-forked grandchild outliving the grading; killing the grader with
``os.kill(os.getppid(), SIGKILL)``; exceeding the memory limit with forked children; a 100 MB print
reported as a runtime error instead of an output limit. The first four are guarantees of the
namespace containment only (the rlimits-only fallback documents that it does not contain them), so
those tests are skipped where namespaces are unavailable; the fallback's own tests check that it
says so in the result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from beaconkv.eval import sandbox
from beaconkv.eval.code_grading import grade_code
from beaconkv.eval.datasets import CodeTest
from beaconkv.eval.sandbox import SandboxLimits, namespace_sandbox_available, run_python

NAMESPACES = namespace_sandbox_available()
needs_namespaces = pytest.mark.skipif(
    not NAMESPACES,
    reason="user namespaces are unavailable here: the rlimits-only fallback does not contain this "
    f"escape (see beaconkv.eval.sandbox); probe said: {sandbox._namespace_probe()[1]}",
)
LIMITS = SandboxLimits(timeout_s=5.0, memory_mb=512)


def fenced(code: str) -> str:
    """A model response whose only code block is ``code``."""
    return f"```python\n{code}\n```\n"


def processes_with(marker: str) -> list[int]:
    """Host PIDs whose command line contains ``marker`` (this process excluded)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if marker.encode() in Path("/proc", entry, "cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                pass  # exited meanwhile
    return found


@pytest.fixture
def single_id_map(request, monkeypatch) -> str:
    """Run as root would (program as an unprivileged host uid) or as an unprivileged grader would."""
    monkeypatch.setattr(sandbox, "_FORCE_SINGLE_ID_MAP", request.param == "single")
    return request.param


def test_a_normal_program_passes_with_little_overhead() -> None:
    code = "a, b = map(int, input().split())\nprint(a + b)"
    result = run_python({"main.py": code}, "main.py", stdin="2 40\n", limits=LIMITS)
    assert (result.status, result.stdout) == ("ok", "42\n"), result.stderr
    assert result.wall_s < 1.0
    if NAMESPACES:
        assert result.containment in ("namespaces+cgroup", "namespaces+rlimit")
    grade = grade_code(fenced(code), (CodeTest("1 2\n", "3\n"), CodeTest("5 5\n", "10\n")), limits=LIMITS)
    assert grade.correct, grade.detail


@needs_namespaces
@pytest.mark.parametrize("single_id_map", ["split", "single"], indirect=True)
def test_host_files_are_invisible_and_only_the_working_folder_is_writable(
    tmp_path: Path, single_id_map: str
) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("the answers")
    planted = f"planted-{uuid.uuid4().hex}.txt"  # unique: a leftover cannot fake a result
    outside = [tmp_path / planted, Path("/tmp", planted), Path("/", planted), Path(sys.prefix, planted)]
    checks = {
        "read_secret": f"open({str(secret)!r}).read()",
        "list_secret_dir": f"os.listdir({str(tmp_path)!r})",
        "read_hostname": "open('/etc/hostname').read()",
        "read_project": f"open({__file__!r}).read()",
        **{f"write_{path.parent}": f"open({str(path)!r}, 'w').write('x')" for path in outside},
        "chmod_dev_null": "os.chmod('/dev/null', 0o600)",
        "write_working_folder": "open('mine.txt', 'w').write('x')",
    }
    code = "import json, os\nout = {}\n" + "".join(
        f"try:\n    {expr}\n    out[{name!r}] = 'allowed'\nexcept OSError as e:\n"
        f"    out[{name!r}] = type(e).__name__\n"
        for name, expr in checks.items()
    ) + "print(json.dumps(out))"
    result = run_python({"main.py": code}, "main.py", limits=LIMITS)
    assert result.status == "ok", result.stderr
    out = json.loads(result.stdout)
    assert out.pop("write_working_folder") == "allowed"
    assert all(outcome != "allowed" for outcome in out.values()), out
    assert [path for path in outside if path.exists()] == []


@needs_namespaces
def test_no_process_of_the_program_survives_grading(tmp_path: Path) -> None:
    marker = f"beaconkv-survivor-{uuid.uuid4().hex}"
    late_file = tmp_path / "written-after-grading.txt"
    grandchild = f"import sys, time; time.sleep(2); open({str(late_file)!r}, 'w').write('escaped')"
    code = (
        "import os, sys, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        print('grandchild alive', flush=True)\n"
        f"        os.execv(sys.executable, [sys.executable, '-c', {grandchild!r}, {marker!r}])\n"
        "    os._exit(0)\n"
        "time.sleep(0.3)\n"
        "print('parent done', flush=True)\n"
    )
    forking = SandboxLimits(timeout_s=5.0, memory_mb=512, max_processes=4)
    exits = run_python({"main.py": code}, "main.py", limits=forking)
    assert exits.status == "ok", exits.stderr
    assert exits.stdout.split("\n")[:2] == ["grandchild alive", "parent done"]
    assert processes_with(marker) == []
    hangs = run_python(
        {"main.py": code + "while True:\n    pass\n"}, "main.py",
        limits=SandboxLimits(timeout_s=1.0, memory_mb=512, max_processes=4),
    )
    assert hangs.status == "timeout" and "grandchild alive" in hangs.stdout
    assert processes_with(marker) == []
    time.sleep(2.5)  # past the grandchild's write
    assert processes_with(marker) == [] and not late_file.exists()


DRIVER = """\
import importlib.util, sys
spec = importlib.util.spec_from_file_location("sandbox_under_test", sys.argv[1])
sandbox = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = sandbox
spec.loader.exec_module(sandbox)
limits = sandbox.SandboxLimits(timeout_s=5.0, containment="namespaces", max_processes=4)
result = sandbox.run_python({"main.py": sys.argv[2]}, "main.py", limits=limits)
print("grader alive:", result.status, result.stdout.strip().replace("\\n", " | "))
"""


@needs_namespaces
def test_the_grader_cannot_be_signalled_from_inside(tmp_path: Path) -> None:
    # The grader is a separate process here (loading sandbox.py by path, without torch), so that a
    # regression kills that process instead of the test run.
    code = (
        "import os, signal\n"
        "parent = os.getppid()\n"
        "for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):\n"
        "    try:\n"
        "        os.kill(parent, sig)\n"
        "    except OSError:\n"
        "        pass\n"
        "visible = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n"
        "print('parent', parent, 'visible', visible, 'still running')\n"
    )
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    done = subprocess.run(
        [sys.executable, "-I", str(driver), sandbox.__file__, code],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    line = done.stdout.strip()
    assert line.startswith("grader alive: ok parent 1 ") and line.endswith("still running"), line
    # Only the namespace's own processes exist for the program: its init (1) and itself.
    assert json.loads(line.split("visible ")[1].split(" still")[0]) == [1, 2]


@needs_namespaces
def test_memory_is_bounded_for_the_whole_process_tree() -> None:
    code = (
        "import os, sys, time\n"
        "children = []\n"
        "for _ in range(3):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        block = bytearray(700 * 2 ** 20)  # zero-filled: really resident\n"
        "        time.sleep(1)\n"
        "        os._exit(0)\n"
        "    children.append(pid)\n"
        "if all(os.waitpid(pid, 0)[1] == 0 for pid in children):\n"
        "    print('all children held 700 MiB at once')\n"
        "else:\n"
        "    sys.exit(1)\n"
    )
    tree = SandboxLimits(timeout_s=5.0, memory_mb=1024, max_processes=4)
    result = run_python({"main.py": code}, "main.py", limits=tree)
    assert result.status == "memory", (result.status, result.stderr[-1000:])
    assert "all children" not in result.stdout
    # By default the program may not create processes at all (threads still work).
    single = run_python({"main.py": code}, "main.py", limits=SandboxLimits(timeout_s=5.0, memory_mb=1024))
    assert single.status == "error" and "PermissionError" in single.stderr
    threads = "import threading\nt = threading.Thread(target=print, args=('ran',))\nt.start(); t.join()"
    assert run_python({"main.py": threads}, "main.py", limits=LIMITS).stdout == "ran\n"


@pytest.mark.parametrize("containment", ["auto", "rlimits"])
def test_an_over_long_output_is_an_output_limit(containment: str) -> None:
    limits = SandboxLimits(timeout_s=5.0, memory_mb=512, containment=containment)
    code = "print('x' * 100_000_000)"
    result = run_python({"main.py": code}, "main.py", limits=limits)
    assert result.status == "output-limit" and result.output_limited
    assert len(result.stdout) <= 1 << 20  # only the first MiB is read back into the grader
    grade = grade_code(fenced(code), (CodeTest("", "x\n"),), limits=limits)
    assert not grade.correct and grade.detail == "test 1/1: output-limit"


def test_the_fallback_is_explicit_in_the_result(monkeypatch) -> None:
    code = "print(sum(range(10)))"
    forced = run_python({"main.py": code}, "main.py", limits=SandboxLimits(containment="rlimits"))
    assert (forced.status, forced.stdout, forced.containment) == ("ok", "45\n", "rlimits-only")
    # Where namespaces do not work, "auto" falls back and says so; "namespaces" refuses to run.
    monkeypatch.setattr(sandbox, "_namespace_probe", lambda: (False, "user namespaces disabled"))
    assert not sandbox.namespace_sandbox_available()
    auto = run_python({"main.py": code}, "main.py", limits=SandboxLimits())
    assert (auto.status, auto.containment) == ("ok", "rlimits-only")
    with pytest.raises(RuntimeError, match="user namespaces disabled.*containment='auto' or 'rlimits'"):
        run_python({"main.py": code}, "main.py", limits=SandboxLimits(containment="namespaces"))


def test_limits_name_a_bad_value() -> None:
    with pytest.raises(ValueError, match="max_processes=0"):
        SandboxLimits(max_processes=0)
    with pytest.raises(ValueError, match="containment='docker'"):
        SandboxLimits(containment="docker")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cgroup_parent='/nonexistent'"):
        run_python({"main.py": "pass"}, "main.py", limits=SandboxLimits(cgroup_parent="/nonexistent"))

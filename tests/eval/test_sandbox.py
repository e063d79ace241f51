"""Containment of the code sandbox: each escape a user found against the grader, as a test.

The escapes: reading host files (a submission printing one was graded correct), writing outside the
working folder, reading the grader's environment, a ``setsid`` double-forked grandchild outliving
the grading, killing the grader, signalling an unrelated process, ``ptrace`` of the parent, a fork
bomb, memory held by forked children beyond the limit, filling the working folder, a socket to a
127.0.0.1 listener past the Python-level guard, and 100 MB on stdout. From issue 39: a grader run
through a symlinked ``~/bin/python`` showed ``~`` to the program (it read ``~/.ssh/id_rsa``);
io_uring was allowed; a correct program was stopped at 14 threads at 512 MiB; and the limits on
what a run hands back to the grader (stdout whole up to the cap, stderr's last MiB).

They are guarantees of the namespace containment, which is the default and which must start on
every machine where an unprivileged user namespace can be created
(:func:`test_the_namespace_sandbox_starts_wherever_user_namespaces_work`); the tests skip only where
the kernel refuses to create one (a true absence, named in the reason). The rlimits-only fallback
runs only when asked for by name, and its results say so.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from beaconkv.eval import sandbox
from beaconkv.eval.code_grading import grade_code
from beaconkv.eval.datasets import CodeTest
from beaconkv.eval.sandbox import SandboxLimits, SandboxUnavailable, namespace_sandbox_available, run_python

# unshare(user | mount | pid | ipc | uts | cgroup | net) in a fresh single-threaded process: what the
# sandbox needs from the kernel, asked for directly, without the sandbox's own code.
_UNSHARE = (
    "import ctypes, os, sys\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "flags = 0x10000000 | 0x00020000 | 0x20000000 | 0x08000000 | 0x04000000 | 0x02000000 | 0x40000000\n"
    "if libc.unshare(flags) != 0:\n"
    "    sys.exit(os.strerror(ctypes.get_errno()))\n"
)


def _user_namespaces_refused() -> str:
    """Why the kernel refuses unprivileged namespaces here, or ``""`` where it creates them."""
    if not sys.platform.startswith("linux"):
        return f"user namespaces need Linux, this is {sys.platform}"
    done = subprocess.run([sys.executable, "-I", "-c", _UNSHARE], capture_output=True, text=True, timeout=30)
    return "" if done.returncode == 0 else f"unshare(2) refused: {done.stderr.strip()[-300:]}"


REFUSED = _user_namespaces_refused()
needs_namespaces = pytest.mark.skipif(
    bool(REFUSED), reason=f"this kernel creates no unprivileged user namespaces ({REFUSED}): no containment to test"
)
LIMITS = SandboxLimits(timeout_s=5.0, memory_mb=512)


def fenced(code: str) -> str:
    """A model response whose only code block is ``code``."""
    return f"```python\n{code}\n```\n"


def attempts(checks: dict[str, str], prelude: str = "import json, os\n") -> str:
    """A program that tries each expression and prints ``{name: 'allowed' or the exception's name}``."""
    return prelude + "out = {}\n" + "".join(
        f"try:\n    {expr}\n    out[{name!r}] = 'allowed'\nexcept Exception as e:\n"
        f"    out[{name!r}] = type(e).__name__\n"
        for name, expr in checks.items()
    ) + "print(json.dumps(out))"


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
    monkeypatch.setattr(sandbox.runner, "_FORCE_SINGLE_ID_MAP", request.param == "single")
    return request.param


@needs_namespaces
def test_the_namespace_sandbox_starts_wherever_user_namespaces_work() -> None:
    works, why = sandbox.runner._namespace_probe()
    assert works and namespace_sandbox_available(), f"the kernel creates user namespaces but the sandbox failed: {why}"


@needs_namespaces
def test_a_normal_program_passes_with_little_overhead() -> None:
    code = "a, b = map(int, input().split())\nprint(a + b)"
    result = run_python({"main.py": code}, "main.py", stdin="2 40\n", limits=LIMITS)
    assert (result.status, result.stdout) == ("ok", "42\n"), result.stderr
    assert result.wall_s < 1.0
    assert result.containment in ("namespaces+cgroup", "namespaces+rlimit")
    grade = grade_code(fenced(code), (CodeTest("1 2\n", "3\n"), CodeTest("5 5\n", "10\n")), limits=LIMITS)
    assert grade.correct, grade.detail
    assert grade.containment == result.containment


DRIVER = """\
import importlib.util, sys
spec = importlib.util.spec_from_file_location("sandbox_under_test", sys.argv[1])
sandbox = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = sandbox
spec.loader.exec_module(sandbox)
limits = sandbox.SandboxLimits(timeout_s=5.0, max_processes=4)
result = sandbox.run_python({"main.py": sys.argv[2]}, "main.py", limits=limits)
print("grader alive:", result.status, result.containment, result.stdout.strip().replace("\\n", " | "))
"""


def run_driver(python: str, code: str, directory: Path) -> str:
    """Runs ``code`` through a grader in a separate process (the sandbox package loaded by path, no torch)."""
    driver = directory / "driver.py"
    driver.write_text(DRIVER)
    done = subprocess.run([python, "-I", str(driver), sandbox.__file__, code],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    return done.stdout.strip()


@needs_namespaces
def test_the_sandbox_starts_when_the_interpreter_lives_under_tmp() -> None:
    # CI may keep its venv under /tmp: the read-only bind of the interpreter's prefix then creates the
    # new root's /tmp before the root is built (once a FileExistsError that disabled the sandbox).
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="beaconkv-venv-") as tmp:
        venv = Path(tmp, "venv")
        subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(venv)],
                       check=True, timeout=120)
        code = (f"import os, sys\nprint(sys.prefix == {str(venv)!r}, os.path.exists({tmp!r} + '/driver.py'), "
                "os.access('/tmp', os.W_OK))")
        line = run_driver(str(venv / "bin" / "python"), code, Path(tmp))
    status, containment, *seen = line.removeprefix("grader alive: ").split()
    assert (status, containment in ("namespaces+cgroup", "namespaces+rlimit")) == ("ok", True), line
    assert seen == ["True", "False", "False"], line  # its own prefix; not the folder around it; /tmp read-only


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
    result = run_python({"main.py": attempts(checks)}, "main.py", limits=LIMITS)
    assert result.status == "ok", result.stderr
    out = json.loads(result.stdout)
    assert out.pop("write_working_folder") == "allowed"
    assert all(outcome != "allowed" for outcome in out.values()), out
    assert [path for path in outside if path.exists()] == []
    # the escape as it was found: a submission that prints the host's answer file is graded wrong
    cheat = grade_code(fenced(f"print(open({str(secret)!r}).read())"), (CodeTest("", "the answers\n"),),
                       limits=LIMITS)
    assert not cheat.correct and cheat.detail.startswith("test 1/1: runtime error: FileNotFoundError"), cheat.detail


@needs_namespaces
def test_the_graders_environment_is_invisible(monkeypatch) -> None:
    token = f"fake-secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("BEACONKV_TEST_API_KEY", token)
    code = (
        "import os\n"
        "print(sorted(os.environ.items()))\n"
        "for pid in ['self', '1', str(os.getppid())] + [p for p in os.listdir('/proc') if p.isdigit()]:\n"
        "    try:\n"
        "        print(pid, open(f'/proc/{pid}/environ', 'rb').read())\n"
        "    except OSError as e:\n"
        "        print(pid, type(e).__name__)\n"
    )
    result = run_python({"main.py": code}, "main.py", limits=LIMITS)
    assert result.status == "ok", result.stderr
    assert "PATH" in result.stdout and token not in result.stdout  # it ran and saw a clean environment only


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


@needs_namespaces
def test_the_grader_cannot_be_signalled_from_inside(tmp_path: Path) -> None:
    # The grader is a separate process here, so that a regression kills that process, not the test run.
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
    line = run_driver(sys.executable, code, tmp_path)
    assert line.startswith("grader alive: ok namespaces+") and line.endswith("still running"), line
    assert " parent 1 " in line
    # Only the namespace's own processes exist for the program: its init (1) and itself.
    assert json.loads(line.split("visible ")[1].split(" still")[0]) == [1, 2]


@needs_namespaces
def test_unrelated_host_processes_cannot_be_signalled() -> None:
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        targets = {"bystander": bystander.pid, "grader": os.getpid(), "host_init": 1 if os.getpid() != 1 else 2}
        checks = {name: f"os.kill({pid}, signal.SIGKILL)" for name, pid in targets.items() if name != "host_init"}
        result = run_python({"main.py": attempts(checks, "import json, os, signal\n")}, "main.py", limits=LIMITS)
        assert result.status == "ok", result.stderr
        # the bystander's PID does not exist in the program's PID namespace (or is not its to signal)
        assert set(json.loads(result.stdout).values()) <= {"ProcessLookupError", "PermissionError"}, result.stdout
        time.sleep(0.2)
        assert bystander.poll() is None, "the bystander was killed from inside the sandbox"
    finally:
        bystander.kill()
        bystander.wait()


@needs_namespaces
def test_ptrace_of_the_parent_and_its_memory_are_refused() -> None:
    checks = {
        "attach_parent": "check(libc.ptrace(16, os.getppid(), 0, 0))",  # PTRACE_ATTACH
        "seize_parent": "check(libc.ptrace(0x4206, os.getppid(), 0, 0))",  # PTRACE_SEIZE
        "read_parent_memory": "open(f'/proc/{os.getppid()}/mem', 'rb').read(1)",
        "parent_fds": "os.listdir(f'/proc/{os.getppid()}/fd')",
    }
    prelude = (
        "import ctypes, json, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]\n"
        "def check(ret):\n"
        "    if ret != 0:\n"
        "        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))\n"
    )
    result = run_python({"main.py": attempts(checks, prelude)}, "main.py", limits=LIMITS)
    assert result.status == "ok", result.stderr
    out = json.loads(result.stdout)
    assert all(outcome != "allowed" for outcome in out.values()), out


FORK_BOMB = """\
import os, time
children = 0
for _ in range(200):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(1.5)
        os._exit(0)
    children += 1
print("children", children, flush=True)
"""


@needs_namespaces
def test_a_fork_bomb_is_capped() -> None:
    denied = run_python({"main.py": FORK_BOMB}, "main.py", limits=LIMITS)  # the default: no processes at all
    assert (denied.status, denied.stdout) == ("ok", "children 0\n"), denied.stderr
    capped = run_python({"main.py": FORK_BOMB}, "main.py", limits=SandboxLimits(timeout_s=5.0, max_processes=4))
    assert capped.status == "ok", capped.stderr
    assert capped.stdout == "children 3\n"  # itself + 3 children: the 4 processes allowed


@needs_namespaces
def test_memory_is_bounded_for_the_whole_process_tree() -> None:
    code = (
        "import os, sys, time\n"
        "children = []\n"
        "for _ in range(5):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        block = bytearray(750 * 2 ** 20)  # zero-filled: really resident\n"
        "        time.sleep(1)\n"
        "        os._exit(0)\n"
        "    children.append(pid)\n"
        "if all(os.waitpid(pid, 0)[1] == 0 for pid in children):\n"
        "    print('all children held 750 MiB at once')\n"
        "else:\n"
        "    sys.exit(1)\n"
    )
    tree = SandboxLimits(timeout_s=5.0, memory_mb=1024, max_processes=8)
    result = run_python({"main.py": code}, "main.py", limits=tree)
    assert result.status in ("memory", "error"), (result.status, result.stderr[-1000:])
    assert "all children" not in result.stdout
    # By default the program may not create processes at all (threads still work).
    single = run_python({"main.py": code}, "main.py", limits=SandboxLimits(timeout_s=5.0, memory_mb=1024))
    assert single.status == "error" and "PermissionError" in single.stderr
    threads = "import threading\nt = threading.Thread(target=print, args=('ran',))\nt.start(); t.join()"
    assert run_python({"main.py": threads}, "main.py", limits=LIMITS).stdout == "ran\n"


@needs_namespaces
def test_the_working_folder_has_a_total_size_bound() -> None:
    code = (
        "import os\n"
        "written = 0\n"
        "try:\n"
        "    for i in range(128):  # 1 GiB in files of 8 MiB, each under the per-file limit\n"
        "        with open(f'fill-{i}.bin', 'wb') as f:\n"
        "            f.write(b'x' * (8 << 20))\n"
        "        written += 8 << 20\n"
        "    print('wrote', written)\n"
        "except OSError as e:\n"
        "    print('stopped', written, e.errno == 28)  # ENOSPC\n"
    )
    limits = SandboxLimits(timeout_s=10.0, memory_mb=512, file_size_mb=32)
    result = run_python({"main.py": code}, "main.py", limits=limits)
    assert result.status == "ok", result.stderr
    kind, written, enospc = result.stdout.split()
    assert (kind, enospc) == ("stopped", "True") and int(written) <= 32 << 20, result.stdout


@needs_namespaces
def test_no_network_even_past_the_python_guard() -> None:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    try:
        checks = {
            "guarded_socket": f"socket.create_connection(('127.0.0.1', {port}), timeout=1)",
            "raw_socket": f"s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM); s.settimeout(1); "
                          f"s.connect(('127.0.0.1', {port}))",
        }
        result = run_python({"main.py": attempts(checks, "import json, socket, _socket\n")}, "main.py", limits=LIMITS)
        assert result.status == "ok", result.stderr
        out = json.loads(result.stdout)
        assert out["guarded_socket"] == "PermissionError" and out["raw_socket"] != "allowed", out
        with pytest.raises(socket.timeout):
            listener.accept()  # nothing ever reached the listener
    finally:
        listener.close()


@pytest.mark.parametrize("containment", ["namespaces", "rlimits"])
def test_an_over_long_output_is_an_output_limit(containment: str) -> None:
    if containment == "namespaces" and REFUSED:
        pytest.skip(f"this kernel creates no unprivileged user namespaces ({REFUSED})")
    limits = SandboxLimits(timeout_s=5.0, memory_mb=512, containment=containment)
    code = "print('x' * 100_000_000)"
    result = run_python({"main.py": code}, "main.py", limits=limits)
    assert result.status == "output-limit" and result.output_limited
    assert len(result.stdout) <= 1 << 20  # only the first MiB is read back into the grader
    grade = grade_code(fenced(code), (CodeTest("", "x\n"),), limits=limits)
    assert not grade.correct and grade.detail == "test 1/1: output-limit"


def test_the_fallback_runs_only_when_asked_for_and_says_so(monkeypatch) -> None:
    code = "print(sum(range(10)))"
    forced = run_python({"main.py": code}, "main.py", limits=SandboxLimits(containment="rlimits"))
    assert (forced.status, forced.stdout, forced.containment) == ("ok", "45\n", "rlimits-only")
    rlimits = SandboxLimits(containment="rlimits")
    assert grade_code(fenced(code), (CodeTest("", "45\n"),), limits=rlimits).containment == "rlimits-only"
    # Where namespaces do not work, the default refuses to run, naming the reason and the opt-in.
    monkeypatch.setattr(sandbox.runner, "_namespace_probe", lambda: (False, "user namespaces disabled"))
    assert not sandbox.namespace_sandbox_available()
    reason = "user namespaces disabled.*containment='rlimits'.*--sandbox rlimits"
    for attempt in (lambda: run_python({"main.py": code}, "main.py"), lambda: sandbox.check_containment()):
        with pytest.raises(SandboxUnavailable, match=reason):
            attempt()
    # grading never raises: the refusal is the grade's error, and nothing is graded correct
    refused = grade_code(fenced(code), (CodeTest("", "45\n"),))
    assert not refused.correct and refused.containment is None
    assert re.match("SandboxUnavailable: .*" + reason, refused.error or ""), refused.error
    assert sandbox.check_containment(rlimits) == "rlimits-only"


def test_nothing_ran_means_no_containment_is_claimed() -> None:
    grade = grade_code("no code here", (CodeTest("", "1\n"),))
    assert (grade.correct, grade.containment) == (False, None)


def test_limits_name_a_bad_value() -> None:
    with pytest.raises(ValueError, match="max_processes=0"):
        SandboxLimits(max_processes=0)
    with pytest.raises(ValueError, match="containment='docker'"):
        SandboxLimits(containment="docker")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="containment='auto'.*explicitly"):
        SandboxLimits(containment="auto")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cgroup_parent='/nonexistent'"):
        run_python({"main.py": "pass"}, "main.py", limits=SandboxLimits(cgroup_parent="/nonexistent"))



# --- issue 39: the interpreter's prefix through a symlink, threads, io_uring, bounded read-back ---


@needs_namespaces
@pytest.mark.parametrize("target", ["binary", "as_run"])
def test_a_grader_run_through_a_symlinked_python_shows_no_file_of_the_links_home(
    tmp_path: Path, target: str
) -> None:
    # The escape as found: ~/bin/python -> the interpreter; binding dirname(dirname(sys.executable))
    # bound ~ and the program read ~/.ssh/id_rsa. "binary": a link to the real interpreter;
    # "as_run": a link to the interpreter as this test runs (a venv's bin/python is a link chain).
    home = tmp_path / "home"
    (home / "bin").mkdir(parents=True)
    (home / ".ssh").mkdir()
    key = home / ".ssh" / "id_rsa"
    key.write_text("-----BEGIN OPENSSH PRIVATE KEY-----")
    link = home / "bin" / "python"
    link.symlink_to(os.path.realpath(sys.executable) if target == "binary" else sys.executable)
    code = attempts({"read_key": f"open({str(key)!r}).read()", "list_home": f"os.listdir({str(home)!r})"})
    line = run_driver(str(link), code, tmp_path)
    status, containment, seen = line.removeprefix("grader alive: ").split(" ", 2)
    assert (status, containment.startswith("namespaces+")) == ("ok", True), line
    assert json.loads(seen) == {"read_key": "FileNotFoundError", "list_home": "FileNotFoundError"}, line


def test_every_bind_source_is_resolved_and_none_is_or_holds_the_links_home(tmp_path: Path, monkeypatch) -> None:
    home = tmp_path / "home"
    (home / "bin").mkdir(parents=True)
    link = home / "bin" / "python"
    link.symlink_to(os.path.realpath(sys.executable))
    monkeypatch.setattr(sys, "executable", str(link))
    mounts, executable = sandbox.mounts._mount_plan()
    binds = [(source, target) for kind, source, target in mounts if kind != "symlink"]
    assert binds and all(os.path.realpath(source) == source for source, _ in binds), binds
    assert not any(str(home) == source or str(home).startswith(source + "/") for source, _ in binds), binds
    assert "/" not in [source for source, _ in binds]
    real_prefix = os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))
    assert any(real_prefix == s or real_prefix.startswith(s + "/") for s, _ in binds), (real_prefix, binds)
    # the link's folder is not shown, so the binary itself is what runs
    assert executable == os.path.realpath(sys.executable)


def test_the_interpreter_path_must_resolve_through_shown_folders_only(tmp_path: Path) -> None:
    shown, hidden = tmp_path / "shown", tmp_path / "hidden"
    (shown / "bin").mkdir(parents=True)
    hidden.mkdir()
    (shown / "bin" / "python3.x").write_bytes(b"")
    (hidden / "python3.x").write_bytes(b"")
    (shown / "bin" / "python3").symlink_to("python3.x")  # relative, inside
    (shown / "bin" / "python").symlink_to("../bin/./python3")  # through .. and .
    (shown / "bin" / "out").symlink_to(hidden / "python3.x")  # a hop through a folder not shown
    (shown / "bin" / "loop").symlink_to("loop")
    trees = [str(shown)]
    assert sandbox.mounts._resolves_inside(str(shown / "bin" / "python"), trees, {})
    assert not sandbox.mounts._resolves_inside(str(shown / "bin" / "out"), trees, {})
    assert sandbox.mounts._resolves_inside(str(shown / "bin" / "out"), [*trees, str(hidden)], {})
    assert not sandbox.mounts._resolves_inside(str(shown / "bin" / "loop"), trees, {})
    assert not sandbox.mounts._resolves_inside(str(shown / "bin"), trees, {})  # a folder is not a binary
    # a top-level link the root recreates ("/bin -> usr/bin") resolves like the host's
    alias = f"/beaconkv-test-alias-{uuid.uuid4().hex}"
    assert sandbox.mounts._resolves_inside(alias + "/python", trees, {alias: str(shown / "bin")})
    assert not sandbox.mounts._resolves_inside(alias + "/python", trees, {})


def test_an_installation_that_is_a_home_directory_is_refused(tmp_path: Path, monkeypatch) -> None:
    home = tmp_path / "home"
    (home / "bin").mkdir(parents=True)
    binary = home / "bin" / "python3"  # as `./configure --prefix=$HOME && make install` would put it
    binary.write_bytes(b"")
    assert sandbox.mounts._refused_root("/") == "the root of the file system"
    temporary = os.path.realpath(tempfile.gettempdir())
    assert sandbox.mounts._refused_root(temporary) == f"the temporary folder {temporary!r}"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(sys, "executable", str(binary))
    with pytest.raises(SandboxUnavailable, match=f"installation '{home}'.*is the home directory '{home}'"):
        sandbox.mounts._mount_plan()
    assert sandbox.mounts._refused_root(str(tmp_path)).startswith("a folder holding the home directory")
    assert sandbox.mounts._refused_root(str(home / "opt" / "python")) == ""  # below a home is fine (~/.pyenv/...)


def test_etc_and_dev_links_show_nothing_outside_their_folder(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("host only")
    shown = tmp_path / "usr" / "zoneinfo"
    shown.mkdir(parents=True)
    (shown / "UTC").write_text("TZif")
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "plain.conf").write_text("ok")
    (etc / "localtime").symlink_to(shown / "UTC")  # into a bound tree: kept as the same link
    (etc / "ld.so.cache").symlink_to(secret)  # out of the folder: left out
    (etc / "alias").symlink_to(etc / "plain.conf")  # inside the folder: bound from where it resolves
    (etc / "dangling").symlink_to(tmp_path / "nothing")
    names = ("plain.conf", "localtime", "ld.so.cache", "alias", "dangling", "absent")
    plan = sandbox.mounts._host_files(str(etc), names, [str(tmp_path / "usr")])
    assert plan == [
        ["bind", str(etc / "plain.conf"), str(etc / "plain.conf")],
        ["symlink", str(etc / "localtime"), str(shown / "UTC")],
        ["bind", str(etc / "plain.conf"), str(etc / "alias")],
    ]
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "null").symlink_to("/dev/null")  # a character device, but not in this folder
    (dev / "zero").write_text("a regular file")
    assert sandbox.mounts._host_files(str(dev), ("null", "zero"), [], devices=True) == []
    assert sandbox.mounts._host_files("/dev", ("null",), [], devices=True) == [["device", "/dev/null", "/dev/null"]]


def test_the_working_folder_copy_refuses_symlinks(tmp_path: Path, monkeypatch) -> None:
    secret = tmp_path / "secret"
    secret.write_text("host only")
    source, target = tmp_path / "work", tmp_path / "box"
    (source / "pkg").mkdir(parents=True)
    target.mkdir()
    (source / "main.py").write_text("print(1)")
    (source / "pkg" / "mod.py").write_text("x = 1")
    monkeypatch.setattr(sandbox.mounts.os, "chown", lambda *args: None)  # the owner is the box's, not ours
    sandbox.mounts._copy_tree(str(source), str(target), 0)
    assert (target / "main.py").read_text() == "print(1)" and (target / "pkg" / "mod.py").read_text() == "x = 1"
    for name, make in (("leak.txt", lambda p: p.symlink_to(secret)), ("leakdir", lambda p: p.symlink_to(tmp_path))):
        shutil.rmtree(target)
        target.mkdir()
        make(source / "pkg" / name)
        with pytest.raises(OSError, match=f"{name}' is neither a regular file nor a folder"):
            sandbox.mounts._copy_tree(str(source), str(target), 0)
        assert not (target / "pkg" / name).exists()
        (source / "pkg" / name).unlink()


THREADS = """\
import sys, threading
n = int(input())
barrier = threading.Barrier(n + 1, timeout=5)  # all n alive at once, then the main thread
totals = []
def work(i):
    barrier.wait()
    totals.append(sum(j * i for j in range(1000)) + len({j: str(j) for j in range(500)}))
threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
for t in threads:
    t.start()
barrier.wait()
for t in threads:
    t.join()
print(len(totals), sum(totals))
"""


@pytest.mark.parametrize("containment", ["namespaces", "rlimits"])
def test_a_program_with_64_threads_is_graded_correct_at_512_mib(containment: str) -> None:
    # 14 threads started (8 MiB stacks and a 64 MiB malloc arena each, all under RLIMIT_AS)
    if containment == "namespaces" and REFUSED:
        pytest.skip(f"this kernel creates no unprivileged user namespaces ({REFUSED})")
    limits = SandboxLimits(timeout_s=10.0, memory_mb=512, containment=containment)
    expected = f"64 {sum(sum(j * i for j in range(1000)) + 500 for i in range(64))}\n"
    grade = grade_code(fenced(THREADS), (CodeTest("64\n", expected),), limits=limits)
    assert grade.correct, grade.detail


@needs_namespaces
def test_the_thread_budget_is_64_threads_and_their_stacks_fit_the_memory() -> None:
    code = (
        "import threading, _thread\n"
        "stop = threading.Event()\n"
        "started = []\n"
        "try:\n"
        "    for _ in range(100):\n"
        "        t = threading.Thread(target=stop.wait); t.start(); started.append(t)\n"
        "except RuntimeError:\n"
        "    pass\n"
        "stop.set()\n"
        "for t in started:\n"
        "    t.join()\n"
        "print(len(started), _thread.stack_size())\n"
    )
    at_512 = run_python({"main.py": code}, "main.py", limits=LIMITS)
    assert (at_512.status, at_512.stdout) == ("ok", f"64 {4 << 20}\n"), at_512.stderr[-1000:]
    at_1024 = run_python({"main.py": code}, "main.py", limits=SandboxLimits(timeout_s=5.0, memory_mb=1024))
    assert (at_1024.status, at_1024.stdout) == ("ok", f"64 {8 << 20}\n"), at_1024.stderr[-1000:]  # glibc's usual


@needs_namespaces
def test_deep_recursion_in_the_main_thread_still_works() -> None:
    # The graders' header sets a 10**5 recursion limit; only threads' stacks changed, not the main one's.
    code = "def depth(n):\n    return 0 if n == 0 else depth(n - 1) + 1\nprint(depth(int(input())))"
    grade = grade_code(fenced(code), (CodeTest("50000\n", "50000\n"),), limits=LIMITS)
    assert grade.correct, grade.detail


@needs_namespaces
def test_io_uring_is_refused() -> None:
    code = (
        "import ctypes, json\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.syscall.restype = ctypes.c_long\n"
        "params = ctypes.create_string_buffer(120)  # struct io_uring_params\n"
        "out = {}\n"
        "for name, args in (('setup', (425, ctypes.c_uint(4), params)),\n"
        "                   ('enter', (426, -1, 0, 0, 0, None, ctypes.c_size_t(0))),\n"
        "                   ('register', (427, -1, 0, None, 0))):\n"
        "    ret = libc.syscall(ctypes.c_long(args[0]), *args[1:])\n"
        "    out[name] = (ret, ctypes.get_errno())\n"
        "print(json.dumps(out))\n"
    )
    result = run_python({"main.py": code}, "main.py", limits=LIMITS)
    assert result.status == "ok", result.stderr
    enosys = 38
    assert json.loads(result.stdout) == {name: [-1, enosys] for name in ("setup", "enter", "register")}


def test_reading_back_stdout_holds_no_more_than_its_size(tmp_path: Path) -> None:
    import tracemalloc

    stdout = tmp_path / "stdout"
    stdout.write_bytes(b"1\n" * (2 << 20))  # 4 MiB of short lines
    tracemalloc.start()
    try:
        text, limited = sandbox.runner._read_capped(stdout, 64 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (len(text), limited) == (4 << 20, False)
    # the bytes and the str once each (read(cap) had allocated the 64 MiB cap up front)
    assert peak < 9 << 20, f"reading 4 MiB of output held {peak} bytes at once"


def test_stderr_is_read_back_as_its_last_mib(tmp_path: Path) -> None:
    stderr = tmp_path / "stderr"
    stderr.write_bytes("é".encode() * (1 << 20) + b"x" + b"Traceback: the end\n")
    text, limited = sandbox.runner._read_tail(stderr, 64 << 20)
    assert not limited and text.endswith("x" + "Traceback: the end\n")
    assert len(text.encode()) <= 1 << 20 and "\ufffd" not in text  # cut between characters, not inside one
    stderr.write_bytes(b"short\n")
    assert sandbox.runner._read_tail(stderr, 6) == ("short\n", True)


@needs_namespaces
def test_millions_of_short_lines_come_back_whole_and_stderr_stays_small() -> None:
    code = (
        "import sys\n"
        "sys.stdout.write('1\\n' * 3_000_000)\n"
        "sys.stderr.write('debug\\n' * 3_000_000 + 'last line\\n')\n"
    )
    result = run_python({"main.py": code}, "main.py", limits=SandboxLimits(timeout_s=20.0, memory_mb=512))
    assert result.status == "ok", result.stderr[-500:]
    assert len(result.stdout) == 6_000_000 and result.stdout.count("\n") == 3_000_000
    assert len(result.stderr) <= 1 << 20 and result.stderr.endswith("debug\nlast line\n")

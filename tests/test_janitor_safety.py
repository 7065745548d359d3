"""The janitor under hostile or unlucky conditions: modules planted in the directory a job
starts from, a janitor that dies (names in /dev/shm that are not regular files:
test_cli_safety.py)."""

import os
import select
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import shmtensor
from shmtensor.ipc import posix_shm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(shmtensor.__file__)))
DEADLINE = 15.0  # seconds for a janitor to unlink what a killed program left


def _start(tmp_path, program: str, cwd) -> subprocess.Popen:
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(program))
    env = dict(os.environ, PYTHONPATH=ROOT)  # this tree's shmtensor, and no empty entry
    return subprocess.Popen([sys.executable, str(script)], cwd=cwd, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def _first_line(proc: subprocess.Popen, timeout: float = 60) -> list[str]:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    if not line:
        try:
            code = proc.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        raise AssertionError(f"the program printed nothing (exit status {code})")
    return line.split()


def _kill(proc: subprocess.Popen) -> int:
    proc.kill()
    code = proc.wait(30)
    proc.stdin.close()
    proc.stdout.close()
    return code


def _unlink_left_by(pid: int) -> None:
    """After a failure: remove what the program ``pid`` left (its names carry its pid)."""
    for name in os.listdir(posix_shm.SHM_DIR):
        if name.startswith(f"shmtensor_{pid}_"):
            posix_shm.unlink_named(name)


def _gone_by_deadline(names: list[str], pids: list[int]) -> None:
    """Every name leaves /dev/shm and every pid (janitors) exits, within DEADLINE."""
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        left = [n for n in names if os.path.exists(os.path.join(posix_shm.SHM_DIR, n))]
        alive = [p for p in pids if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not left and not alive:
            return
        time.sleep(0.05)
    for n in names:
        posix_shm.unlink_named(n)
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    raise AssertionError(f"after {DEADLINE}s, still in /dev/shm: {left}; still running: {alive}")


MAKE_ONE = """
import sys
import shmtensor, shmtensor.multiprocessing as smp
from shmtensor.ipc import janitor
smp.set_sharing_strategy("file_system")
a = shmtensor.zeros(1 << 18)  # 2 MiB: a named segment of its own
print(shmtensor._segments.segment_of(a).key, janitor.janitor_pid(), flush=True)
sys.stdin.readline()  # kept until the test kills it
"""


def test_modules_planted_in_the_working_directory_never_run_in_the_janitor(tmp_path):
    """A job started from a shared directory (/tmp) where someone planted resource.py, or
    any module the janitor imports, or a shmtensor package: none runs in the janitor."""
    cwd = tmp_path / "cwd"
    (cwd / "shmtensor").mkdir(parents=True)
    marker = tmp_path / "imported"
    plant = f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\n"
    names = {n for n in sys.stdlib_module_names if n.isidentifier()}
    for name in names | {"sitecustomize", "usercustomize"}:
        (cwd / f"{name}.py").write_text(plant)
    (cwd / "shmtensor" / "__init__.py").write_text(plant)
    proc = _start(tmp_path, MAKE_ONE, cwd)
    try:
        name, jpid = _first_line(proc)
    finally:
        assert _kill(proc) == -signal.SIGKILL
    try:
        _gone_by_deadline([name], [int(jpid)])  # the janitor still did its work
    finally:
        _unlink_left_by(proc.pid)
        assert not marker.exists(), f"planted modules ran: {marker.read_text().split()}"


RESTART = """
import signal, sys
import psutil
import shmtensor, shmtensor.multiprocessing as smp
from shmtensor.ipc import janitor
signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # as command-line tools do
smp.set_sharing_strategy("file_system")
def name(a): return shmtensor._segments.segment_of(a).key
before = [shmtensor.zeros(1 << 18) for _ in range(2)]  # 2 MiB each: a segment each
first = psutil.Process(janitor.janitor_pid())
first.kill()
first.wait(30)
after = [shmtensor.zeros(1 << 18) for _ in range(2)]
print(first.pid, janitor.janitor_pid(), *map(name, before + after), flush=True)
sys.stdin.readline()  # kept until the test kills it
"""


def test_a_dead_janitor_is_replaced_and_told_every_live_name(tmp_path):
    """The janitor is killed: the program (SIGPIPE at its default) lives on, a new janitor
    is started, and after the program is SIGKILLed it unlinks the segments made before the
    first one died as well as those made after."""
    proc = _start(tmp_path, RESTART, tmp_path)
    try:
        try:
            first, second, *names = _first_line(proc)
        finally:
            code = _kill(proc)
        assert code == -signal.SIGKILL, f"the program died first, exit status {code}"
        assert second != "None" and second != first
        assert len(set(names)) == 4
        _gone_by_deadline(names, [int(second)])
    finally:
        _unlink_left_by(proc.pid)

"""The ``shmtensor`` command: ls, clean, leak-check (exit codes and JSON schema)."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from shmtensor.ipc import posix_shm

CLI = [sys.executable, "-m", "shmtensor"]


def run(*args, timeout=60):
    return subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=timeout)


def test_help_teaches():
    out = run("--help").stdout
    assert "leak-check" in out and "clean" in out and "ls" in out
    lc = run("leak-check", "--help").stdout
    assert "exit status" in lc
    for code in ("97", "126", "127", "128+", "137"):
        assert code in lc, code


def test_leak_check_clean_command(tmp_path):
    script = tmp_path / "clean.py"
    script.write_text(textwrap.dedent("""
        import numpy as np, shmtensor, shmtensor.multiprocessing as mp
        if __name__ == "__main__":
            q = mp.get_context("spawn").Queue()
            q.put(np.ones(100_000)); q.get(); print("ok")
    """))
    r = run("leak-check", "--json", "--json-file", str(tmp_path / "report.json"), "--",
            sys.executable, str(script))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("ok\n")  # the command's own output first
    report = json.loads(r.stdout[r.stdout.index("{"):])
    assert set(report) >= {"segments", "processes", "command", "exit_code", "leaked"}
    assert report["leaked"] is False and report["exit_code"] == 0
    assert json.loads((tmp_path / "report.json").read_text()) == report  # apart from it


def test_leak_check_refuses_a_report_path_it_cannot_write_before_running(tmp_path):
    marker = tmp_path / "ran"
    r = run("leak-check", "--json-file", str(tmp_path / "no" / "such" / "dir.json"), "--",
            sys.executable, "-c", f"open({str(marker)!r}, 'w')")
    assert r.returncode == 2 and "--json-file" in r.stderr, r.stderr
    assert not marker.exists()
    report = tmp_path / "report.json"
    r = run("leak-check", "--json-file", str(report), "--", str(tmp_path / "no-such-command"))
    assert r.returncode == 127 and not report.exists()  # nothing ran: no (empty) report


def test_leak_check_reports_leaked_segment_and_process(tmp_path):
    script = tmp_path / "leaky.py"
    name = f"shmtensor_{{os.getpid()}}_abcdef_9"
    script.write_text(textwrap.dedent(f"""
        import os, subprocess, sys
        fd = os.open("/dev/shm/" + f"{name}", os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, 4096)
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                         start_new_session=True, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    """))
    r = run("leak-check", "--json", "--timeout", "0.5", "--", sys.executable, str(script))
    try:
        assert r.returncode == 97, r.stdout + r.stderr
        report = json.loads(r.stdout)
        assert report["leaked"] and report["segments"] and report["processes"]
        seg = report["segments"][0]
        assert seg["kind"] == "named" and seg["creator_alive"] is False
    finally:
        for p in json.loads(r.stdout).get("processes", []):
            try:
                os.kill(p["pid"], 9)
            except ProcessLookupError:
                pass
        for s in json.loads(r.stdout).get("segments", []):
            posix_shm.unlink_named(s["name"])


def test_leak_check_passes_through_the_commands_failure():
    r = run("leak-check", "--", sys.executable, "-c", "raise SystemExit(5)")
    assert r.returncode == 5


def test_ls_and_clean_never_touch_what_a_live_process_uses(tmp_path):
    import shmtensor
    import shmtensor.multiprocessing as smp
    prev = smp.get_sharing_strategy()
    smp.set_sharing_strategy("file_system")
    try:
        live = shmtensor.zeros(1000)  # named, mapped by this live process
        seg = shmtensor._segments.segment_of(live)
        dead = "shmtensor_999999_dead00_1"  # creator pid that cannot exist, unmapped
        fd = os.open(f"/dev/shm/{dead}", os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, 8192)
        os.close(fd)
        old = time.time() - 60  # clean leaves segments younger than a few seconds alone
        os.utime(f"/dev/shm/{dead}", (old, old))
        rows = json.loads(run("ls", "--json").stdout)["segments"]
        names = {r["name"]: r for r in rows}
        assert names[seg.key]["creator_alive"] and os.getpid() in names[seg.key]["mapped_by"]
        assert names[dead]["creator_alive"] is False and names[dead]["size"] == 8192
        dry = run("clean", "--dry-run").stdout
        assert dead in dry and seg.key not in dry
        assert os.path.exists(f"/dev/shm/{dead}")
        out = run("clean").stdout
        assert dead in out and "8.0 KiB" in out
        assert not os.path.exists(f"/dev/shm/{dead}")
        assert os.path.exists(f"/dev/shm/{seg.key}")
        del live
    finally:
        posix_shm.unlink_named("shmtensor_999999_dead00_1")
        smp.set_sharing_strategy(prev)
        shmtensor.empty_cache()


# A command that leaves three kinds of non-shmtensor files in /dev/shm: a stdlib
# SharedMemory kept by a detached child that is still running (so its creator is known),
# a POSIX semaphore (sem.*) and a plain file.
HOLDER = """
import sys, time
from multiprocessing import resource_tracker, shared_memory
resource_tracker.register = lambda *a: None  # keep it past exit, as track=False would
shm = shared_memory.SharedMemory(name=sys.argv[1] + "_psm", create=True, size=4096)
print("made", flush=True)
time.sleep(60)
"""
LEAVER = """
import _multiprocessing, subprocess, sys
tag = sys.argv[1]
holder = subprocess.Popen([sys.executable, "-c", sys.argv[2], tag], start_new_session=True,
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
assert holder.stdout.readline() == b"made\\n"
_multiprocessing.SemLock(1, 1, 1, "/" + tag, False)  # unlink=False: stays in /dev/shm
open(f"/dev/shm/{tag}_file", "w").close()
"""


def _kill_tagged(tag):
    """Kill the processes whose command line carries ``tag`` (the test's own children)."""
    import psutil
    for p in psutil.process_iter(["cmdline"]):
        if any(tag in part for part in p.info["cmdline"] or ()):
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


def test_leak_check_reports_any_file_left_in_dev_shm(tmp_path):
    tag = f"shmtensor-test-{os.urandom(4).hex()}"
    names = [f"{tag}_psm", f"sem.{tag}", f"{tag}_file"]
    try:
        r = run("leak-check", "--json", "--timeout", "0.5", "--",
                sys.executable, "-c", LEAVER, tag, HOLDER)
        report = json.loads(r.stdout)
        assert r.returncode == 97, r.stdout + r.stderr
        assert report["leaked"] and report["exit_code"] == 0
        files = {f["name"]: f for f in report["files"]}
        assert set(names) <= set(files), report["files"]
        holder = [p["pid"] for p in report["processes"]]  # the detached child, still running
        assert len(holder) == 1, report["processes"]
        assert files[f"{tag}_psm"]["creator_pid"] == holder[0]  # seen holding it
        assert files[f"{tag}_psm"]["size"] == 4096
        assert files[f"sem.{tag}"]["kind"] == "semaphore"
        unknown = files[f"{tag}_file"]  # made and closed at once: maybe seen, maybe not
        assert unknown["creator"] == "unknown" or unknown["creator_pid"] is not None
    finally:
        _kill_tagged(tag)
        for name in names:
            posix_shm.unlink_named(name)


def test_leak_check_text_report_names_the_file():
    tag = f"shmtensor-test-{os.urandom(4).hex()}"
    try:
        r = run("leak-check", "--timeout", "0", "--", sys.executable, "-c",
                f"open('/dev/shm/{tag}', 'w').close()")
        assert r.returncode == 97, r.stdout + r.stderr
        assert f"{tag} " in r.stdout and "LEAKED (command exited 0)" in r.stdout
    finally:
        posix_shm.unlink_named(tag)


def test_leak_check_ignores_files_of_processes_outside_the_tree():
    """A file another process makes (and holds) while the command runs is not the command's."""
    tag = f"shmtensor-test-{os.urandom(4).hex()}"
    proc = subprocess.Popen(
        CLI + ["leak-check", "--json", "--timeout", "0", "--", sys.executable, "-c",
               "import sys; print('started', flush=True); sys.stdin.readline()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    fd = None
    try:
        assert proc.stdout.readline() == "started\n"  # after leak-check's first look
        fd = os.open(f"/dev/shm/{tag}", os.O_CREAT | os.O_RDWR, 0o600)
        out, _ = proc.communicate("\n", timeout=60)
        assert proc.returncode == 0, out
        assert json.loads(out)["files"] == []
    finally:
        proc.kill()
        proc.wait(10)
        if fd is not None:
            os.close(fd)
        posix_shm.unlink_named(tag)


def test_leak_check_command_not_found_is_one_line_and_127():
    r = run("leak-check", "--", "/nonexistent/command")
    assert r.returncode == 127
    assert r.stdout == "" and len(r.stderr.splitlines()) == 1
    assert "/nonexistent/command" in r.stderr and "not found" in r.stderr


def test_leak_check_command_not_executable_is_one_line_and_126(tmp_path):
    script = tmp_path / "script.sh"
    script.write_text("#!/bin/sh\n")  # mode 0644: found, not executable
    for cmd in (str(script), str(tmp_path)):
        r = run("leak-check", "--", cmd)
        assert r.returncode == 126, r.stderr
        assert r.stdout == "" and len(r.stderr.splitlines()) == 1 and cmd in r.stderr


def test_leak_check_usage_errors_are_one_line():
    for args in (["leak-check"], ["leak-check", "--timeout", "-1", "--", "true"]):
        r = run(*args)
        assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr


def test_leak_check_killed_command_exits_128_plus_signal():
    r = run("leak-check", "--json", "--", sys.executable, "-c",
            "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert r.returncode == 137, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["exit_code"] == 137 and report["signal"] == 9 and not report["leaked"]
    r = run("leak-check", "--", sys.executable, "-c",
            "import os, signal; os.kill(os.getpid(), signal.SIGTERM)")
    assert r.returncode == 128 + 15 and "SIGTERM" in r.stdout


@pytest.mark.parametrize("args", [["leak-check", "--json", "--", sys.executable, "-c", "pass"],
                                  ["leak-check", "--", sys.executable, "-c", "pass"],
                                  ["ls", "--json"], ["ls"]])
def test_closed_stdout_is_no_traceback(args):
    """``shmtensor ... | head -c 10``: the reader goes away before the output is written."""
    proc = subprocess.Popen(CLI + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # nobody reads: every write gets EPIPE
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(60) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_json_through_head_in_a_shell():
    cmd = " ".join(CLI + ["leak-check", "--json", "--", sys.executable, "-c", "pass"])
    r = subprocess.run(f"set -o pipefail; {cmd} | head -c 10", shell=True, executable="/bin/bash",
                       capture_output=True, text=True, timeout=60)
    assert r.stdout == '{\n  "segme' and r.stderr == "", r.stderr


def test_leak_check_reports_the_cuda_drivers_files_apart():
    """The CUDA driver leaves /dev/shm/cuda.shm.* for each process that made an
    interprocess event: listed, not counted against the command."""
    name = f"cuda.shm.0.{os.urandom(3).hex()}.1"
    try:
        r = run("leak-check", "--json", "--timeout", "0", "--", sys.executable, "-c",
                f"open('/dev/shm/{name}', 'w').close()")
        assert r.returncode == 0, r.stdout + r.stderr
        report = json.loads(r.stdout)
        assert not report["leaked"] and report["files"] == []
        assert [f["name"] for f in report["not_counted"]] == [name]
        assert "CUDA driver" in report["not_counted"][0]["why"]
    finally:
        posix_shm.unlink_named(name)

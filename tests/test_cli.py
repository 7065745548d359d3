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
    assert "97" in lc and "exit" in lc.lower()


def test_leak_check_clean_command(tmp_path):
    script = tmp_path / "clean.py"
    script.write_text(textwrap.dedent("""
        import numpy as np, shmtensor, shmtensor.multiprocessing as mp
        if __name__ == "__main__":
            q = mp.get_context("spawn").Queue()
            q.put(np.ones(100_000)); q.get(); print("ok")
    """))
    r = run("leak-check", "--json", "--", sys.executable, str(script))
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout[r.stdout.index("{"):])
    assert set(report) >= {"segments", "processes", "command", "exit_code", "leaked"}
    assert report["leaked"] is False and report["exit_code"] == 0


def test_leak_check_reports_leaked_segment_and_process(tmp_path):
    script = tmp_path / "leaky.py"
    name = f"shmtensor_{{os.getpid()}}_abcdef_9"
    script.write_text(textwrap.dedent(f"""
        import os, subprocess, sys
        fd = os.open("/dev/shm/" + f"{name}", os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, 4096)
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                         start_new_session=True)
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
        assert dead in out and "8.0 KB" in out
        assert not os.path.exists(f"/dev/shm/{dead}")
        assert os.path.exists(f"/dev/shm/{seg.key}")
        del live
    finally:
        posix_shm.unlink_named("shmtensor_999999_dead00_1")
        smp.set_sharing_strategy(prev)
        shmtensor.empty_cache()

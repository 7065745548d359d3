"""Attaching a segment named by a message: a forged size or key is an error, never a SIGBUS
or another file mapped read-write (issue 26, item 3)."""

import os
import subprocess
import sys
import textwrap

import pytest

from shmtensor import _segments
from shmtensor.ipc import ofd_lease, posix_shm

TIMEOUT = 60  # seconds: only reached when something hangs


def _run(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter: a SIGBUS there fails the test instead of killing it."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=TIMEOUT)


def _open_fds() -> set[int]:
    ofd_lease.own_table()  # made once per process: not a leak
    return set(map(int, os.listdir("/proc/self/fd")))


def test_a_size_past_the_end_of_the_memfd_is_an_error_not_a_sigbus():
    r = _run("""
        import os, pickle
        from shmtensor import _reductions, _segments
        from shmtensor.ipc import ofd_lease
        table = ofd_lease.own_table()
        key = "shmtensor_1_abcdef_7"

        def forged(size, offset=0):
            seg = os.memfd_create(key)
            os.ftruncate(seg, 4096)
            return seg, os.memfd_create("lease")

        before = set(os.listdir("/proc/self/fd"))
        for size, k in ((1 << 20, key), (4096, key + "@4096"), (4096, key + "@-4096"),
                        (4096, key + "@1")):
            fds = list(forged(size))
            fields = (k, _segments.FD, size, table.id, 99, 0, (size,), None, "|u1", False)
            data = _reductions.NUMPY_LANE + pickle.dumps(fields)
            try:
                a = _reductions._numpy_lane_loads(data, fds)
                print("mapped", a.nbytes, flush=True)
                a[-1]  # past the end of the file: SIGBUS
            except ValueError as e:
                assert "not mapped" in str(e) or "offset" in str(e), e
            assert all(f == -1 or not os.path.exists(f"/proc/self/fd/{f}") for f in fds)
            assert k not in _segments._by_key
        # the segment level: a refused message keeps its fds in its list, the caller's
        fds = list(forged(1 << 20))
        try:
            _segments.receive(key, _segments.FD, 1 << 20, table.id, 99, fds, fds)
        except ValueError:
            pass
        assert -1 not in fds  # nothing taken
        [os.fstat(f) for f in fds]  # not closed behind the caller's back
        [os.close(f) for f in fds]
        assert set(os.listdir("/proc/self/fd")) == before, "fds leaked"
        print("ok")
    """)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stdout, r.stderr)


@pytest.fixture
def shm_names():
    made = []
    yield made
    for name in made:
        try:
            os.unlink(os.path.join(posix_shm.SHM_DIR, name))
        except FileNotFoundError:
            pass


def _attach(key: str, size: int = 4096):
    table = ofd_lease.own_table()
    lease = os.memfd_create("lease")
    try:
        return _segments.receive(key, _segments.FS, size, table.id, 99, None, lease)
    finally:
        os.close(lease)


def test_a_named_key_is_a_name_never_a_path(tmp_path, shm_names):
    victim = tmp_path / "victim"
    victim.write_bytes(b"secret" * 1000)
    fds = _open_fds()
    rel = os.path.relpath(victim, posix_shm.SHM_DIR)
    for key in (rel, "../" + victim.name, str(victim), f"shmtensor_1_abcdef_1/../../{rel}",
                "shmtensor_1_abcdef_1\0", ""):
        with pytest.raises(ValueError, match="not a shmtensor segment name"):
            _attach(key)
        assert key not in _segments._by_key
    assert victim.read_bytes() == b"secret" * 1000
    assert _open_fds() == fds


def test_a_named_segment_that_is_a_symlink_or_fifo_is_not_opened(tmp_path, shm_names):
    victim = tmp_path / "victim"
    victim.write_bytes(b"x" * 4096)
    link, fifo = "shmtensor_1_abcdef_101", "shmtensor_1_abcdef_102"
    shm_names += [link, fifo]
    os.symlink(victim, os.path.join(posix_shm.SHM_DIR, link))
    os.mkfifo(os.path.join(posix_shm.SHM_DIR, fifo), 0o600)
    fds = _open_fds()
    with pytest.raises(OSError, match="symbolic link"):
        _attach(link)
    with pytest.raises(OSError, match="not a regular file"):
        _attach(fifo)
    assert link not in _segments._by_key and fifo not in _segments._by_key
    assert _open_fds() == fds


def test_a_named_segment_smaller_than_the_message_says_is_not_mapped(shm_names):
    name = "shmtensor_1_abcdef_103"
    shm_names.append(name)
    fd = os.open(os.path.join(posix_shm.SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL,
                 0o600)
    os.ftruncate(fd, 4096)
    os.close(fd)
    fds = _open_fds()
    with pytest.raises(ValueError, match="its file holds 4096"):
        _attach(name, 1 << 20)
    assert _open_fds() == fds and name not in _segments._by_key

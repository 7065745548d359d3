"""Frames of bytes and fds over a Unix socket (ipc.scm_rights): every header form, in order."""

from __future__ import annotations

import os
import socket
import struct
import tempfile
import threading

import pytest

from shmtensor.ipc import scm_rights


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield a, b
    a.close()
    b.close()


def _files(n: int) -> list[int]:
    fds = []
    for _ in range(n):
        fd, path = tempfile.mkstemp()
        os.unlink(path)
        fds.append(fd)
    return fds


def _send_in_thread(sock, frames) -> threading.Thread:
    th = threading.Thread(target=lambda: [scm_rights.send_frame(sock, d, f) for d, f in frames])
    th.start()
    return th


def _same_file(a: int, b: int) -> bool:
    sa, sb = os.fstat(a), os.fstat(b)
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


@pytest.mark.parametrize("spin", [None, 0.05], ids=["sleeps", "spins"])
def test_every_header_form_in_one_stream(pair, spin):
    a, b = pair
    wait = None if spin is None else scm_rights.SpinWait(spin)
    sent = _files(300)
    compact_max = scm_rights._COMPACT_MAX
    frames = [
        (b"no fds", []),
        (b"", sent[:1]),                                   # compact, empty payload
        (b"x" * 100, sent[:2]),                            # compact
        (bytes(compact_max), sent[2:3]),                   # compact, largest payload
        (bytes(compact_max + 1), sent[3:4]),               # -2 header: payload too long
        (b"many", sent),                                   # -2 header: more than 253 fds
        (b"last", []),
    ]
    th = _send_in_thread(a, frames)
    try:
        for data, fds in frames:
            got, got_fds = scm_rights.recv_frame(b, wait)
            try:
                assert bytes(got) == data
                assert len(got_fds) == len(fds)
                assert all(_same_file(x, y) for x, y in zip(fds, got_fds))
            finally:
                for fd in got_fds:
                    os.close(fd)
    finally:
        th.join(30)
        for fd in sent:
            os.close(fd)


def test_compact_header_is_one_int(pair):
    a, b = pair
    (fd,) = _files(1)
    try:
        scm_rights.send_frame(a, b"abc", [fd])
        raw, anc, _, _ = b.recvmsg(64, socket.CMSG_SPACE(4))
        (code,) = struct.unpack("!i", raw[:4])
        assert code == -3 - (3 << 8 | 1) and raw[4:] == b"abc"
        for _, _, payload in anc:
            for got in struct.unpack(f"{len(payload) // 4}i", payload):
                os.close(got)
    finally:
        os.close(fd)


def test_a_header_that_says_fds_but_none_is_refused(pair):
    a, b = pair
    a.sendall(struct.pack("!i", -3 - (5 << 8)) + b"12345")  # "five bytes, zero fds"
    with pytest.raises(OSError, match="does not speak this protocol"):
        scm_rights.recv_frame(b)


def test_try_send_frame_uses_the_same_headers(pair):
    a, b = pair
    (fd,) = _files(1)
    try:
        assert scm_rights.try_send_frame(a, b"quick", [fd])
        got, got_fds = scm_rights.recv_frame(b)
        assert bytes(got) == b"quick" and len(got_fds) == 1 and _same_file(fd, got_fds[0])
        os.close(got_fds[0])
    finally:
        os.close(fd)


def test_a_message_of_an_unknown_kind_is_refused_and_its_fds_closed():
    import pickle

    from shmtensor import _reductions
    fds = [os.open("/dev/null", os.O_RDONLY), os.open("/dev/null", os.O_RDONLY)]
    with pytest.raises(pickle.UnpicklingError, match="another shmtensor version"):
        _reductions.loads(b"\0Z" + pickle.dumps(1), fds)
    assert not [fd for fd in fds if os.path.exists(f"/proc/self/fd/{fd}")]


def test_a_small_frame_with_fds_that_arrives_in_pieces():
    # A sender whose socket buffer is smaller than the frame sends it in several pieces;
    # the receiver's first read of the payload gets only part of it.
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    fds = _files(2)
    payload = bytes(range(256)) * 240  # 61,440 bytes: under the one-read limit
    try:
        th = _send_in_thread(a, [(payload, fds)])
        got, got_fds = scm_rights.recv_frame(b)
        th.join(10)
        assert got == payload
        assert len(got_fds) == 2 and all(_same_file(x, y) for x, y in zip(got_fds, fds))
        scm_rights.close_fds(got_fds)
    finally:
        scm_rights.close_fds(fds)
        a.close()
        b.close()


def test_a_spinning_reader_catches_a_frame_sent_while_it_polls(pair):
    a, b = pair
    wait = scm_rights.SpinWait(30.0)  # a budget no test waits out: the poll must catch it
    (fd,) = _files(1)
    polling = threading.Event()
    real = b.recvmsg

    class Watched:  # a socket whose first poll that finds nothing says so
        def recvmsg(self, *args):
            try:
                return real(*args)
            except BlockingIOError:
                polling.set()
                raise

    def send():  # sends even if no poll came (then the test fails, not hangs)
        polling.wait(10)
        scm_rights.send_frame(a, b"caught", [fd])

    th = threading.Thread(target=send)
    th.start()
    try:
        got = []
        wait.read_into(Watched(), got)
        head = got[0]
        th.join(30)
        assert not th.is_alive() and polling.is_set()
        assert head[0] == struct.pack("!i", -3 - (6 << 8 | 1)) and len(head[1]) == 1
        assert wait.hot  # caught within the budget: it polls again next time
        rest = b.recv(64)
        assert rest == b"caught"
        scm_rights.close_fds(struct.unpack("i", head[1][0][2]))
    finally:
        os.close(fd)


def test_a_reader_that_waited_past_its_budget_sleeps_next_time_then_learns_again(pair):
    a, b = pair
    wait = scm_rights.SpinWait(0.0005)
    sent = threading.Event()

    def later():
        sent.wait(30)
        scm_rights.send_frame(a, b"late")

    th = threading.Thread(target=later)
    th.start()
    timer = threading.Timer(0.05, sent.set)  # well past the budget: the reader must sleep
    timer.start()
    try:
        got, fds = scm_rights.recv_frame(b, wait)
    finally:
        th.join(30)
        timer.join(30)
    assert bytes(got) == b"late" and fds == [] and not wait.hot
    scm_rights.send_frame(a, b"ready")  # there before the read: a short wait
    got, _ = scm_rights.recv_frame(b, wait)
    assert bytes(got) == b"ready" and wait.hot


def test_a_spinning_reader_sees_the_end_of_the_stream(pair):
    a, b = pair
    wait = scm_rights.SpinWait(0.05)
    scm_rights.send_frame(a, b"last")
    a.shutdown(socket.SHUT_WR)
    assert bytes(scm_rights.recv_frame(b, wait)[0]) == b"last"
    with pytest.raises(EOFError):
        scm_rights.recv_frame(b, wait)

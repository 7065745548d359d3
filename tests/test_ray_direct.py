"""shmtensor.ray's direct path (an agent's TCP listener) against malformed and hostile peers.

No Ray: a ``_direct.Server`` on 127.0.0.1 in this process, whose ``read`` hands out test
arrays; peers are raw sockets, ``_direct.receive``, and a fake agent in a child process.
"""

from __future__ import annotations

import gc
import os
import pickle
import signal
import socket
import threading
import time
import weakref

import numpy as np
import pytest

from shmtensor.ray import _direct, _host

pytestmark = pytest.mark.timeout(60)


class Arrays:
    """The server's ``read``: handle ``("n", k)`` is ``arange(k)``; ``("gone", _)`` the
    sender's error; anything else a failure of the read itself."""

    def __init__(self) -> None:
        self.served: list[weakref.ref[np.ndarray]] = []

    def __call__(self, handle: tuple[str, int]) -> np.ndarray:
        kind, k = handle
        if kind == "gone":
            raise _host.SenderGone("process 1234 has exited")
        if kind != "n":
            raise ValueError(f"no such array {handle!r}")
        a = np.arange(k, dtype=np.float64)
        self.served.append(weakref.ref(a))
        return a


@pytest.fixture
def server():
    s = _direct.Server("127.0.0.1", Arrays())
    try:
        yield s
    finally:
        s.close()
        assert not s._listener.is_alive(), "the listener thread outlived close()"


def fetch(ep: _direct.Endpoint, k: int) -> np.ndarray:
    out = np.empty(k)
    _direct.receive(ep, ("n", k), out)
    return out


def peer(ep: _direct.Endpoint, data: bytes, close: bool = True) -> bytes:
    """Send ``data`` as a raw peer; what the server answers until it closes (b"": none)."""
    with socket.create_connection((ep.ip, ep.port), timeout=10) as c:
        got = b""
        try:
            c.sendall(data)
            if close:
                c.shutdown(socket.SHUT_WR)
        except OSError:  # closed before all was sent (a pipe broken, a reset, ENOTCONN)
            return got
        while True:
            try:
                chunk = c.recv(65536)
            except ConnectionResetError:  # closed with our bytes unread
                return got
            if not chunk:
                return got
            got += chunk


def request(token: bytes, handle: object) -> bytes:
    body = pickle.dumps(handle)
    return token + _direct.REQUEST.pack(len(body)) + body


def test_a_request_gets_the_bytes(server):
    assert (fetch(server.endpoint, 100_000) == np.arange(100_000)).all()
    assert fetch(server.endpoint, 0).shape == (0,)  # 0 bytes: a header, nothing after


def test_malformed_requests_get_no_answer_and_the_agent_serves_on(server):
    ep = server.endpoint
    wrong = bytes(_direct.TOKEN_BYTES)
    assert peer(ep, request(wrong, ("n", 10))) == b""                # wrong token
    assert peer(ep, ep.token[:5]) == b""                             # token cut short
    assert peer(ep, ep.token + b"\x00\x00") == b""                   # length cut short
    assert peer(ep, request(ep.token, ("n", 10))[:-3]) == b""        # handle cut short
    assert peer(ep, ep.token + _direct.REQUEST.pack(0)) == b""       # empty handle
    assert peer(ep, ep.token + _direct.REQUEST.pack(10) + b"not a pickle") == b""
    # a huge length is refused before anything is read or allocated for it
    assert peer(ep, ep.token + _direct.REQUEST.pack(0xFFFFFFFF) + b"x" * 1000) == b""
    assert peer(ep, wrong + _direct.REQUEST.pack(0xFFFFFFFF)) == b""
    assert (fetch(ep, 1000) == np.arange(1000)).all()


def test_errors_of_the_read_are_answered(server):
    with pytest.raises(_direct.Refused) as e:
        _direct.receive(server.endpoint, ("gone", 0), np.empty(0))
    assert isinstance(e.value.error, _host.SenderGone) and "1234" in str(e.value.error)
    with pytest.raises(_direct.Refused, match="could not read the array: ValueError"):
        _direct.receive(server.endpoint, ("what", 0), np.empty(0))
    with pytest.raises(_direct.Unreachable, match="sends 80 bytes for an array of 8"):
        _direct.receive(server.endpoint, ("n", 10), np.empty(1))


def test_silent_peers_cannot_hold_the_agent(server, monkeypatch):
    """More silent connections than the agent serves at once: each is dropped after
    REQUEST_S, and a receiver behind them is served."""
    monkeypatch.setattr(_direct, "REQUEST_S", 0.3)
    ep = server.endpoint
    silent = [socket.create_connection((ep.ip, ep.port), timeout=10)
              for _ in range(_direct.MAX_CONNECTIONS + 4)]
    try:
        assert (fetch(ep, 1000) == np.arange(1000)).all()
        for c in silent:
            assert c.recv(1) == b""  # dropped, unanswered
    finally:
        for c in silent:
            c.close()


def test_many_concurrent_receivers(server):
    n = 3 * _direct.MAX_CONNECTIONS
    errors: list[BaseException] = []

    def one(k: int) -> None:
        try:
            assert (fetch(server.endpoint, k) == np.arange(k)).all()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=one, args=(20_000 + i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=50)
    assert not any(t.is_alive() for t in threads)
    assert errors == []


def test_a_receiver_that_goes_away_mid_transfer_frees_the_agents_view(server):
    ep = server.endpoint
    k = 8 << 20  # 64 MiB: far more than the socket buffers hold
    with socket.create_connection((ep.ip, ep.port), timeout=10) as c:
        c.sendall(request(ep.token, ("n", k)))
        status, n = _direct.ANSWER.unpack(c.recv(_direct.ANSWER.size, socket.MSG_WAITALL))
        assert (status, n) == (0, 8 * k)
        c.recv(1 << 16)
    deadline = time.monotonic() + 20  # the send fails, the thread ends, the array goes
    while server.read.served[-1]() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert server.read.served[-1]() is None
    assert (fetch(ep, 1000) == np.arange(1000)).all()


def test_an_agent_killed_mid_transfer_is_unreachable():
    """A fake agent (a child process) answers 1 MiB, sends half and is killed: the
    receiver raises Unreachable (its node then decides: lost, or another agent)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    token = os.urandom(_direct.TOKEN_BYTES)
    pid = os.fork()
    if pid == 0:  # the fake agent
        try:
            conn, _ = listener.accept()
            conn.recv(65536)
            conn.sendall(_direct.ANSWER.pack(0, 1 << 20) + bytes(1 << 19))
            os.kill(os.getpid(), signal.SIGKILL)
        finally:
            os._exit(1)
    listener.close()
    try:
        ep = _direct.Endpoint("127.0.0.1", port, token)
        out = np.empty(1 << 17)
        with pytest.raises(_direct.Unreachable, match="closed the connection after"):
            _direct.receive(ep, ("n", 1 << 17), out)
    finally:
        _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


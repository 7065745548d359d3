"""A two-host Ray cluster on one machine, for tests and benchmarks.

Each "host" is a set of namespaces of its own: a network namespace (the two joined by a
veth pair, 10.200.0.1 and 10.200.0.2), a mount namespace with private tmpfs on /dev/shm and
/tmp/ray, a UTS namespace (its own hostname) and a pid namespace whose pid 1 is a small reaper
(:data:`INIT`).  The Ray head runs in host A, a worker node in host B; drivers run in
host A through ``nsenter`` and answer in JSON on stdout.  Only addresses inside the
namespaces are used.

Needs root, ``ip``, ``unshare`` and ``nsenter`` (:func:`unavailable` says what is missing).
Teardown kills each host's pid 1, which takes every process of the host with it (the
kernel kills a pid namespace's processes when its init dies) and with them the private
tmpfs mounts; then the network namespaces go, and the veth pair with them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

HEAD_IP, WORKER_IP = "10.200.0.1", "10.200.0.2"
PORT = 6379

# pid 1 of a host: mounts its private /dev/shm and /tmp/ray (Ray's sessions and sockets;
# the rest of /tmp stays shared, so a checkout or venv under /tmp runs there too), names the
# host, says "up", then reaps whatever is orphaned to it (Ray's daemons) until killed.
INIT = r"""
import os, signal, socket, subprocess, sys
host = sys.argv[1]
os.makedirs("/tmp/ray", exist_ok=True)
for where, size in (("/dev/shm", "1g"), ("/tmp/ray", "1g")):
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777", "tmpfs", where],
                   check=True)
socket.sethostname(host)
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])
print("up", flush=True)
while True:
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass
    signal.sigtimedwait([signal.SIGCHLD], 1.0)
"""


def unavailable() -> str | None:
    """Why the cluster cannot be built here, or None."""
    if not sys.platform.startswith("linux"):
        return "needs Linux namespaces"
    if os.geteuid() != 0:
        return "needs root (network, mount and pid namespaces, a veth pair)"
    for tool in ("ip", "unshare", "nsenter", "mount"):
        if shutil.which(tool) is None:
            return f"needs {tool!r} on PATH"
    return None


def _run(*cmd: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=check)


class Host:
    """One namespace "host": its pid 1 (outside view) and how to run commands in it."""

    def __init__(self, name: str, netns: str) -> None:
        self.name, self.netns = name, netns
        self.init: subprocess.Popen[str] | None = None
        self._pid1: int | None = None
        self.pidns = ""  # the pid namespace, as /proc/PID/ns/pid reads

    def start(self) -> None:
        self.init = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{self.netns}", "--",
             "unshare", "--mount", "--uts", "--pid", "--fork", "--mount-proc",
             "--kill-child", sys.executable, "-c", INIT, self.name],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, start_new_session=True)
        line = self.init.stdout.readline() if self.init.stdout else ""
        if line.strip() != "up":
            self.kill()
            raise RuntimeError(f"host {self.name} did not start: {line!r}")
        self.pidns = os.readlink(f"/proc/{self.pid1}/ns/pid")

    def processes(self) -> list[int]:
        """The pids (outside view) of the processes in this host's pid namespace."""
        if not self.pidns:
            return []
        out = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if os.readlink(f"/proc/{entry}/ns/pid") == self.pidns:
                        out.append(int(entry))
                except OSError:
                    pass
        return out

    @property
    def pid1(self) -> int:
        """The outside pid of the host's pid 1 (the reaper: unshare's child; nsenter
        became unshare)."""
        if self._pid1 is None:
            assert self.init is not None
            pid = self.init.pid
            self._pid1 = int(open(f"/proc/{pid}/task/{pid}/children").read().split()[0])
        return self._pid1

    def argv(self, cmd: Sequence[str]) -> list[str]:
        return ["nsenter", "-t", str(self.pid1), "--net", "--mount", "--uts", "--pid",
                f"--wd={os.getcwd()}", "--", *cmd]

    def run(self, cmd: Sequence[str], timeout: float = 60, env: dict[str, str] | None = None,
            stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(cmd), capture_output=True, text=True, timeout=timeout,
                              env=env, input=stdin)

    def popen(self, cmd: Sequence[str], env: dict[str, str] | None = None
              ) -> subprocess.Popen[str]:
        return subprocess.Popen(self.argv(cmd), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)

    def kill(self) -> None:
        """Power off: every process of the host dies with its pid 1."""
        if self.init is None:
            return
        try:
            pid1 = self.pid1
            if os.readlink(f"/proc/{pid1}/ns/pid") == self.pidns:  # not a recycled pid
                os.kill(pid1, signal.SIGKILL)
        except (OSError, IndexError, ValueError):
            pass
        try:
            os.killpg(self.init.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            self.init.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        for f in (self.init.stdout, self.init.stderr):
            if f is not None:
                f.close()
        self.init = self._pid1 = None
        deadline = time.monotonic() + 30  # the kernel kills the rest of the namespace
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.processes():
            raise RuntimeError(f"host {self.name}: {self.processes()} outlived its pid 1")

    @property
    def alive(self) -> bool:
        return self.init is not None and self.init.poll() is None


def ray_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of Ray daemons and drivers in the hosts: this one's, less what
    would make both hosts one (``SHMTENSOR_RAY_HOST``) or reach outside (``RAY_ADDRESS``),
    plus quick node-death detection."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("SHMTENSOR_RAY_HOST", "RAY_ADDRESS") and not k.startswith("PYTEST")}
    env.update({
        # a dead node is declared dead after ~3 s rather than ~15 s
        "RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "4",
        "RAY_health_check_initial_delay_ms": "1000", "RAY_health_check_timeout_ms": "1000",
        # the host's private /tmp/ray: nothing of this machine's ~/.ray (an auth token)
        # applies
        "HOME": "/tmp/ray", "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0", "RAY_DISABLE_IMPORT_WARNING": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (_repo(), env.get("PYTHONPATH")) if p),
    })
    env.update(extra or {})
    return env


def _repo() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class TwoHosts:
    """Two namespace hosts and a Ray cluster across them (head in A, a node in B)."""

    def __init__(self, cpus: int = 1, store_mb: int = 200, tag: str | None = None) -> None:
        tag = tag or f"{os.getpid() % 100000}"
        self.netns = (f"stray-a-{tag}", f"stray-b-{tag}")
        self.links = (f"stra{tag}", f"strb{tag}")
        self.cpus, self.store = cpus, store_mb << 20
        self.a = Host(f"host-a-{tag}", self.netns[0])
        self.b = Host(f"host-b-{tag}", self.netns[1])
        self.address = f"{HEAD_IP}:{PORT}"
        self._ray: dict[str, subprocess.Popen[str]] = {}

    # --- the network ---------------------------------------------------------------------
    def _net_up(self) -> None:
        na, nb = self.netns
        la, lb = self.links
        _run("ip", "netns", "add", na)
        _run("ip", "netns", "add", nb)
        _run("ip", "link", "add", la, "type", "veth", "peer", "name", lb)
        _run("ip", "link", "set", la, "netns", na)
        _run("ip", "link", "set", lb, "netns", nb)
        for ns, link, ip in ((na, la, HEAD_IP), (nb, lb, WORKER_IP)):
            _run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", link)
            _run("ip", "-n", ns, "link", "set", link, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")

    def _net_down(self) -> None:
        for ns in self.netns:  # the veth pair goes with its namespaces
            _run("ip", "netns", "delete", ns, check=False)
        for link in self.links:
            _run("ip", "link", "delete", link, check=False)

    # --- Ray -------------------------------------------------------------------------------
    def _ray_start(self, host: Host, args: list[str], timeout: float = 90) -> None:
        """``ray start ... --block`` in ``host``, waited for until Ray says it started."""
        ray = os.path.join(os.path.dirname(sys.executable), "ray")
        p = host.popen([ray, "start", "--block", "--disable-usage-stats",
                        f"--num-cpus={self.cpus}", f"--object-store-memory={self.store}",
                        *args], env=ray_env())
        self._ray[host.name] = p
        deadline = time.monotonic() + timeout
        out: list[str] = []
        assert p.stdout is not None
        while time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            out.append(line)
            if "Ray runtime started" in line:
                return
        raise RuntimeError(f"ray start in {host.name} failed:\n{''.join(out[-30:])}"
                           f"{p.stderr.read() if p.poll() is not None and p.stderr else ''}")

    def start(self) -> TwoHosts:
        try:
            self._net_up()
            self.a.start()
            self.b.start()
            self._ray_start(self.a, ["--head", f"--node-ip-address={HEAD_IP}",
                                     f"--port={PORT}", "--include-dashboard=false",
                                     "--resources={\"host_a\": 100}"])
            self._ray_start(self.b, [f"--address={self.address}",
                                     f"--node-ip-address={WORKER_IP}",
                                     "--resources={\"host_b\": 100}"])
            self.wait_nodes(2)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_nodes(self, count: int, timeout: float = 60) -> None:
        code = ("import ray,time,sys\nray.init(address='auto', log_to_driver=False)\n"
                f"d=time.monotonic()+{timeout}\n"
                f"while sum(n['Alive'] for n in ray.nodes())<{count} and time.monotonic()<d:"
                " time.sleep(0.2)\n"
                f"sys.exit(0 if sum(n['Alive'] for n in ray.nodes())>={count} else 1)")
        r = self.a.run([sys.executable, "-c", code], timeout=timeout + 30,
                       env=ray_env({"RAY_ADDRESS": self.address}))
        if r.returncode:
            raise RuntimeError(f"the cluster has fewer than {count} nodes:\n{r.stderr[-3000:]}")

    def kill_worker_host(self) -> None:
        """Host B dies at once: every process of it, its /dev/shm."""
        self.b.kill()
        p = self._ray.pop(self.b.name, None)
        if p is not None:
            _reap(p)

    def stop(self) -> None:
        try:
            for host in (self.b, self.a):
                host.kill()
        finally:
            for p in self._ray.values():
                _reap(p)
            self._ray.clear()
            self._net_down()

    def leftovers(self) -> list[str]:
        """What of the cluster is left on this machine (after :meth:`stop`: nothing)."""
        left = [f"netns {ns}" for ns in self.netns if os.path.exists(f"/run/netns/{ns}")]
        left += [f"link {link}" for link in self.links
                 if os.path.exists(f"/sys/class/net/{link}")]
        left += [f"process {pid} of {h.name}" for h in (self.a, self.b) for pid in h.processes()]
        return left

    def shm(self, host: Host, prefix: str) -> list[str]:
        """The names in ``host``'s /dev/shm that start with ``prefix``."""
        r = host.run(["ls", "/dev/shm"], timeout=30)
        return sorted(n for n in r.stdout.split() if n.startswith(prefix))

    # --- drivers ---------------------------------------------------------------------------
    def driver(self, script: str, *args: str, timeout: float = 120,
               host: Host | None = None) -> Any:
        """Run ``script`` (a path) in host A (or ``host``) as a Ray driver; its last stdout
        line, parsed as JSON."""
        r = (host or self.a).run([sys.executable, script, *args], timeout=timeout,
                                 env=ray_env({"RAY_ADDRESS": self.address}))
        if r.returncode:
            raise RuntimeError(f"driver {script} {args} exited {r.returncode}:\n"
                               f"{r.stdout[-3000:]}\n{r.stderr[-6000:]}")
        return json.loads(r.stdout.strip().splitlines()[-1])

    def driver_popen(self, script: str, *args: str) -> subprocess.Popen[str]:
        return self.a.popen([sys.executable, script, *args],
                            env=ray_env({"RAY_ADDRESS": self.address}))

    def __enter__(self) -> TwoHosts:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _reap(p: subprocess.Popen[str]) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    for f in (p.stdin, p.stdout, p.stderr):
        if f is not None:
            f.close()


if __name__ == "__main__":  # a smoke test: build, show the nodes, tear down
    why = unavailable()
    if why:
        sys.exit(f"cannot build the cluster: {why}")
    with TwoHosts() as c:
        r = c.a.run([sys.executable, "-c", "import ray; ray.init(log_to_driver=False); "
                     "print([(n['NodeManagerAddress'], n['Alive']) for n in ray.nodes()])"],
                    env=ray_env({"RAY_ADDRESS": c.address}), timeout=60)
        print(r.stdout, r.stderr[-2000:])

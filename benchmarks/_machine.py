"""What a run was measured on and beside: the machine, the commit, and, sampled during the
run, the load average and the CPU that processes outside the run used."""

from __future__ import annotations

import datetime
import importlib
import os
import platform
import statistics
import subprocess
import threading
import time
from importlib import metadata
from pathlib import Path

import numpy as np
import psutil

import shmtensor as st

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("shmtensor", "ipc")
PEERS = ("torch", "joblib", "ray", "loky", "grain", "mpire", "faster_fifo", "iceoryx2",
         "matplotlib")


def version(module: str) -> str | None:
    """An installed package's version when it imports, else None."""
    try:
        importlib.import_module(module)
    except Exception:  # ImportError, or a wheel whose shared libraries do not load
        return None
    try:
        return metadata.version(module.replace("_", "-"))
    except metadata.PackageNotFoundError:
        return getattr(importlib.import_module(module), "__version__", "installed")


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout


def commit() -> tuple[str | None, bool]:
    """``git rev-parse HEAD`` and whether tracked files differ from it."""
    try:
        return git("rev-parse", "HEAD").strip(), bool(git("status", "--porcelain",
                                                          "--untracked-files=no").strip())
    except (OSError, subprocess.CalledProcessError):
        return None, False


def library_version() -> str | None:
    """The short commit of the code under test; ``+dirty.<hash of the diff>`` when shmtensor/
    or ipc/ has uncommitted changes (the library may be edited while the bench runs)."""
    import hashlib
    try:
        head = git("rev-parse", "--short", "HEAD").strip()
        diff = git("diff", "HEAD", "--", *LIBRARY)
        untracked = git("ls-files", "--others", "--exclude-standard", "--", *LIBRARY)
    except (OSError, subprocess.CalledProcessError):
        return None
    if not diff and not untracked:
        return head
    return f"{head}+dirty.{hashlib.sha1((diff + untracked).encode()).hexdigest()[:8]}"


def cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name")), None)
    except OSError:
        return None


def machine_info(quick: bool) -> dict:
    head, dirty = commit()
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "processor": cpu_model(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "numpy": np.__version__,
        "shmtensor": st.__version__,
        "commit": head,
        "dirty": dirty,
        "library_at_start": library_version(),
        "inline_threshold": st.get_inline_threshold(),
        **{m: version(m) for m in PEERS},
        "quick": quick,
        "load_average_at_start": os.getloadavg()[0],
    }


class Monitor:
    """A thread that samples, every ``every`` seconds, the load average and the CPU time of
    every process that is not this one or its descendants: what else ran, measured."""

    def __init__(self, every: float = 5.0) -> None:
        self.every = every
        self.loads: list[float] = []
        self.first: dict[int, tuple[str, float]] = {}
        self.last: dict[int, float] = {}
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-monitor", daemon=True)

    def __enter__(self) -> "Monitor":
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._sample()

    def _sample(self) -> None:
        self.loads.append(os.getloadavg()[0])
        me = psutil.Process()
        ours = {me.pid, *(c.pid for c in me.children(recursive=True))}
        for p in psutil.process_iter(["name", "cpu_times"]):
            if p.pid in ours or p.info["cpu_times"] is None:
                continue
            cpu = p.info["cpu_times"].user + p.info["cpu_times"].system
            self.first.setdefault(p.pid, (p.info["name"] or "?", cpu))
            self.last[p.pid] = cpu

    def report(self, top: int = 5) -> dict:
        """Load average (min, median, max), the CPUs other processes kept busy on average,
        and the ``top`` process names by CPU seconds."""
        by_name: dict[str, float] = {}
        for pid, (name, cpu0) in self.first.items():
            by_name[name] = by_name.get(name, 0.0) + self.last.get(pid, cpu0) - cpu0
        wall = max(time.monotonic() - self.started, 1e-9)
        busiest = sorted(by_name.items(), key=lambda kv: -kv[1])
        return {
            "load": {"every_s": self.every, "min": min(self.loads),
                     "median": statistics.median(self.loads), "max": max(self.loads)},
            "others_cpus": round(sum(by_name.values()) / wall, 2),
            "others": [{"name": n, "cpu_s": round(s, 1)} for n, s in busiest[:top] if s >= 1],
        }

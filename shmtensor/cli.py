"""The shmtensor command: see what shared memory is in use, clean up, check for leaks.

commands:
  shmtensor ls [--mine] [--pid PID] [--json]   every shmtensor segment on this machine
  shmtensor clean [--dry-run]                  remove what no live process can still use
  shmtensor leak-check [--json] [--json-file PATH] [--timeout S] -- CMD ARGS...
                                               run CMD, report what its process tree left

Sizes are binary: 1 KiB = 1024 bytes, 1 MiB = 1024 KiB.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import pwd
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterable
from types import FrameType
from typing import Any, TextIO, cast

import psutil

from shmtensor import __version__
from shmtensor.ipc import janitor, posix_shm, procfs

LEAK_EXIT = 97  # leak-check's exit status when the command leaked (distinct for CI)

Row = dict[str, Any]  # one row of a listing or report: JSON-ready, keyed by column
# parse_name of a name procfs listed (a shmtensor name: never None)
_NameFields = tuple[int, str, str]


def _say(text: str, stream: TextIO | None = None) -> None:
    """Print a line; once the reader has gone (``| head``), drop the rest of the output
    quietly instead of failing with BrokenPipeError."""
    stream = sys.stdout if stream is None else stream
    try:
        print(text, file=stream, flush=True)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())  # the interpreter's last flush goes there too
        os.close(devnull)


def _process_uid(pid: int) -> int | None | bool:
    """The effective uid of live process ``pid``; None when it is alive but its uid cannot
    be read; False when no such process runs (or only its zombie is left)."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return proc.uids().effective
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return None


_USERS: dict[int, str] = {}


def _user(uid: int | None) -> str | None:
    """The user name of ``uid`` (its number when it has none); None for None."""
    if uid is None:
        return None
    if uid not in _USERS:
        try:
            _USERS[uid] = pwd.getpwuid(uid).pw_name
        except KeyError:
            _USERS[uid] = str(uid)
    return _USERS[uid]


def _size(n: float) -> str:
    """``n`` bytes in binary units: 512 B, 8.0 KiB, 1.5 MiB, 2.0 GiB, 1.0 TiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def segments(entries: dict[str, os.stat_result] | None = None) -> list[Row]:
    """Every shmtensor segment: named ones in /dev/shm (regular files: see
    :func:`not_segments`) and memfds some process maps or holds.

    ``owner_uid`` is the uid owning the file (a memfd's is read through a process that has
    it open: None when none does); ``creator_uid`` the effective uid of the process whose
    pid the name carries, while it runs (None otherwise).  Both differ when another user
    made the file under that pid's name."""
    uses = procfs.scan()
    if entries is None:
        entries = procfs.shm_entries()
    named = {n: st for n, st in entries.items() if stat.S_ISREG(st.st_mode)}
    now = time.time()
    rows: list[Row] = []
    for name in sorted(set(named) | (set(uses) - set(entries))):
        pid, token, serial = cast(_NameFields, posix_shm.parse_name(name))
        if serial == "lease":
            continue
        use = uses.get(name)
        st = named.get(name)
        creator_uid = _process_uid(pid)
        owner_uid = st.st_uid if st else cast(procfs.SegmentUse, use).uid  # no file: in uses
        rows.append({"name": name, "kind": "named" if st else "memfd",
                     "size": st.st_size if st else cast(procfs.SegmentUse, use).size,
                     "creator_pid": pid,
                     "creator_alive": creator_uid is not False,
                     "creator_uid": None if creator_uid is False else creator_uid,
                     "owner_uid": owner_uid, "owner": _user(owner_uid),
                     "mapped_by": sorted(use.mapped_by) if use else [],
                     "fd_held_by": sorted(use.fd_held_by) if use else [],
                     "age_s": round(now - st.st_mtime, 1) if st else None})
    return rows


def not_segments(entries: dict[str, os.stat_result] | None = None) -> list[Row]:
    """What sits in /dev/shm under a shmtensor-like name and is not a regular file (a FIFO,
    a symlink, a directory): shmtensor never makes one, so it is not ours.  Listed, never
    opened, followed or removed."""
    if entries is None:
        entries = procfs.shm_entries()
    return [{"name": n, "kind": procfs.file_kind(st), "uid": st.st_uid}
            for n, st in sorted(entries.items()) if not stat.S_ISREG(st.st_mode)]


def _say_not_segments(rows: list[Row]) -> None:
    for r in rows:
        _say(f"not a segment: {posix_shm.SHM_DIR}/{r['name']} is a {r['kind']} (owner "
             f"{_user(r['uid'])}, uid {r['uid']}); shmtensor makes regular files only, so it "
             "did not make this one and leaves it alone: remove it by hand if it is unwanted")


def _say_foreign_owners(rows: list[Row]) -> None:
    """One line per segment whose file belongs to another user than its creator pid's."""
    for r in rows:
        if None not in (r["owner_uid"], r["creator_uid"]) and r["owner_uid"] != r["creator_uid"]:
            _say(f"owner differs: {r['name']} belongs to {r['owner']} (uid {r['owner_uid']}) "
                 f"but pid {r['creator_pid']} in its name runs as {_user(r['creator_uid'])} "
                 f"(uid {r['creator_uid']}): another user made this file under that pid's "
                 "name, or the pid was reused after its creator ended")


def _table(rows: list[Row], cols: list[tuple[str, str]]) -> str:
    cells = [[h for _, h in cols]] + [[_fmt(r[k], k) for k, _ in cols] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    return "\n".join("  ".join(c[i].ljust(widths[i]) for i in range(len(cols))) for c in cells)


TABLE_PIDS = 3  # pids shown in a table cell; the rest are counted (--json lists them all)


def _fmt(v: Any, key: str) -> str:
    if key == "size":
        return _size(v)
    if isinstance(v, list):
        more = f" +{len(v) - TABLE_PIDS} more" if len(v) > TABLE_PIDS else ""
        return ",".join(map(str, v[:TABLE_PIDS])) + more or "-"
    if isinstance(v, bool):
        return "alive" if v else "dead"
    return "-" if v is None else str(v)


_LS_COLS = [("name", "NAME"), ("kind", "KIND"), ("size", "SIZE"), ("owner", "OWNER"),
            ("creator_pid", "CREATOR"), ("creator_alive", "STATE"), ("age_s", "AGE(s)"),
            ("mapped_by", "MAPPED BY"), ("fd_held_by", "FD HELD BY")]
_LS_COLUMNS_DOC = f"""\
columns:
  NAME        the segment's name: shmtensor_<creator pid>_<token>_<serial>
  KIND        named: a file in /dev/shm, which stays until it is removed;
              memfd: an anonymous file, freed when no process maps or holds it
  SIZE        its size, in binary units (1 KiB = 1024 bytes)
  OWNER       the user owning the file (a memfd's is read through a process that has it
              open: "-" when none does).  When it is not the user the creator pid runs
              as, a line under the table says so: another user made the file under
              that pid's name
  CREATOR     the pid in the name: the process that made the segment
  STATE       alive when that pid runs now, dead when it does not
  AGE(s)      seconds since the file was last written to ("-" for a memfd)
  MAPPED BY   pids that have the segment mapped into memory
  FD HELD BY  pids that have a file descriptor of it open
MAPPED BY and FD HELD BY show the first {TABLE_PIDS} pids, then how many more ("+5 more");
--json lists them all.  Processes this user may not inspect are not seen: run as their
owner (or root) to see them.

filters (both at once: segments matching both):
  --mine      segments whose file this user owns (for a memfd nobody holds open: whose
              creator runs as this user)
  --pid PID   segments PID made, maps or holds open
"""
_FILE_COLS = [("name", "NAME"), ("kind", "KIND"), ("size", "SIZE"), ("age_s", "AGE(s)"),
              ("creator", "CREATOR (first process of the tree seen holding it)")]


def _wanted(args: argparse.Namespace, pid: int, holders: list[int], uid: int | None) -> bool:
    """Whether a row passes ls's filters: ``pid`` is the one in its name, ``holders`` the
    processes that map or hold it, ``uid`` its owner's."""
    if args.mine and uid != os.geteuid():
        return False
    return args.pid is None or args.pid == pid or args.pid in holders


def cmd_ls(args: argparse.Namespace) -> int:
    entries = procfs.shm_entries()
    rows = [r for r in segments(entries)
            if _wanted(args, r["creator_pid"], r["mapped_by"] + r["fd_held_by"],
                       r["creator_uid"] if r["owner_uid"] is None else r["owner_uid"])]
    others = [r for r in not_segments(entries)
              if _wanted(args, cast(_NameFields, posix_shm.parse_name(r["name"]))[0], [], r["uid"])]
    if args.json:
        _say(json.dumps({"segments": rows, "not_segments": others}, indent=2))
        return 0
    if not rows:
        filters = [f for f, on in (("--mine", args.mine),
                                    (f"--pid {args.pid}", args.pid is not None)) if on]
        which = f" matching {' and '.join(filters)}" if filters else ""
        _say(f"no shmtensor segments{which} on this machine")
    else:
        _say(_table(rows, _LS_COLS))
        _say(f"\n{len(rows)} segment(s), {_size(sum(r['size'] for r in rows))}")
    _say_foreign_owners(rows)
    _say_not_segments(others)
    return 0


CLEAN_MIN_AGE_S = 5.0


def _lease_open_somewhere() -> set[str]:
    """``<pid>_<token>`` of every creator whose lease table some live process has open: a
    process that holds (or may still receive) its segments."""
    tags = set()
    for name, use in procfs.scan().items():
        pid, token, serial = cast(_NameFields, posix_shm.parse_name(name))
        if serial == "lease" and use.fd_held_by:
            tags.add(f"{pid}_{token}")
    return tags


def cmd_clean(args: argparse.Namespace) -> int:
    janitors = janitor.running_janitors()
    leases = _lease_open_somewhere()
    entries = procfs.shm_entries()
    failed: list[tuple[str, OSError]]
    removed, freed, failed = [], 0, []
    for row in segments(entries):
        pid, token, _ = cast(_NameFields, posix_shm.parse_name(row["name"]))
        if (row["kind"] != "named" or (row["age_s"] or 0) < CLEAN_MIN_AGE_S
                or janitor.in_use(row["name"]) or row["creator_alive"] or row["mapped_by"]
                or row["fd_held_by"] or row["creator_pid"] in janitors
                or f"{pid}_{token}" in leases):
            # a live process may still use it (or its janitor will remove it).  The
            # janitor's lock is the one sign that holds across pid namespaces; the others
            # cover a janitor that was killed, for what this namespace can see.
            continue
        if not args.dry_run:
            try:
                posix_shm.unlink_named(row["name"])
            except OSError as e:  # not ours to remove, or no longer the file it was
                failed.append((row["name"], e))
                continue
        removed.append(row["name"])
        freed += row["size"]
    for name, err in failed:
        fix = " (run as its owner or root)" if isinstance(err, PermissionError) else ""
        _say(f"cannot remove /dev/shm/{name}: {err.strerror}{fix}")
    _say_not_segments(not_segments(entries))
    verb = "would remove" if args.dry_run else "removed"
    for name in removed:
        _say(f"{verb} /dev/shm/{name}")
    _say(f"{verb} {len(removed)} segment(s), {_size(freed)}")
    return 0


def _become_subreaper() -> None:
    """Orphaned descendants of the command get reparented to us, so we still see them."""
    try:
        ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def _shm_names() -> dict[str, int]:
    """Every name in /dev/shm and its inode (a name made again is a new file)."""
    out = {}
    try:
        with os.scandir(posix_shm.SHM_DIR) as entries:
            for entry in entries:
                out[entry.name] = entry.inode()
    except OSError:
        pass
    return out


def _shm_device() -> tuple[int, int] | None:
    try:
        dev = os.stat(posix_shm.SHM_DIR).st_dev
    except OSError:
        return None
    return os.major(dev), os.minor(dev)


def _openers(files: dict[int, str], pids: Iterable[int]) -> dict[str, set[int]]:
    """For files of /dev/shm given by inode, which of ``pids`` have each open or mapped now
    (``/proc/PID/fd``, ``/proc/PID/maps``; processes we may not read are skipped).  Matched
    by inode: glibc's ``sem_open`` maps a temporary name, then links it to the real one."""
    found: dict[str, set[int]] = {}
    dev = _shm_device()
    if not files or dev is None:
        return found
    maps_dev = f"{dev[0]:02x}:{dev[1]:02x}".encode()
    for pid in pids:
        try:
            fddir = f"/proc/{pid}/fd"
            for fd in os.listdir(fddir):
                try:
                    if not os.readlink(f"{fddir}/{fd}").startswith(posix_shm.SHM_DIR + "/"):
                        continue
                    st = os.stat(f"{fddir}/{fd}")
                except OSError:
                    continue
                name = files.get(st.st_ino)
                if name is not None and (os.major(st.st_dev), os.minor(st.st_dev)) == dev:
                    found.setdefault(name, set()).add(pid)
            with open(f"/proc/{pid}/maps", "rb") as f:
                for line in f:
                    parts = line.split(None, 5)
                    if len(parts) < 6 or parts[3] != maps_dev:
                        continue
                    name = files.get(int(parts[4]))
                    if name is not None:
                        found.setdefault(name, set()).add(pid)
        except (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError):
            continue
    return found


# Files that libraries leave in /dev/shm by design, reported apart and not counted as the
# command's leak: (name prefix, why).
_NOT_LEAKS = (
    ("cuda.shm.", "the CUDA driver's own: one 80 KiB file per process that made an "
                  "interprocess event, which the driver never removes"),
)


def _not_leak(name: str) -> str | None:
    return next((why for prefix, why in _NOT_LEAKS if name.startswith(prefix)), None)


def _not_segment(name: str) -> bool:
    """True for a name in /dev/shm that is no shmtensor segment: not a shmtensor name, or one
    on anything but a regular file (see :func:`not_segments`)."""
    if posix_shm.parse_name(name) is None:
        return True
    try:
        return not stat.S_ISREG(os.lstat(os.path.join(posix_shm.SHM_DIR, name)).st_mode)
    except OSError:
        return False


class _TreeWatch:
    """Follows the command's process tree and the names it makes in /dev/shm.

    A shmtensor name carries its creator's pid.  Any other name (a stdlib ``SharedMemory``,
    a POSIX semaphore ``sem.*``, anything) is attributed to the first process of the tree
    seen holding it open or mapped; one that only processes outside the tree hold is
    theirs, not a leak; one nobody was seen holding is reported with creator "unknown"."""

    def __init__(self, me: int) -> None:
        self.me = me
        self.before = _shm_names()
        self.tree: dict[int, str] = {}        # pid -> command line, for every pid ever seen
        self.openers: dict[str, list[int]] = {}  # new name -> tree pids seen holding it

    def add(self, pid: int, cmdline: str) -> None:
        self.tree.setdefault(pid, cmdline)

    def new_names(self) -> dict[str, int]:
        return {n: ino for n, ino in _shm_names().items() if self.before.get(n) != ino}

    def sample(self) -> None:
        """Record the tree's new processes and who holds the new, unattributed names."""
        try:
            children = psutil.Process(self.me).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        for child in children:
            if child.pid not in self.tree:
                try:
                    self.add(child.pid, " ".join(child.cmdline())[:200])
                except psutil.Error:
                    self.add(child.pid, "?")
        pending = {ino: n for n, ino in self.new_names().items()
                   if n not in self.openers and _not_segment(n)}
        for name, pids in _openers(pending, [c.pid for c in children]).items():
            self.openers[name] = sorted(pids)

    def files(self) -> list[Row]:
        """New non-shmtensor names still in /dev/shm that the tree made (or may have)."""
        new = {n: ino for n, ino in self.new_names().items() if _not_segment(n)}
        unseen = {ino: n for n, ino in new.items() if n not in self.openers}
        others = _openers(unseen, (int(p) for p in os.listdir("/proc")
                                   if p.isdigit() and int(p) not in self.tree)) if unseen else {}
        now = time.time()
        rows: list[Row] = []
        for name in sorted(set(new) - set(others)):
            try:
                st = os.lstat(os.path.join(posix_shm.SHM_DIR, name))
            except FileNotFoundError:
                continue
            pids = self.openers.get(name, [])
            creator = pids[0] if pids else None
            kind = "semaphore" if name.startswith("sem.") else procfs.file_kind(st)
            rows.append({"name": name, "kind": kind, "size": st.st_size,
                         "creator_pid": creator,
                         "creator": (f"pid {creator}: {self.tree.get(creator, '?')}"
                                     if creator is not None else "unknown"),
                         "seen_held_by": pids, "age_s": round(now - st.st_mtime, 1)})
        return rows

    def segments(self) -> list[Row]:
        """shmtensor segments made by the tree (and new ones whose dead creator we missed)."""
        new = self.new_names()
        return [r for r in segments() if r["creator_pid"] in self.tree
                or (r["name"] in new and not r["creator_alive"])]

    def report(self) -> Row:
        live = []
        try:
            children = psutil.Process(self.me).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        for child in children:
            try:
                if child.status() != psutil.STATUS_ZOMBIE:
                    live.append({"pid": child.pid, "cmdline": " ".join(child.cmdline())[:200]})
            except psutil.NoSuchProcess:
                continue
        files: list[Row]
        not_counted: list[Row]
        files, not_counted = [], []
        for f in self.files():
            why = _not_leak(f["name"])
            (not_counted if why else files).append(dict(f, why=why) if why else f)
        return {"segments": self.segments(), "files": files, "processes": live,
                "not_counted": not_counted}


def _run(command: list[str]) -> subprocess.Popen[bytes] | int:
    """Start the command, or say in one line why not and return the shell's status for it
    (127: not found, 126: found but cannot be run)."""
    try:
        return subprocess.Popen(command)
    except FileNotFoundError as e:
        _say(f"shmtensor leak-check: {command[0]}: command not found ({e.strerror})",
             sys.stderr)
        return 127
    except OSError as e:
        _say(f"shmtensor leak-check: {command[0]}: cannot run it ({e.strerror})", sys.stderr)
        return 126


def _wait(proc: subprocess.Popen[bytes], watch: _TreeWatch) -> int:
    """Wait for the command, sampling its tree; SIGTERM and SIGHUP sent to leak-check are
    passed on, and Ctrl-C is left to the command (the terminal sends it there too)."""
    def forward(signum: int, _frame: FrameType | None) -> None:
        proc.send_signal(signum)
    saved = {s: signal.signal(s, h) for s, h in ((signal.SIGTERM, forward),
                                                (signal.SIGHUP, forward),
                                                (signal.SIGINT, signal.SIG_IGN))}
    try:
        delay = 0.002  # short commands end fast; long ones are sampled less often (<= 50 ms)
        while True:
            watch.sample()
            try:
                return proc.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                delay = min(delay * 2, 0.05)
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def _status(code: int) -> tuple[int, str]:
    """The command's status as a shell gives it (128+N when killed by signal N), in words."""
    if code >= 0:
        return code, f"command exited {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return 128 - code, f"command killed by {name}, status {128 - code}"


def cmd_leak_check(args: argparse.Namespace) -> int:
    if not args.command:
        _say("shmtensor leak-check: no command given: shmtensor leak-check -- python train.py",
             sys.stderr)
        return 2
    if args.timeout < 0:
        _say(f"shmtensor leak-check: --timeout must be >= 0 seconds, got {args.timeout}",
             sys.stderr)
        return 2
    report_file = None
    if args.json_file:
        try:  # opened first: a path that cannot be written fails before the command runs
            report_file = open(args.json_file, "w")
        except OSError as e:
            _say(f"shmtensor leak-check: cannot write the report to {args.json_file}: "
                 f"{e.strerror}; give a writable --json-file path", sys.stderr)
            return 2
    _become_subreaper()
    watch = _TreeWatch(os.getpid())
    proc = _run(args.command)
    if isinstance(proc, int):  # not started: no report to write
        if report_file is not None:
            report_file.close()
            os.unlink(args.json_file)
        return proc
    watch.add(proc.pid, " ".join(args.command)[:200])
    status, words = _status(_wait(proc, watch))
    deadline = time.monotonic() + args.timeout
    watch.sample()
    def left(report: Row) -> bool:
        return bool(report["segments"] or report["files"] or report["processes"])

    report = watch.report()
    while left(report) and time.monotonic() < deadline:
        time.sleep(0.05)  # asynchronous releases: janitors, resource trackers, exiting children
        watch.sample()
        report = watch.report()
    try:
        adopted = psutil.Process().children()
    except psutil.NoSuchProcess:
        adopted = []
    for child in adopted:  # reap what we adopted and what has ended
        try:
            child.wait(0)
        except (psutil.TimeoutExpired, psutil.NoSuchProcess):
            pass
    leaked = left(report)
    report.update(command=args.command, exit_code=status,
                  signal=-proc.returncode if proc.returncode < 0 else None, leaked=leaked)
    if report_file is not None:
        with report_file:
            json.dump(report, report_file, indent=2)
    if args.json:
        _say(json.dumps(report, indent=2))
    else:
        if report["segments"]:
            _say(f"shmtensor leak-check: {len(report['segments'])} shmtensor segment(s) left "
                 "behind:")
            _say(_table(report["segments"], _LS_COLS))
        if report["files"]:
            _say(f"shmtensor leak-check: {len(report['files'])} file(s) left behind in "
                 f"{posix_shm.SHM_DIR}:")
            _say(_table(report["files"], _FILE_COLS))
        for p in report["processes"]:
            _say(f"shmtensor leak-check: process {p['pid']} still running: {p['cmdline']}")
        for f in report["not_counted"]:
            _say(f"shmtensor leak-check: not counted: {posix_shm.SHM_DIR}/{f['name']} "
                 f"({f['why']})")
        _say(f"shmtensor leak-check: {'LEAKED' if leaked else 'clean'} ({words})")
    return LEAK_EXIT if leaked else status


_LEAK_CHECK_DOC = f"""\
Runs CMD, follows its whole process tree (orphans included), and when it ends reports
what the tree left behind: shmtensor segments, any other new file in /dev/shm (a stdlib
SharedMemory, a POSIX semaphore sem.*, ...) with the process seen holding it ("unknown"
when it came and was let go between two looks), and processes still running.  It waits
up to --timeout seconds for what is released asynchronously (janitors, resource
trackers) before calling it a leak.  Files the CUDA driver leaves by design
(cuda.shm.*, one per process that made an interprocess event) are listed, not counted.

exit status:
  N        the command's own status when nothing was left behind, as a shell gives
           it: 128+S when signal S killed it (137 for SIGKILL)
  {LEAK_EXIT}       something was left behind, whatever the command's status (the
           report gives it)
  126      CMD was found but cannot be run (not executable, a directory)
  127      CMD was not found
  2        usage error
"""


def _pid(text: str) -> int:
    try:
        pid = int(text)
    except ValueError:
        pid = 0
    if pid <= 0:
        raise argparse.ArgumentTypeError(f"a pid is a positive whole number, got {text!r}")
    return pid


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shmtensor", usage="%(prog)s [-h] [--version] COMMAND ...", description=__doc__,
        epilog="Run 'shmtensor COMMAND --help' for what a command does and prints.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"shmtensor {__version__}")
    # the description lists the commands with their options: argparse's list is hidden
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", help=argparse.SUPPRESS,
                           prog="shmtensor")
    ls = sub.add_parser(
        "ls", help="list every shmtensor segment: size, owner, creator, who maps it",
        description="Lists every shmtensor segment on this machine: named ones in /dev/shm\n"
                    "and memfds that some process maps or holds open.  Anything but a\n"
                    "regular file under a shmtensor name is listed apart, as not a segment.",
        epilog=_LS_COLUMNS_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    ls.add_argument("--mine", action="store_true",
                    help="only segments made by this user's processes")
    ls.add_argument("--pid", type=_pid, metavar="PID",
                    help="only segments made, mapped or held open by process PID")
    ls.add_argument("--json", action="store_true",
                    help="machine-readable output, with every pid of every segment")
    ls.set_defaults(func=cmd_ls)
    cl = sub.add_parser(
        "clean", help="remove named segments no live process can still use",
        description="Removes /dev/shm/shmtensor_* segments whose creator is dead, that no live "
                    "process maps or has open, whose creator's lease table no live process "
                    f"holds, that no janitor is handling, and that are older than "
                    f"{CLEAN_MIN_AGE_S:.0f} s. A message still unread in a queue of a dead "
                    "job cannot be seen from outside; run clean when such jobs are over. "
                    "Anything but a regular file under such a name (a FIFO, a symlink, a "
                    "directory) is not a segment: it is reported, never opened, followed or "
                    "removed.")
    cl.add_argument("--dry-run", action="store_true", help="say what would go, remove nothing")
    cl.set_defaults(func=cmd_clean)
    lc = sub.add_parser(
        "leak-check", help="run a command and report what its process tree left behind",
        formatter_class=argparse.RawDescriptionHelpFormatter, description=_LEAK_CHECK_DOC,
        usage="%(prog)s [-h] [--json] [--json-file PATH] [--timeout S] -- CMD [ARGS ...]")
    lc.add_argument("--json", action="store_true",
                    help="machine-readable report, on stdout after the command's own output")
    lc.add_argument("--json-file", metavar="PATH",
                    help="also write the machine-readable report to PATH (apart from the "
                         "command's output)")
    lc.add_argument("--timeout", type=float, default=5.0, metavar="S",
                    help="seconds to wait for asynchronous releases after the command ends")
    lc.add_argument("command", nargs=argparse.REMAINDER, metavar="CMD",
                    help="the command to run, with its arguments, after --")
    lc.set_defaults(func=cmd_leak_check)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmd is None:  # no command: the help, as pip gives it
        _say(parser.format_help().rstrip("\n"))
        return 0
    if getattr(args, "command", None) and args.command[0] == "--":
        args.command = args.command[1:]
    return cast(int, args.func(args))  # a cmd_* function

"""``shmtensor`` command line: see what shared memory is in use, clean up, check for leaks.

  shmtensor ls [--json]                        every shmtensor segment on this machine
  shmtensor clean [--dry-run]                  remove what no live process can still use
  shmtensor leak-check [--json] [--timeout S] -- CMD ARGS...
                                               run CMD, report what its process tree left
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time

import psutil

from shmtensor.ipc import janitor, posix_shm, procfs

LEAK_EXIT = 97  # leak-check's exit status when the command leaked (distinct for CI)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def segments() -> list[dict]:
    """Every shmtensor segment: named ones in /dev/shm and memfds some process maps or holds."""
    uses = procfs.scan()
    named = procfs.named_segments()
    now = time.time()
    rows = []
    for name in sorted(set(named) | set(uses)):
        pid, token, serial = posix_shm.parse_name(name)
        if serial == "lease":
            continue
        use = uses.get(name)
        row = {"name": name, "kind": "named" if name in named else "memfd",
               "size": named.get(name, use.size if use else 0), "creator_pid": pid,
               "creator_alive": _alive(pid),
               "mapped_by": sorted(use.mapped_by) if use else [],
               "fd_held_by": sorted(use.fd_held_by) if use else [], "age_s": None}
        if name in named:
            try:
                row["age_s"] = round(now - os.stat(os.path.join(posix_shm.SHM_DIR, name)).st_mtime, 1)
            except FileNotFoundError:
                continue
        rows.append(row)
    return rows


def _table(rows: list[dict], cols: list[tuple[str, str]]) -> str:
    cells = [[h for _, h in cols]] + [[_fmt(r[k], k) for k, _ in cols] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    return "\n".join("  ".join(c[i].ljust(widths[i]) for i in range(len(cols))) for c in cells)


def _fmt(v, key: str) -> str:
    if key == "size":
        return _size(v)
    if isinstance(v, list):
        return ",".join(map(str, v)) or "-"
    if isinstance(v, bool):
        return "alive" if v else "dead"
    return "-" if v is None else str(v)


_LS_COLS = [("name", "NAME"), ("kind", "KIND"), ("size", "SIZE"), ("creator_pid", "CREATOR"),
            ("creator_alive", "STATE"), ("age_s", "AGE(s)"), ("mapped_by", "MAPPED BY"),
            ("fd_held_by", "FD HELD BY")]


def cmd_ls(args) -> int:
    rows = segments()
    if args.json:
        print(json.dumps({"segments": rows}, indent=2))
    elif not rows:
        print("no shmtensor segments on this machine")
    else:
        print(_table(rows, _LS_COLS))
        print(f"\n{len(rows)} segment(s), {_size(sum(r['size'] for r in rows))}")
    return 0


CLEAN_MIN_AGE_S = 5.0


def _lease_open_somewhere() -> set[str]:
    """``<pid>_<token>`` of every creator whose lease table some live process has open: a
    process that holds (or may still receive) its segments."""
    tags = set()
    for name, use in procfs.scan().items():
        pid, token, serial = posix_shm.parse_name(name)
        if serial == "lease" and use.fd_held_by:
            tags.add(f"{pid}_{token}")
    return tags


def cmd_clean(args) -> int:
    janitors = janitor.running_janitors()
    leases = _lease_open_somewhere()
    removed, freed, failed = [], 0, []
    for row in segments():
        pid, token, _ = posix_shm.parse_name(row["name"])
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
            except PermissionError:
                failed.append(row["name"])
                continue
        removed.append(row["name"])
        freed += row["size"]
    for name in failed:
        print(f"cannot remove /dev/shm/{name}: permission denied (run as its owner or root)")
    verb = "would remove" if args.dry_run else "removed"
    for name in removed:
        print(f"{verb} /dev/shm/{name}")
    print(f"{verb} {len(removed)} segment(s), {_size(freed)}")
    return 0


def _become_subreaper() -> None:
    """Orphaned descendants of the command get reparented to us, so we still see them."""
    try:
        ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def _tree_report(tree: set[int], me: int) -> dict:
    live = []
    for child in psutil.Process(me).children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                live.append({"pid": child.pid, "cmdline": " ".join(child.cmdline())[:200]})
        except psutil.NoSuchProcess:
            continue
    segs = [r for r in segments() if r["creator_pid"] in tree]
    return {"segments": segs, "processes": live}


def cmd_leak_check(args) -> int:
    if not args.command:
        print("leak-check needs a command: shmtensor leak-check -- python train.py",
              file=sys.stderr)
        return 2
    _become_subreaper()
    me = os.getpid()
    proc = subprocess.Popen(args.command)
    tree = {proc.pid}
    delay = 0.002  # short commands end fast; long ones are sampled less often (<= 50 ms)
    while True:
        try:
            code = proc.wait(timeout=delay)
            break
        except subprocess.TimeoutExpired:
            pass
        try:
            tree.update(c.pid for c in psutil.Process(me).children(recursive=True))
        except psutil.NoSuchProcess:
            pass
        delay = min(delay * 2, 0.05)
    for c in psutil.Process(me).children(recursive=True):
        tree.add(c.pid)
    deadline = time.monotonic() + args.timeout
    report = _tree_report(tree, me)
    while (report["segments"] or report["processes"]) and time.monotonic() < deadline:
        time.sleep(0.05)
        for c in psutil.Process(me).children(recursive=True):
            tree.add(c.pid)
        report = _tree_report(tree, me)
    for child in psutil.Process(me).children():  # reap what we adopted
        try:
            child.wait(0)
        except (psutil.TimeoutExpired, psutil.NoSuchProcess):
            pass
    leaked = bool(report["segments"] or report["processes"])
    report.update(command=args.command, exit_code=code, leaked=bool(leaked))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        if report["segments"]:
            print(f"shmtensor leak-check: {len(report['segments'])} segment(s) left behind:")
            print(_table(report["segments"], _LS_COLS))
        for p in report["processes"]:
            print(f"shmtensor leak-check: process {p['pid']} still running: {p['cmdline']}")
        if not leaked:
            print(f"shmtensor leak-check: clean (command exited {code})")
    return LEAK_EXIT if leaked else code


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shmtensor", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("ls", help="list every shmtensor segment: size, creator, who maps it")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(func=cmd_ls)
    cl = sub.add_parser(
        "clean", help="remove named segments no live process can still use",
        description="Removes /dev/shm/shmtensor_* segments whose creator is dead, that no live "
                    "process maps or has open, whose creator's lease table no live process "
                    f"holds, that no janitor is handling, and that are older than "
                    f"{CLEAN_MIN_AGE_S:.0f} s. A message still unread in a queue of a dead "
                    "job cannot be seen from outside; run clean when such jobs are over.")
    cl.add_argument("--dry-run", action="store_true", help="say what would go, remove nothing")
    cl.set_defaults(func=cmd_clean)
    lc = sub.add_parser(
        "leak-check", help="run a command and report what its process tree left behind",
        description=f"Runs CMD, follows its whole process tree, and when it ends reports the "
                    f"segments and live processes it left. Exit status: 0 when clean, "
                    f"{LEAK_EXIT} when it leaked, the command's own status otherwise.")
    lc.add_argument("--json", action="store_true", help="machine-readable report")
    lc.add_argument("--timeout", type=float, default=5.0,
                    help="seconds to wait for asynchronous releases after the command ends")
    lc.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    lc.set_defaults(func=cmd_leak_check)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "command", None) and args.command[0] == "--":
        args.command = args.command[1:]
    return args.func(args)

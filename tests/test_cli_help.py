"""What ``shmtensor`` says about itself: --version, its help when run alone, help texts in
plain words (no reST markup), and ``ls --help`` naming every column ``ls`` prints."""

import os
import re
import subprocess
import sys

import shmtensor
from shmtensor.ipc import posix_shm

CLI = [sys.executable, "-m", "shmtensor"]
TIMEOUT = 60  # seconds: only reached when a command hangs


def run(*args):
    return subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=TIMEOUT)


def test_version():
    r = run("--version")
    assert (r.returncode, r.stdout, r.stderr) == (0, f"shmtensor {shmtensor.__version__}\n", "")


def test_no_command_prints_the_help_and_exits_0():
    r = run()
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout == run("--help").stdout
    assert r.stdout.startswith("usage: shmtensor")
    for command in ("shmtensor ls", "shmtensor clean", "shmtensor leak-check"):
        assert command in r.stdout


def test_an_unknown_command_is_a_usage_error():
    r = run("list")
    assert r.returncode == 2 and "invalid choice: 'list'" in r.stderr, r.stderr


MARKUP = re.compile(r"``|:(func|class|mod|meth|attr|data|exc):`")


def test_help_texts_are_plain_words():
    for command in ([], ["ls"], ["clean"], ["leak-check"]):
        r = run(*command, "--help")
        assert r.returncode == 0, r.stderr
        assert not MARKUP.search(r.stdout), f"{command}: {MARKUP.search(r.stdout)[0]!r}"
        assert f"usage: shmtensor {' '.join(command)}".rstrip() in r.stdout


def test_ls_help_explains_every_column_ls_prints():
    name = f"shmtensor_999999_{os.urandom(3).hex()}_1"  # a dead creator's: a row to print
    fd = os.open(os.path.join(posix_shm.SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR,
                 0o600)
    os.close(fd)
    try:
        table = run("ls").stdout
    finally:
        posix_shm.unlink_named(name)
    header = table.splitlines()[0]
    assert header.startswith("NAME"), table
    columns = re.split(r"\s{2,}", header.strip())
    assert "OWNER" in columns and "MAPPED BY" in columns, columns
    explained = run("ls", "--help").stdout.split("columns:\n", 1)[1]
    for column in columns:
        assert re.search(rf"^  {re.escape(column)}\s", explained, re.M), column
    for option in ("--mine", "--pid", "--json"):
        assert option in explained

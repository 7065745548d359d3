"""The examples a user copies from: the data loader re-raises a worker's error, as torch's
DataLoader does, instead of waiting on a queue that will never fill."""

import os
import subprocess
import sys
import textwrap

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")

SCRIPT = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {examples!r})
    import dataloader
    import shmtensor.multiprocessing as smp

    def bad_fill(out, index):
        if index == 3:
            {failure}
        dataloader.make_batch(out, index)

    if __name__ == "__main__":
        seen = []
        try:
            for index, batch in dataloader.Loader(smp.get_context("spawn"), 2, 8, bad_fill):
                seen.append(index)
                del batch
        except Exception as e:
            print("RAISED", type(e).__name__)
            print(e)
            sys.exit(0)
        print("NOT RAISED", seen)
        sys.exit(1)
""")


@pytest.mark.parametrize("failure, expect", [
    ("raise ValueError('bad sample 3')",
     ["RAISED ValueError", "Caught ValueError in data loader worker 1",
      "in bad_fill", "ValueError: bad sample 3"]),
    ("os._exit(3)", ["RAISED RuntimeError", "exited unexpectedly with exit code 3"]),
])
def test_dataloader_example_reraises_a_worker_failure(tmp_path, failure, expect):
    script = tmp_path / "loader_failure.py"
    script.write_text(SCRIPT.format(examples=EXAMPLES, failure=failure))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for line in expect:
        assert line in proc.stdout, proc.stdout + proc.stderr

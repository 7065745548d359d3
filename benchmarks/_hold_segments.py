"""Helper child of the CLI benchmark: ``python -m benchmarks._hold_segments COUNT``.

Makes ``COUNT`` small named segments (strategy ``file_system``: one /dev/shm file each),
prints how many segments it created, and keeps them alive until its stdin closes.  Small
arrays share slabs; here each must be a segment of its own, so slabs are turned off.
"""

from __future__ import annotations

import sys

import shmtensor as st
from shmtensor import _segments


def main(count: int) -> None:
    st.set_sharing_strategy("file_system")
    _segments.SLAB_ITEM_MAX = -1  # one segment per array: what ls is measured against
    arrays = [st.zeros(10) for _ in range(count)]
    print(st.debug_info()["segments_created"], flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    del arrays


if __name__ == "__main__":
    main(int(sys.argv[1]))

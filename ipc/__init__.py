"""ipc: the transport under shmtensor. Segments (memfd and /dev/shm), fds passed over Unix
sockets in frames, leases told by OFD locks, and the janitor for named segments.  It knows
bytes, fds and handles; nothing here imports numpy or CuPy."""

from .posix_shm import ShmSpaceError

__all__ = ["ShmSpaceError"]

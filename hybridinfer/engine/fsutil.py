"""File-system helpers shared by the stores that must survive a crash (prefix snapshots, batch output)."""

from __future__ import annotations

import os


def fsync_dir(directory: str) -> None:
    """Flush a directory's entries (a rename or a new file in it) to disk; best effort where the platform refuses."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

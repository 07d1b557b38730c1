"""Position-indexed snapshots of the decoder state, to resume a prompt after its longest cached prefix.

index.py: the block hash chain; snapshot.py: the Snapshot type and file format; ram.py: the RAM LRU;
disk.py: the on-disk store shared by processes; cache.py: the PrefixCache facade.
"""

from .cache import Hit, PrefixCache
from .disk import SnapshotWarning
from .snapshot import Snapshot

__all__ = ["Hit", "PrefixCache", "Snapshot", "SnapshotWarning"]

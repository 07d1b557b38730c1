"""Position-indexed snapshots of the decoder state, to resume a prompt after its longest cached prefix.

index.py: the block hash chain; snapshot.py: the Snapshot type and file format; ram.py: the RAM LRU;
disk.py: the on-disk store shared by processes; layout.py: the checks a snapshot file passes before a restore;
model_key.py: the model's content hash (remembered in the disk store); cache.py: the PrefixCache facade.

A snapshot is found only by a cache of the same fingerprint, which names both the model and the backend's numeric
path (`api.model_cache_fingerprint`): a directory shared by processes and models keys it by a hash of every byte
of the model file (a fine-tune differing from its base in one tensor shares nothing with it), and the numeric path
("reference", "cpu:avx512vnni", "cpu:scalar", ...) keeps one backend's rounding out of another's runs, so a
restored run always equals a cold run of the same engine. The gpu backend is one numeric path by design
("gpu-prefill+cpu:<isa>"): its snapshots are taken after GPU prefill and restored into CPU decode, as its own
cold runs hand the state from one to the other.
"""

from .cache import Hit, PrefixCache
from .disk import SnapshotWarning
from .layout import StateLayout
from .snapshot import Snapshot

__all__ = ["Hit", "PrefixCache", "Snapshot", "SnapshotWarning", "StateLayout"]

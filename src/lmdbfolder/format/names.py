"""Every file and directory name a pack, or work on one, puts on disk."""

from __future__ import annotations

# -- names on disk ------------------------------------------------------------------
# Every file and directory name a pack, or work on one, puts on disk. Only
# ``lmdbfolder.packdir`` decides what they mean for a path (what kind of pack
# it is, whether it may be replaced); everything else asks it.
DATA_FILE = "data.mdb"
LOCK_FILE = "lock.mdb"
#: The readable report of the source files that were not packed (in the pack).
SKIPPED_REPORT = "skipped.txt"
#: An unfinished pack is built in ``<dst>.partial`` and renamed when complete.
PARTIAL_SUFFIX = ".partial"
#: ``lmdbfolder copy`` builds the copy in ``<dst>.copying``.
COPYING_SUFFIX = ".copying"
#: A pack being replaced is moved to ``<dst>.old-<pid>`` until the new one is in place.
OLD_SUFFIX = ".old-"
#: Written first into every temporary directory we create (``.copying``), so
#: that a later run can prove the directory is ours before removing it.
TEMP_MARKER = ".lmdbfolder-temp"
#: Left in an unfinished pack by a run killed at the wrong moment: the writer's
#: fdatasync probe file and its compaction folder.
SYNC_PROBE = ".sync-probe"
COMPACT_DIR = "compact.tmp"
#: In a shard whose index names a version an update is about to end (an update of it
#: was interrupted before the new index, and a second run changes it again): its
#: ``data.mdb`` as it was, kept until the new index is in place, so that readers of the
#: index find the version it names (``packfile.open_version``).
RETAINED_FILE = "retained.mdb"
#: ``<file>.parts``: the journal of a resumable download (``lmdbfolder.remote.download``):
#: the parts of ``<file>`` already on disk, one number a line after a JSON header.
PARTS_SUFFIX = ".parts"
#: ``.needs-<pid>-<n>``: in a staging cache, the shards one sampler of a rank still needs this epoch
#: (held with a shared flock by that rank while it lives).
NEEDS_PREFIX = ".needs-"
#: ``.room.lock``: in a staging cache, held (flock, exclusive) while one process
#: decides what to evict to make room for a download, so two downloads that start
#: at once count each other.
ROOM_LOCK = ".room.lock"
#: ``<dst>.lock``: held (flock) by the ``pack`` writing ``<dst>`` for its whole
#: run, holding that process's id; removed when it ends.
WRITER_LOCK_SUFFIX = ".lock"
#: ``pack --update`` reads the changed files into ``<dst>.update`` (a small LMDB
#: with a checkpoint, or one per shard), then changes ``<dst>`` in one transaction.
UPDATE_SUFFIX = ".update"
#: Keys by which the folder2lmdb recipes' LMDBs are recognised (pickled
#: samples; ``lmdbfolder import`` converts them), and the files beside
#: ``data.mdb`` that mark a BasicSR-style image LMDB.
LEGACY_KEYS = (b"__keys__", b"__len__")
LEGACY_META_FILES = ("meta_info.txt", "meta_info.pkl")
#: A sharded pack is a directory holding ordinary packs (the shards, each a
#: complete pack of a contiguous part of the sample list) and this index.
SHARD_INDEX_FILE = "index.json"
#: The index is written here first, then renamed to SHARD_INDEX_FILE.
SHARD_INDEX_TMP = ".index.json.tmp"

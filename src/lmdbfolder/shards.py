"""Old import path of ``lmdbfolder.write.shards`` (kept so that existing imports keep working)."""

from lmdbfolder.write.shards import *  # noqa: F403
from lmdbfolder.write.shards import __all__  # noqa: F401

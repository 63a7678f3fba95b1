"""Old import path of ``lmdbfolder.read.sharded`` (kept so that existing imports keep working)."""

from lmdbfolder.read.sharded import *  # noqa: F403
from lmdbfolder.read.sharded import __all__  # noqa: F401

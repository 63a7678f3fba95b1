"""Old import path of ``lmdbfolder.write.sources`` (kept so that existing imports keep working)."""

from lmdbfolder.write.sources import *  # noqa: F403
from lmdbfolder.write.sources import __all__  # noqa: F401

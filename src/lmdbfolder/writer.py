"""Old import path of ``lmdbfolder.write.writer`` (kept so that existing imports keep working)."""

from lmdbfolder.write.writer import *  # noqa: F403
from lmdbfolder.write.writer import __all__  # noqa: F401

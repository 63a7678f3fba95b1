"""Old import path of ``lmdbfolder.read.reader`` (kept so that existing imports keep working)."""

from lmdbfolder.read.reader import *  # noqa: F403
from lmdbfolder.read.reader import __all__  # noqa: F401

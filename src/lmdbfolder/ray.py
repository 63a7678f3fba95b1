"""Old import path of ``lmdbfolder.write.ray`` (kept so that existing imports keep working)."""

from lmdbfolder.write.ray import *  # noqa: F403
from lmdbfolder.write.ray import __all__  # noqa: F401

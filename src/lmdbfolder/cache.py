"""Old import path of ``lmdbfolder.tools.cache`` (kept so that existing imports keep working)."""

from lmdbfolder.tools.cache import *  # noqa: F403
from lmdbfolder.tools.cache import __all__  # noqa: F401

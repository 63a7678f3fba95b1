"""Old import path of ``lmdbfolder.tools.copy`` (kept so that existing imports keep working)."""

from lmdbfolder.tools.copy import *  # noqa: F403
from lmdbfolder.tools.copy import __all__  # noqa: F401

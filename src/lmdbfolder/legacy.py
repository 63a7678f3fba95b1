"""Old import path of ``lmdbfolder.tools.importing`` (kept so that existing imports keep working)."""

from lmdbfolder.tools.importing import *  # noqa: F403
from lmdbfolder.tools.importing import __all__  # noqa: F401

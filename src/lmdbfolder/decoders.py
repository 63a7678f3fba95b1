"""Old import path of ``lmdbfolder.read.decoders`` (kept so that existing imports keep working)."""

from lmdbfolder.read.decoders import *  # noqa: F403
from lmdbfolder.read.decoders import __all__  # noqa: F401

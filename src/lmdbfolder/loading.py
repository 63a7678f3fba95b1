"""Old import path of ``Resize`` (now ``lmdbfolder.write.options``, also ``lmdbfolder.Resize``) and of
``lmdbfolder.write.records`` (kept so that existing imports keep working)."""

from lmdbfolder.write.options import Resize  # noqa: F401
from lmdbfolder.write.records import *  # noqa: F403
from lmdbfolder.write.records import __all__ as _records_all

__all__ = ["Resize", *_records_all]

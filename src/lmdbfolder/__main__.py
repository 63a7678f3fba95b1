"""``python -m lmdbfolder``: the same as the ``lmdbfolder`` command."""

from lmdbfolder.cli import console

raise SystemExit(console())

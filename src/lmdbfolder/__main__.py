"""``python -m lmdbfolder``: the same as the ``lmdbfolder`` command."""

from lmdbfolder.cli import main

raise SystemExit(main())

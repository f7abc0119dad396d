"""``python -m meshforge`` runs the ``meshforge`` command."""

from meshforge.cli import main

main()

"""``python -m fdplug.cli``: the ``fdplug`` command."""

from fdplug.cli import main

main()

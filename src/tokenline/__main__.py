"""``python -m tokenline``: the command line."""

from .cli import main

main()

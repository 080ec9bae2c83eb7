"""``python -m ec_cache``: the ``ec-cache`` command line."""

from ._cli import main

main()

"""``python -m nanguard ARGS``: the ``nanguard`` command the package carries."""
from ._cli import main

main()

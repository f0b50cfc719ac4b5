"""``python -m kvstore``: the ``kvstore`` command (:func:`kvstore.cli.main`)."""

import sys

from kvstore.cli import main

if __name__ == "__main__":
    sys.exit(main())

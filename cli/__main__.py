"""``python -m kvstore.cli``: the ``kvstore`` command."""

import sys

from kvstore.cli import main

if __name__ == "__main__":
    sys.exit(main())

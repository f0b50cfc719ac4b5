"""The tier vocabulary, under the name the project uses: ``from kvstore import tiers``.

The table is defined once, in :mod:`kvstore.formats.tiers` (numpy only, so that the ``.coli_kv``
layouts can name tiers and ``kvstore.gpu`` can import it without the store); this module re-exports
it: ``tiers.parse("fp8")``, ``tiers.INT4``, ``tiers.get("polar3")``, ``tiers.names()``.
"""

from kvstore.formats.tiers import *  # noqa: F403
from kvstore.formats.tiers import __all__  # noqa: F401

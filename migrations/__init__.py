"""Format conversions between ``.coli_kv`` versions and versioned schema steps for the index."""

from kvstore.migrations.errors import IndexSchemaError, MigrationError, NoMigrationPath  # noqa: F401
from kvstore.migrations.formats import (  # noqa: F401
    REGISTRY,
    Step,
    convert,
    convert_chunks,
    is_lossy,
    plan,
)

"""One APIRouter per module: health, sessions, files, lookup, jobs."""

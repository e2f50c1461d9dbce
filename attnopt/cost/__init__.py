"""The cost model: kernel cost (bytes, waves, merges, launches) and collective cost (alpha-beta)."""
from . import kernel  # noqa: F401

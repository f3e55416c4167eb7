"""External memories: parsing samples, building (f(c), y) entries, storing them on disk."""

"""An index's life: its manifest, the catalog of indexes in a home, opening one for reading or
writing, and its profile (health, counts, backends)."""

"""Rank fusion: pure functions over ranked id lists. No Ray, no I/O, no imports of ours."""

from branchsearch.fusion.documents import fuse_documents
from branchsearch.fusion.rrf import FusedItem, rrf

__all__ = ["FusedItem", "fuse_documents", "rrf"]

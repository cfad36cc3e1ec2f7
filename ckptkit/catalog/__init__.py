"""The format-free model of a checkpoint (entries → chunks → byte records, validated once), the
exact coverage check of chunk boxes, the DataFrames built from it, and the names outputs get."""

from .model import Catalog, CatalogBuilder, Chunk, Encoding, Entry, Facts, Record

__all__ = ["Catalog", "CatalogBuilder", "Chunk", "Encoding", "Entry", "Facts", "Record"]

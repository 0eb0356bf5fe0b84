"""Importers: graphs captured by other tools, turned into refine's graph format."""

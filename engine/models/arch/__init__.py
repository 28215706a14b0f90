"""One module per architecture family; each defines `SPECS: list[ArchSpec]` (see engine/models/registry.py)."""

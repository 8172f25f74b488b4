"""The layer-granular checkpoint format (see `manifest` for the layout on disk)."""

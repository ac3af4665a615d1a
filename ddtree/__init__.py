"""DDTree Serve: DFlash draft trees verified in one target pass, batched across requests."""

__version__ = "0.1.0"

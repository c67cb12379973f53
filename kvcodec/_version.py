"""The package version (a leaf module: the container records it in every file it writes)."""

__version__ = "0.1.0"

"""servelm's version: one leaf module, so any layer can report it without importing the package root."""

__version__ = "0.1.0"

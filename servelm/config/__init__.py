"""One typed config tree: the engine's settings (`engine`), the server's (`settings`), and the helpers that
turn them into command-line flags (`args`). Everything above the model layer reads its settings from here."""

from servelm.config.engine import ConfigError, EngineConfig

__all__ = ["ConfigError", "EngineConfig"]

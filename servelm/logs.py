"""How each servelm process sets up Python's logging: plain lines on stderr, or, with --log-config-file, the
operator's own configuration (logging.config's dictionary schema, as JSON or YAML; vLLM's --log-config-file and
VLLM_LOGGING_CONFIG_PATH take the same files), applied alike in the API process, the engine processes and the
tensor-parallel ranks."""

from __future__ import annotations

import json
import logging
import logging.config
from pathlib import Path

_configured: set[str] = set()  # the loggers the operator's file names (besides the root)


def read_config(path: str) -> dict:
    """The logging configuration in `path`: a JSON or YAML mapping in logging.config's dictionary schema
    (version 1). ValueError naming the file and what is wrong with it."""
    p = Path(path).expanduser()
    try:
        text = p.read_text()
    except OSError as e:
        raise ValueError(f"log config file {path}: cannot be read ({e.strerror or e})") from None
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:
        raise ValueError(f"log config file {path}: not valid {'YAML' if p.suffix in ('.yaml', '.yml') else 'JSON'} "
                         f"({e})") from None
    if not isinstance(data, dict) or data.get("version") != 1:
        raise ValueError(f"log config file {path}: a mapping in logging.config's dictionary schema with "
                         '"version": 1 (https://docs.python.org/3/library/logging.config.html)')
    return data


def configure_logging(log_config_file: str | None, fmt: str | None = None) -> None:
    """The operator's configuration from `log_config_file`; without one, plain `fmt` lines on stderr at INFO
    (None: the process's logging as it is). Loggers the file does not name keep working (existing ones are not
    disabled unless the file says so)."""
    if log_config_file is None:
        if fmt is not None:
            logging.basicConfig(level=logging.INFO, format=fmt)
        return
    data = read_config(log_config_file)
    data.setdefault("disable_existing_loggers", False)
    try:
        logging.config.dictConfig(data)
    except (ValueError, TypeError, AttributeError, ImportError) as e:
        raise ValueError(f"log config file {log_config_file}: {e}") from None
    _configured.update(data.get("loggers") or ())


def named_in_log_config(name: str) -> bool:
    """Whether the operator's logging configuration names logger `name` (servelm then leaves it as set)."""
    return name in _configured

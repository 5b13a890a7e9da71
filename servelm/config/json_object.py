"""Settings given as a JSON object (on the command line, in the environment) or as a mapping (in a file)."""

from __future__ import annotations

import json


def parse_json_object(value: str | dict, example: str) -> dict:
    """`value` as a dict: a mapping as it is, a string parsed as JSON. ValueError (naming `example`, a JSON object
    the setting takes) for anything else."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"a JSON object such as '{example}'")
    return value

"""API keys: who is calling, what they may do, and their limits.

Keys come from `--api-key` (one key) or `--api-keys-file` (YAML or JSON). A file may store a key or only
its hash (`key_hash: sha256:<hex>`) and may list the key's `groups` (what traffic segment rules match); either way only SHA-256 digests are kept in memory, and a presented
key is compared against every digest with `hmac.compare_digest`, so timing reveals nothing. Keys are
never logged; the key's `name` is what logs and metrics show.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from pathlib import Path

from servelm.config.settings import PRIORITIES

ANONYMOUS = "anonymous"


@dataclass(frozen=True)
class ApiKey:
    name: str
    digest: bytes
    rpm: int | None = None  # None: the server-wide default (admission.rate_limit_rpm)
    tpm: int | None = None
    priority: str | None = None  # None: admission.default_priority
    models: frozenset[str] | None = None  # None: every model
    allow_priority_raise: bool = False
    admin: bool = False
    groups: frozenset[str] = frozenset()  # the key's groups (tenants, cohorts): traffic segment rules match on them


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def hash_key(key: str) -> str:
    """The form to put in a keys file instead of the key itself."""
    return "sha256:" + digest(key).hex()


class KeyStore:
    """Resolves a presented key to its ApiKey; empty when the server runs without keys (open access)."""

    def __init__(self, keys: list[ApiKey], admin_digest: bytes | None = None) -> None:
        self.keys = keys
        self.admin_digest = admin_digest
        names = [k.name for k in keys]
        if len(set(names)) != len(names):
            raise ValueError("api key names must be unique")

    @classmethod
    def from_config(cls, api_key: str | None, api_keys_file: str | None, admin_key: str | None) -> KeyStore:
        keys = [ApiKey("default", digest(api_key))] if api_key else []
        if api_keys_file:
            keys += load_keys_file(api_keys_file)
        return cls(keys, digest(admin_key) if admin_key else None)

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def lookup(self, presented: str | None) -> ApiKey | None:
        if not presented:
            return None
        d = digest(presented)
        found = None
        for k in self.keys:  # no early exit: the time taken does not depend on which key matched
            if hmac.compare_digest(k.digest, d):
                found = k
        return found

    def is_admin(self, presented: str | None) -> bool:
        if not presented:
            return False
        d = digest(presented)
        ok = self.admin_digest is not None and hmac.compare_digest(self.admin_digest, d)
        key = self.lookup(presented)
        return ok or (key is not None and key.admin)


def load_keys_file(path: str) -> list[ApiKey]:
    """Parse a keys file: a list of entries, or {"keys": [...]}; raise ValueError naming the bad entry."""
    text = Path(path).read_text()
    if path.endswith(".json"):
        data = json.loads(text)
    else:
        import yaml

        data = yaml.safe_load(text)
    entries = data.get("keys") if isinstance(data, dict) else data
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a list of keys (or a mapping with 'keys')")
    allowed = {"name", "key", "key_hash", "rpm", "tpm", "priority", "models", "allow_priority_raise", "admin",
               "groups"}
    keys = []
    for i, e in enumerate(entries):
        where = f"{path}: key #{i + 1}"
        if not isinstance(e, dict) or not e.get("name"):
            raise ValueError(f"{where}: each key needs a name")
        where = f"{path}: key {e['name']!r}"
        unknown = set(e) - allowed
        if unknown:
            raise ValueError(f"{where}: unknown fields {sorted(unknown)}; allowed: {sorted(allowed)}")
        if ("key" in e) == ("key_hash" in e):
            raise ValueError(f"{where}: give exactly one of key or key_hash")
        if "key" in e:
            d = digest(str(e["key"]))
        else:
            h = str(e["key_hash"]).removeprefix("sha256:")
            try:
                d = bytes.fromhex(h)
            except ValueError:
                d = b""
            if len(d) != 32:
                raise ValueError(f"{where}: key_hash must be sha256:<64 hex digits>")
        for lim in ("rpm", "tpm"):
            if e.get(lim) is not None and (not isinstance(e[lim], int) or e[lim] < 1):
                raise ValueError(f"{where}: {lim} must be a positive integer, got {e[lim]!r}")
        if e.get("priority") is not None and e["priority"] not in PRIORITIES:
            raise ValueError(f"{where}: priority must be one of {', '.join(PRIORITIES)}, got {e['priority']!r}")
        models = e.get("models")
        if models is not None and not (isinstance(models, list) and all(isinstance(m, str) for m in models)):
            raise ValueError(f"{where}: models must be a list of model ids")
        groups = e.get("groups")
        if groups is not None and not (isinstance(groups, list) and all(isinstance(g, str) and g for g in groups)):
            raise ValueError(f"{where}: groups must be a list of non-empty group names")
        keys.append(ApiKey(str(e["name"]), d, e.get("rpm"), e.get("tpm"), e.get("priority"),
                           frozenset(models) if models is not None else None,
                           bool(e.get("allow_priority_raise", False)), bool(e.get("admin", False)),
                           frozenset(groups or ())))
    return keys


def presented_key(headers) -> str | None:
    """The key from `Authorization: Bearer <key>` or `x-api-key: <key>`."""
    auth = headers.get("authorization")
    if auth:
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    return headers.get("x-api-key") or None

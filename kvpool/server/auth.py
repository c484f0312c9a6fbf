"""API keys and tenants. Without keys, every request is the one anonymous tenant (no cache
salt: all requests share prefixes). With keys, each key names a tenant whose requests
carry the salt ``tenant:<name>``: equal prompts of two tenants never share a block, so one
tenant can neither hit nor time another's cached prefixes. Prefixes pinned as ``shared``
(by an admin) are the exception every tenant may use.

Keys file: one key per line, ``<key>`` or ``<tenant> <key>`` or ``<tenant> <key> admin``;
``#`` starts a comment. Keys given with ``--api-key`` are admins (may reset the cache and
pin shared prefixes).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Tenant:
    name: str
    admin: bool

    @property
    def salt(self) -> str | None:
        return None if self.name == "" else f"{SALT_PREFIX}{self.name}"


ANONYMOUS = Tenant("", admin=True)
SALT_PREFIX = "tenant:"


def tenant_name(salt: str | bytes | None) -> str:
    """The tenant name a cache salt belongs to ("" for none: anonymous or shared)."""
    if isinstance(salt, bytes):
        salt = salt.decode()
    return salt[len(SALT_PREFIX) :] if salt and salt.startswith(SALT_PREFIX) else ""


class KeyRing:
    def __init__(self, keys: dict[str, Tenant]) -> None:
        self._keys = keys

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    @classmethod
    def load(cls, api_keys: list[str] | None = None, keys_file: Path | None = None) -> KeyRing:
        keys: dict[str, Tenant] = {}
        for key in api_keys or []:
            keys[key] = Tenant(_default_name(key), admin=True)
        if keys_file is not None:
            for number, line in enumerate(Path(keys_file).read_text().splitlines(), 1):
                fields = line.split("#", 1)[0].split()
                if not fields:
                    continue
                if len(fields) == 1:
                    keys[fields[0]] = Tenant(_default_name(fields[0]), admin=False)
                elif len(fields) == 2 or (len(fields) == 3 and fields[2] == "admin"):
                    keys[fields[1]] = Tenant(fields[0], admin=len(fields) == 3)
                else:
                    raise ValueError(f"{keys_file}:{number}: expected '[tenant] key [admin]'")
        return cls(keys)

    def tenant(self, authorization: str | None, api_key: str | None = None) -> Tenant | None:
        """The tenant of an ``Authorization: Bearer <key>`` header, else of an
        ``x-api-key`` header (Anthropic's clients send their key there); None if neither
        is valid. Without keys everyone is the anonymous tenant."""
        if not self._keys:
            return ANONYMOUS
        if authorization and authorization.lower().startswith("bearer "):
            found = self._match(authorization[7:].strip())
            if found is not None:
                return found
        return self._match(api_key.strip()) if api_key else None

    def _match(self, key: str) -> Tenant | None:
        given = key.encode()
        found = None
        for known, tenant in self._keys.items():  # compare all, in constant time each
            if hmac.compare_digest(known.encode(), given):
                found = tenant
        return found


def _default_name(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]

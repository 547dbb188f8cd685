# API keys (--api-key KEY[:TIER],KEY[:TIER],...): the keys an api takes, any of them (so
# that a key is rotated without a moment refusing both), each with the most urgent service
# tier its requests may run at. A request asking for a more urgent tier than its key's runs
# at its key's, as OpenAI runs a project's request for a tier it lacks, and the response
# names the tier used. A key naming no tier may ask for any. Stored responses are scoped
# to the key that stored them (KEY_ID): another key does not find them.

from __future__ import annotations

import hashlib
import hmac
from contextvars import ContextVar

from pipeline.errors import ConfigError, Unauthorized
from pipeline.streams import TIERS

# the most urgent tier the request's key allows (None: any); set by the api's guard in the
# request's own task, read where its tier is chosen
TIER_LIMIT: ContextVar[str | None] = ContextVar("tier_limit", default=None)
# the request's key, as a digest (never the key itself); None where the api takes any request
KEY_ID: ContextVar[str | None] = ContextVar("key_id", default=None)


class ApiKeys:
    def __init__(self, spec: str | None):
        # (the Authorization header, its tier limit, its digest: KEY_ID)
        self.keys: list[tuple[bytes, str | None, str]] = []
        for entry in (spec or "").split(","):
            key, _, tier = entry.partition(":")
            if tier and tier not in TIERS:
                raise ConfigError(f"--api-key: {tier!r} is no service tier (KEY:TIER, TIER one "
                                  f"of {', '.join(TIERS)}; a key cannot hold ':')")
            if key:
                header = b"Bearer " + key.encode()
                self.keys.append((header, tier or None, hashlib.sha256(header).hexdigest()[:32]))

    def __bool__(self) -> bool:
        return bool(self.keys)

    def check(self, authorization: bytes) -> tuple[str | None, str]:
        """The tier limit of the key `authorization` carries, and the key's digest
        (KEY_ID); Unauthorized if none."""
        # every key compared, so the time taken does not say which one came near
        matched = [hmac.compare_digest(authorization, key) for key, _, _ in self.keys]
        if not any(matched):
            raise Unauthorized("a valid API key is required: Authorization: Bearer <key>")
        _, limit, digest = self.keys[matched.index(True)]
        return limit, digest


def service_tier(requested: str | None) -> str:
    """The tier a request runs at: the one it asked for ("auto" or none: "default"),
    but none more urgent than its key allows (TIER_LIMIT)."""
    tier = "default" if requested in (None, "auto") else requested
    limit = TIER_LIMIT.get()
    return limit if limit is not None and TIERS.index(limit) > TIERS.index(tier) else tier

"""Where stored responses of /v1/responses live: this process's memory, or Redis when the server has a
redis_url, so that every replica behind a load balancer reads and continues the same responses. Each is visible
only to the API key that made it and kept for responses_store_ttl_s (in memory, also at most
responses_store_size of them, the oldest going first)."""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from servelm.server.openai.protocol import APIError

logger = logging.getLogger(__name__)


@dataclass
class Stored:
    owner: str  # the API key's name: only that key reads or continues it
    response: dict
    conversation: list[dict]  # its input (with what it continued) and its output, as chat messages


def _missing(rid: str, param: str | None, where: str) -> APIError:
    return APIError(404, f"no stored response with id {rid!r} (responses are kept {where} for the API key that "
                         "made them)", param, "response_not_found")


class ResponseStore(Protocol):
    async def put(self, rid: str, item: Stored) -> None: ...

    async def get(self, rid: str, owner: str, param: str | None = None) -> Stored:
        """The response, or a 404 (another key's response is as absent as a missing one)."""

    async def delete(self, rid: str, owner: str) -> None: ...


class MemoryResponseStore:
    """Finished responses by id, the oldest dropped beyond `capacity` or after `ttl_s`. A stored conversation fit
    the model's context, so each entry is bounded by it, and the store by capacity x context."""

    def __init__(self, capacity: int, ttl_s: float, clock=time.monotonic) -> None:
        self.capacity, self.ttl_s, self.clock = capacity, ttl_s, clock
        self._items: OrderedDict[str, tuple[float, Stored]] = OrderedDict()

    async def put(self, rid: str, item: Stored) -> None:
        if self.capacity < 1:
            return
        self._items[rid] = (self.clock(), item)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    async def get(self, rid: str, owner: str, param: str | None = None) -> Stored:
        entry = self._items.get(rid)
        if entry is not None and self.ttl_s and self.clock() - entry[0] > self.ttl_s:
            del self._items[rid]
            entry = None
        if entry is None or entry[1].owner != owner:
            raise _missing(rid, param, f"in memory, at most {self.capacity},")
        return entry[1]

    async def delete(self, rid: str, owner: str) -> None:
        await self.get(rid, owner)
        del self._items[rid]


class RedisResponseStore:
    """The responses in Redis, one JSON value per response under `prefix` + id, expiring after `ttl_s`. A read
    that cannot reach Redis is a 503; a write that cannot is logged (the response was made and is answered, but
    cannot be continued)."""

    def __init__(self, url: str, ttl_s: float, timeout_s: float, prefix: str = "servelm:resp:") -> None:
        import redis
        import redis.asyncio as aredis

        from servelm.server.middleware.ratelimit import _host_of

        self._errors = (redis.RedisError, OSError)
        self._redis = aredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.ttl_s, self.prefix, self.where = ttl_s, prefix, _host_of(url)

    def _unreachable(self, e: BaseException) -> APIError:
        return APIError(503, f"the response store (Redis at {self.where}) cannot be reached: {e}",
                        code="response_store_unavailable")

    async def put(self, rid: str, item: Stored) -> None:
        value = json.dumps({"owner": item.owner, "response": item.response, "conversation": item.conversation})
        try:
            await self._redis.set(self.prefix + rid, value, ex=max(1, int(self.ttl_s)) if self.ttl_s else None)
        except self._errors as e:
            logger.error("response %s not stored: the response store (Redis at %s) cannot be reached: %s", rid,
                         self.where, e)

    async def get(self, rid: str, owner: str, param: str | None = None) -> Stored:
        try:
            raw = await self._redis.get(self.prefix + rid)
        except self._errors as e:
            raise self._unreachable(e) from e
        item = None if raw is None else Stored(**json.loads(raw))
        if item is None or item.owner != owner:
            raise _missing(rid, param, "in the shared store")
        return item

    async def delete(self, rid: str, owner: str) -> None:
        await self.get(rid, owner)
        try:
            await self._redis.delete(self.prefix + rid)
        except self._errors as e:
            raise self._unreachable(e) from e


def store_for(server_config) -> ResponseStore:
    """Redis when the server has a redis_url (shared by its replicas), else this process's memory."""
    api, storage = server_config.api_config, server_config.storage_config
    if storage.redis_url and api.responses_store_size > 0:
        return RedisResponseStore(storage.redis_url, api.responses_store_ttl_s, storage.redis_timeout_s)
    return MemoryResponseStore(api.responses_store_size, api.responses_store_ttl_s)

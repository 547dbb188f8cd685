# Stored responses (the Responses API's `store`, on by default): each response is kept in
# Redis for --response-ttl-s under {prefix}:response:{id}, with the items of the
# conversation it answered (a previous response's items and output, then its own input),
# so that `previous_response_id` continues that conversation on any api of the tier, and
# GET /v1/responses/{id}, its input_items and DELETE find it. One key a response, written
# once; a continuation copies the items it builds on, so an expiry never breaks a chain.
# Under --api-key each response belongs to the key that stored it: to any other key
# (a rotated one included) it is not found, as an unknown id is.

from __future__ import annotations

import uuid

import msgspec
from redis.asyncio import Redis

from pipeline.errors import InvalidRequest, NotFound
from pipeline.streams import Keys

ITEM_KINDS = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
              "reasoning": "rs"}  # an item's id starts with its kind's


class Stored(msgspec.Struct):
    response: dict  # as GET /v1/responses/{id} gives it
    items: list[dict]  # its input: the conversation before its output, each with an id
    owner: str | None = None  # the frontend running it, while a background one runs
    key: str | None = None  # the digest of the API key that stored it (keys.KEY_ID)
    streamed: bool = False  # a background one whose events are kept (responses_events.py)


class Store:
    """The stored responses one API key (`key`, a digest; None: the api takes any
    request) sees and writes."""

    def __init__(self, redis: Redis, keys: Keys, ttl_s: float, key: str | None):
        self.redis, self.keys, self.ttl_s, self.key = redis, keys, ttl_s, key

    async def get(self, response_id: str, param: str | None = None) -> Stored:
        """The stored response; NotFound (404), or with `param` an InvalidRequest
        naming it (400, as OpenAI answers an unknown previous_response_id)."""
        raw = await self.redis.get(self.keys.response(response_id))
        if raw is not None and (stored := msgspec.json.decode(raw, type=Stored)).key == self.key:
            return stored
        detail = f"no stored response has the id {response_id!r}: it was never stored, " \
                 "has expired or was deleted"
        if param is not None:
            raise InvalidRequest(detail, param=param)
        raise NotFound(detail)

    async def put(self, stored: Stored) -> None:
        await self.redis.set(self.keys.response(stored.response["id"]),
                             msgspec.json.encode(msgspec.structs.replace(stored, key=self.key)),
                             px=max(1, int(self.ttl_s * 1000)))

    def cancel_key(self, response_id: str) -> str:
        """Set while a cancel of a background response waits for its api."""
        return self.keys.response(response_id) + ":cancel"

    def events_key(self, response_id: str) -> str:
        """A streamed background response's events (api/responses_events.py)."""
        return self.keys.response(response_id) + ":events"

    async def delete(self, response_id: str) -> None:
        await self.get(response_id)  # its NotFound, another key's included
        if not await self.redis.delete(self.keys.response(response_id)):
            await self.get(response_id)  # deleted meanwhile
        await self.redis.delete(self.events_key(response_id))


def history(previous: Stored | None) -> list[dict]:
    """The items a continuation of `previous` starts from: its input, then its output."""
    return [] if previous is None else [*previous.items, *previous.response["output"]]


def with_ids(items: list[dict]) -> list[dict]:
    """`items` as OpenAI lists them: each with its type and an id (its own, or a fresh
    one of its kind's), a message's text as a list of parts."""
    return [_normal(item) for item in items]


def _normal(item: dict) -> dict:
    kind = item.get("type", "message")
    item = {"id": f"{ITEM_KINDS.get(kind, 'item')}_{uuid.uuid4().hex}", "type": kind, **item}
    if kind == "message" and isinstance(item.get("content"), str):
        part = "output_text" if item.get("role") == "assistant" else "input_text"
        item["content"] = [{"type": part, "text": item["content"]}]
    return item


def page(items: list[dict], limit: int, order: str, after: str | None) -> dict:
    """GET /v1/responses/{id}/input_items: a page of `items` in `order` (desc: the
    latest first), the `limit` after the item `after`."""
    ordered = items[::-1] if order == "desc" else items
    if after is not None:
        at = next((i for i, item in enumerate(ordered) if item.get("id") == after), None)
        if at is None:
            raise InvalidRequest(f"no input item has the id {after!r}", param="after")
        ordered = ordered[at + 1:]
    data = ordered[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(ordered) > limit}

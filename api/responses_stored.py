# The routes of stored responses (api/responses_store.py): GET /v1/responses/{id} (a
# streamed background one's events too: api/responses_events.py), its input_items, DELETE,
# and POST .../cancel for a background one (api/responses_background.py).

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query

from api.keys import KEY_ID
from api.responses_background import as_now, cancel
from api.responses_events import as_is, follow
from api.responses_store import Store, page
from api.served import Served, served
from api.streaming import EventStream
from pipeline.errors import InvalidRequest

router = APIRouter()
ServedDep = Annotated[Served, Depends(served)]


def store_of(s: Served) -> Store:
    return Store(s.frontend.client.redis, s.frontend.keys, s.config.response_ttl_s,
                 KEY_ID.get())


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, s: ServedDep, stream: bool = False,
                       starting_after: Annotated[int | None, Query(ge=0)] = None):
    """The response as it stands; `stream`: a streamed background one's events, those
    after `starting_after` (a sequence number) first, then each as it comes."""
    store = store_of(s)
    stored = await store.get(response_id)
    if not stream:
        return (await as_now(store, stored)).response
    if not stored.streamed:
        raise InvalidRequest("only a response created with both background and stream "
                             "can be streamed", param="stream")
    after = -1 if starting_after is None else starting_after
    return EventStream(follow(store, response_id, after), encode=as_is)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, s: ServedDep):
    await store_of(s).delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str, s: ServedDep,
                           limit: Annotated[int, Query(ge=1, le=100)] = 20,
                           order: Literal["asc", "desc"] = "desc", after: str | None = None):
    """The items the response answered (those it continued included), `order`
    desc (the latest first) by default, as OpenAI pages them."""
    return page((await store_of(s).get(response_id)).items, limit, order, after)


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, s: ServedDep):
    """A background response, stopped where it is (`cancelled`), or as it ended."""
    store = store_of(s)
    if not (await store.get(response_id)).response.get("background"):
        raise InvalidRequest("only a background response can be cancelled")
    return await cancel(store, response_id)

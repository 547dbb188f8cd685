# POST /tokenize and /detokenize, in vLLM's shapes: the served model's own tokenizer
# and chat template, so a client counts tokens (or checks a prompt fits) as the tier will.

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from api.chat_prompt import chat_prompt_ids
from api.protocol import DetokenizeRequest, TokenizeRequest
from api.sampling import check_token_ids
from api.served import Served, served

router = APIRouter()
ServedDep = Annotated[Served, Depends(served)]


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, s: ServedDep) -> dict:
    s.check_model(body.model)
    if body.messages is not None:
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []] or None
        ids = chat_prompt_ids(body.messages, s.tokenizer, body.add_generation_prompt, tools,
                              body.chat_template_kwargs)
    else:
        ids = s.tokenizer.encode(body.prompt or "")
    return {"count": len(ids), "max_model_len": s.limits.context_len, "tokens": ids}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, s: ServedDep) -> dict:
    s.check_model(body.model)
    check_token_ids("tokens", body.tokens, s.limits)
    return {"prompt": s.tokenizer.decode(body.tokens, skip_special_tokens=False)}

"""vLLM's score and rerank routes in the gateway, for the served model as an embedding model: a pair's score is
the cosine similarity of the two texts' embeddings (``/v1/embeddings``'s: each the last token's final hidden
state, normalized), as vLLM scores pairs with an embedding model.

``/score`` and ``/v1/score`` take ``text_1`` and ``text_2``, each a string or a list of strings: one against one,
one against each of several, or several pairwise (lists of equal length); the answer holds a ``score`` per pair.
``/rerank``, ``/v1/rerank`` and ``/v2/rerank`` (Jina's and Cohere's shape) take a ``query`` and ``documents`` (a
list of strings), and answer the documents by descending ``relevance_score``, each with its ``index`` in the
request and its ``document`` (``{"text": ...}``; Cohere's ``return_documents`` false leaves it out), the first
``top_n`` only when that is positive. Each distinct text is embedded once, by one router ``Embed`` call, at most
``--max-choices`` a request; both take ``model`` (a LoRA adapter too) and vLLM's ``truncate_prompt_tokens``,
``priority``, ``cache_salt``, ``add_special_tokens`` and ``request_id`` as ``/v1/embeddings`` does. The usage counts
the embedded texts' prompt tokens.
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from splitserve.common.scoring import cosine, pair_up


async def create_scores(gateway, request: Request) -> Response:
    """The ``/score`` answer for ``request`` through ``gateway``'s router client."""
    from splitserve.gateway import APIError

    body = await gateway._body(request)
    info, lora_name = await gateway._model_of(request, body)
    try:
        pairs = pair_up(_texts(body, "text_1"), _texts(body, "text_2"))
    except ValueError as error:
        raise APIError(400, f"{error} (text_1 is the first side, text_2 the second)", "text_1") from None
    request_id, scores, prompt_tokens = await _similarities(gateway, request, body, lora_name, "score-", pairs, "text_2")
    return JSONResponse({
        "id": request_id, "object": "list", "created": int(time.time()),
        "model": lora_name or gateway._model_name(info),
        "data": [{"index": index, "object": "score", "score": score} for index, score in enumerate(scores)],
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0},
    })


async def create_rerank(gateway, request: Request) -> Response:
    """The ``/rerank`` answer for ``request`` through ``gateway``'s router client."""
    from splitserve.gateway import APIError, _flag

    body = await gateway._body(request)
    info, lora_name = await gateway._model_of(request, body)
    query = body.get("query")
    if not isinstance(query, str):
        raise APIError(400, "query must be a string.", "query")
    documents = _texts(body, "documents", single=False)
    top_n = body.get("top_n", 0)
    if top_n is None:
        top_n = 0
    if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 0:
        raise APIError(400, "top_n must be an integer >= 0 (0: every document).", "top_n")
    return_documents = _flag(body, "return_documents", True)
    pairs = [(query, document) for document in documents]
    request_id, scores, prompt_tokens = await _similarities(gateway, request, body, lora_name, "rerank-", pairs, "documents")
    ranked = sorted(range(len(documents)), key=lambda index: -scores[index])  # stable: ties keep their order
    results = [{"index": index, **({"document": {"text": documents[index]}} if return_documents else {}),
                "relevance_score": scores[index]} for index in ranked[: top_n or None]]
    return JSONResponse({"id": request_id, "model": lora_name or gateway._model_name(info),
                         "usage": {"total_tokens": prompt_tokens}, "results": results})


def _texts(body: dict, field: str, single: bool = True) -> list[str]:
    """``body[field]``: a non-empty list of strings, or (``single``) one string."""
    from splitserve.gateway import APIError

    value = body.get(field)
    if single and isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value or not all(isinstance(text, str) for text in value):
        raise APIError(400, f"{field} must be {'a string or ' if single else ''}a non-empty list of strings.", field)
    return value


async def _similarities(gateway, request: Request, body: dict, lora_name: str | None, prefix: str,
                        pairs: list[tuple[str, str]], field: str) -> tuple[str, list[float], int]:
    """(the request's id, each pair's cosine similarity, the prompt tokens embedded): each distinct text embedded
    once, normalized."""
    from splitserve.gateway import _request_id
    from splitserve.gateway_embeddings import check_input_count, embed_all, embed_options

    texts = list(dict.fromkeys(text for pair in pairs for text in pair))
    check_input_count(gateway, len(texts), field, "the request holds {count} distinct texts")
    options = embed_options(body)
    request_id = _request_id(body, prefix, len(texts))
    answers = await embed_all(gateway, request, texts, request_id, lora_name, options)
    vectors = {text: answer.embedding for text, answer in zip(texts, answers)}
    scores = [cosine(vectors[first], vectors[second]) for first, second in pairs]
    return request_id, scores, sum(answer.prompt_tokens for answer in answers)

"""The one error shape every non-2xx answer has: `{"error": {"code", "message", "request_id", "details"?}}`.

Routes raise `ServiceError`; FastAPI's own errors (validation, 404/405, a body it cannot parse) and
anything unexpected are turned into the same shape here, so a client parses one body whatever failed.
The raw ASGI middleware, which answers before FastAPI runs (413, 429), builds its bodies with
`error_body` too.
"""

import json
import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's code: nobody reads it, but logs and metrics say what happened

# the code for errors raised by FastAPI/Starlette themselves, by status
_CODE_BY_STATUS = {
    400: "bad_request",
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
    422: "invalid_request",
    429: "overloaded",
    499: "client_closed_request",
    500: "internal_error",
    503: "unavailable",
    504: "deadline_exceeded",
}


class ServiceError(Exception):
    """An error the service answers on purpose: status, a stable machine-readable code, a sentence for people."""

    def __init__(self, status: int, code: str, message: str, *, headers: dict[str, str] | None = None):
        self.status, self.code, self.message, self.headers = status, code, message, headers or {}
        super().__init__(message)


class ErrorDetail(BaseModel):
    loc: list[str | int] = Field(description="Where in the request the problem is, e.g. ['body', 'texts', 1].")
    msg: str
    type: str


class ErrorInfo(BaseModel):
    code: str = Field(description="Stable, machine-readable: invalid_request, text_too_long, body_too_large, "
                                  "budget_exceeded, overloaded, client_closed_request, unavailable, "
                                  "shutting_down, deadline_exceeded, inference_failed, internal_error, ...")
    message: str = Field(description="What went wrong and what to do about it, for a person.")
    request_id: str = Field(description="The X-Request-ID of this request, as in the server's access log.")
    details: list[ErrorDetail] | None = Field(None, description="Validation errors, one per problem (422).")


class ErrorResponse(BaseModel):
    error: ErrorInfo


def error_body(code: str, message: str, request_id: str, details: list[dict] | None = None) -> bytes:
    error: dict[str, Any] = {"code": code, "message": message, "request_id": request_id}
    if details is not None:
        error["details"] = details
    # ensure_ascii: a message may quote client text, which must never fail to encode (lone surrogates)
    return json.dumps({"error": error}, ensure_ascii=True).encode()


def request_id_of(request: Request) -> str:
    return request.scope.get("state", {}).get("request_id", "-")


def error_response(
    request: Request, status: int, code: str, message: str, *, headers: dict[str, str] | None = None,
    details: list[dict] | None = None,
) -> Response:
    body = error_body(code, message, request_id_of(request), details)
    return Response(body, status_code=status, headers=headers, media_type="application/json")


def _safe_details(errors: list[dict]) -> list[dict]:
    """Pydantic's errors without `input`/`ctx`: those echo the client's data (NaN, lone surrogates, a 5,000-digit
    number), which the error body must never choke on, and the client already has its own request."""
    return [
        {"loc": [part if isinstance(part, int) else str(part) for part in error.get("loc", ())],
         "msg": str(error.get("msg", "")), "type": str(error.get("type", ""))}
        for error in errors
    ]  # fmt: skip


def invalid_request_body(errors: Sequence[Any], request_id: str) -> bytes:
    """The 422 body for validation errors (pydantic's or ours, `loc` starting at "body")."""
    details = _safe_details(list(errors))
    message = "; ".join(f"{'.'.join(map(str, d['loc']))}: {d['msg']}" for d in details) or "invalid request"
    return error_body("invalid_request", message, request_id, details)


def unparseable_body_message(cause: BaseException | None) -> str:
    """FastAPI answers 400 for a body json.loads raised on with anything but a JSONDecodeError; say which."""
    if isinstance(cause, UnicodeDecodeError):
        return "the request body is not valid UTF-8"
    if isinstance(cause, RecursionError):
        return "the request body's JSON is nested too deeply"
    if isinstance(cause, ValueError) and "digits" in str(cause):
        return "the request body holds an integer with too many digits"
    return "the request body is not valid JSON"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError) -> Response:
        return error_response(request, exc.status, exc.code, exc.message, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        return Response(invalid_request_body(exc.errors(), request_id_of(request)), status_code=422,
                        media_type="application/json")  # fmt: skip

    @app.exception_handler(Exception)  # Starlette's ServerErrorMiddleware answers with it, then re-raises to log
    async def _unexpected(request: Request, exc: Exception) -> Response:
        message = "the server failed on this request; the request id is in its log"
        return error_response(request, 500, "internal_error", message)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 400 and exc.detail == "There was an error parsing the body":
            # a body that is not JSON is an invalid request like any other malformed JSON: 422, as documented
            return error_response(request, 422, "invalid_request", unparseable_body_message(exc.__cause__))
        code = _CODE_BY_STATUS.get(exc.status_code, "error")
        return error_response(request, exc.status_code, code, str(exc.detail), headers=exc.headers)


def documented(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for a route: each status it can answer, all in the one error shape."""
    meaning = {
        400: "Not valid HTTP/1.1 (a malformed request line or header, two Content-Lengths); the connection closes.",
        408: "The request's headers or body did not arrive within the request deadline (a client that stalls or "
             "trickles).",
        413: "Body over the size limit, a text over the model's n_max tokens, or a /translate request over "
             "the compute budget (texts x beam_size x max_new_tokens).",
        422: "Invalid request: wrong types, unknown fields, empty or invisible text, text that is not valid "
             "Unicode, non-finite numbers, a body that is not JSON or is compressed (Content-Encoding).",
        429: "The server is at capacity; `Retry-After` says when to retry.",
        431: "The request line and headers are over the server's limit (64 KiB); the connection closes.",
        499: "The client closed the connection before the answer was ready (logged; nobody reads it).",
        500: "The model failed on this request's batch; other requests are unaffected.",
        503: "The model for this route is not configured, could not be loaded, or the server is draining.",
        504: "No answer within the request deadline (queue wait and compute).",
    }  # fmt: skip
    return {status: {"model": ErrorResponse, "description": meaning[status]} for status in statuses}

"""Errors a client sees: `APIError` (sent as OpenAI's error body) and the one-line messages of
request validation failures."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from specdec.server.protocol import ErrorResponse


class APIError(Exception):
    """An error a client caused (or a server state it should know of), sent as OpenAI's body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code


def error_response(
    status: int, message: str, type: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    body = ErrorResponse(error={"message": message, "type": type, "param": param, "code": code})
    return JSONResponse(body.model_dump(), status_code=status)


def _validation_error(errors: list[dict]) -> APIError:
    first = errors[0] if errors else {}
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    kind = first.get("type", "")
    if kind == "json_invalid":
        return APIError(400, "the request body is not valid JSON", code="invalid_json")
    if kind == "extra_forbidden":
        return APIError(
            400,
            f"the field {param!r} is not supported by this server (it is not silently ignored; "
            "leave it out)",
            param=param,
            code="unsupported_field",
        )
    if kind == "value_error":  # a validator's own message, which names what it checked
        return APIError(400, str(first.get("ctx", {}).get("error", "invalid request")), param=param)
    message = first.get("msg", "invalid request")
    return APIError(400, f"{param}: {message}" if param else message, param=param)

"""What every 4xx/5xx body must be: OpenAI's error shape, {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json

ERROR_FIELDS = frozenset({"message", "type", "param", "code"})


def error_shape_problem(status: int, text: str) -> str | None:
    """Why the body of a `status` answer is not OpenAI's error shape (None when it is, or it is no error)."""
    if status < 400:
        return None
    try:
        body = json.loads(text)
    except ValueError:
        return f"{status} body is not JSON: {text[:200]!r}"
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or not set(error) >= ERROR_FIELDS:
        return f"{status} body is not {{'error': {sorted(ERROR_FIELDS)}}}: {text[:200]!r}"
    if not isinstance(error["message"], str) or not isinstance(error["type"], str):
        return f"{status} error message/type are not strings: {text[:200]!r}"
    if error["param"] is not None and not isinstance(error["param"], str):
        return f"{status} error param is neither a string nor null: {text[:200]!r}"
    if not isinstance(error["code"], str) or not error["code"]:
        return f"{status} error has no stable code: {text[:200]!r}"  # clients branch on the code
    return None

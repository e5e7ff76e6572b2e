"""The rule for ids that a client or a peer sets: request ids and transfer ids.

An id is written into every log line of its request, so it is bounded and kept
to characters that cannot forge a log line: 1 to :data:`MAX_ID_LENGTH`
characters from ``[A-Za-z0-9._:#-]``. The router derives each attempt's worker
request id as ``<request_id>#<8 hex digits>``, so workers accept
:data:`ATTEMPT_SUFFIX_LENGTH` more characters than the router takes from a client.
"""

from __future__ import annotations

import re

from splitserve.common.errors import InvalidRequest

MAX_ID_LENGTH = 128
ATTEMPT_SUFFIX_LENGTH = len("#") + 8
MAX_WORKER_ID_LENGTH = MAX_ID_LENGTH + ATTEMPT_SUFFIX_LENGTH
ID_CHARACTERS = "A-Za-z0-9._:#-"
_ECHOED_CHARACTERS = 32

_VALID_ID = re.compile(f"[{ID_CHARACTERS}]+")


def check_id(value: str, field: str, max_length: int = MAX_ID_LENGTH) -> str:
    """Returns ``value`` if it is a valid id, else raises.

    Raises:
        InvalidRequest: empty, longer than ``max_length``, or a character outside
            ``[A-Za-z0-9._:#-]``; the sentence echoes at most the first 32 characters.
    """
    if value and len(value) <= max_length and _VALID_ID.fullmatch(value):
        return value
    shown = repr(value[:_ECHOED_CHARACTERS]) + ("..." if len(value) > _ECHOED_CHARACTERS else "")
    raise InvalidRequest(
        f"{field} {shown} ({len(value)} characters) is not a valid id: "
        f"use 1 to {max_length} characters from [{ID_CHARACTERS}]."
    )

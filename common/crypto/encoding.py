"""Canonical, injective byte encoding of field tuples.

Signature messages, AEAD associated data and session ids are built from several
fields; naive concatenation makes ("ab", "c") and ("a", "bc") collide, which lets one
signed statement be re-read as another. Each field is therefore encoded as
``type tag (1 byte) || length (4 bytes, big-endian) || payload``.
"""

from __future__ import annotations

from common.core.errors import ValidationError

_TAG_BYTES = b"\x01"
_TAG_STR = b"\x02"
_TAG_INT = b"\x03"
_MAX_FIELD_LENGTH = 2**32 - 1


def _int_payload(value: int) -> bytes:
    if value < 0:
        raise ValidationError("encode_fields: negative integers are not encodable")
    # Minimal unsigned big-endian; zero is the empty payload, which stays unambiguous
    # because the type tag and length are always present.
    return value.to_bytes((value.bit_length() + 7) // 8, "big")


def encode_fields(*fields: bytes | str | int) -> bytes:
    """Encode `fields` so that different field tuples never give the same bytes."""
    parts: list[bytes] = []
    for field in fields:
        # bool is a subclass of int; refusing it avoids True silently meaning 1.
        if isinstance(field, bool):
            raise ValidationError("encode_fields: bool is not an encodable field type")
        if isinstance(field, bytes | bytearray | memoryview):
            tag, payload = _TAG_BYTES, bytes(field)
        elif isinstance(field, str):
            tag, payload = _TAG_STR, field.encode("utf-8")
        elif isinstance(field, int):
            tag, payload = _TAG_INT, _int_payload(field)
        else:
            raise ValidationError(
                f"encode_fields: unsupported field type {type(field).__name__}"
            )
        if len(payload) > _MAX_FIELD_LENGTH:
            raise ValidationError("encode_fields: field longer than 2**32 - 1 bytes")
        parts.append(tag + len(payload).to_bytes(4, "big") + payload)
    return b"".join(parts)

"""Meshy's own controller protocol: msgpack only (never pickle), one request id per call.

A request is [MAGIC, msgpack({"op", "id", "args"})]; the reply is [msgpack({"id", "ok", "result"|"error"})].
The magic frame lets the controller tell Meshy requests from TransferQueue's own protocol on one socket.
"""

from typing import Any

import msgspec

MAGIC = b"MESHY/1"

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


def encode_request(op: str, request_id: int, args: dict[str, Any]) -> list[bytes]:
    return [MAGIC, _encoder.encode({"op": op, "id": request_id, "args": args})]


def decode_request(frame: bytes | memoryview) -> tuple[str, int, dict[str, Any]]:
    msg = _decoder.decode(frame)
    return msg["op"], msg["id"], msg["args"]


def encode_reply(request_id: int, result: Any) -> bytes:
    return _encoder.encode({"id": request_id, "ok": True, "result": result})


def encode_error(request_id: int, kind: str, message: str) -> bytes:
    return _encoder.encode({"id": request_id, "ok": False, "error": {"kind": kind, "message": message}})


def decode_reply(frame: bytes | memoryview) -> dict[str, Any]:
    return _decoder.decode(frame)

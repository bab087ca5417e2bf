"""JSON text in and out, as the json module writes and reads it, without importing it.

`import json` compiles json's regular expressions, so it imports re (with enum, functools,
collections): 10 ms of CPU of a launcher command's 45, and every host runs one for each `up`,
`status` and `down`. Both halves of json's work are done by its C accelerator, `_json`, which json
itself uses: `dumps` is json.dumps's one-shot encoder (c_make_encoder, with json.dumps's defaults:
ensure_ascii, ", " and ": ", check_circular, allow_nan), `loads` is json.loads's scanner
(c_make_scanner), with the whitespace around the document stripped as json.loads allows. Where
`_json` is missing or takes other arguments (an interpreter other than CPython), json itself does
it. What these write and read is exactly what json's dumps and loads write and read.
"""

from __future__ import annotations

TYPE_CHECKING = False  # (typing's, without its import: see dtf_server.protocol)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

_WHITESPACE = " \t\n\r"  # JSON's (RFC 8259), which json.loads skips around the document


def _not_serializable(o: Any) -> Any:
    raise TypeError(f"Object of type {o.__class__.__name__} is not JSON serializable")


class _Context:
    """What c_make_scanner reads of a json.JSONDecoder: json.loads's defaults."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int

    @staticmethod
    def parse_constant(name: str) -> float:
        return {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}[name]


def _encoder(separators: tuple[str, str]) -> Callable[[Any], str]:
    from _json import encode_basestring_ascii, make_encoder

    item, key = separators
    make_encoder({}, _not_serializable, encode_basestring_ascii, None, key, item, False, False, True)

    def encode(obj: Any) -> str:  # a fresh markers dict per call, as json.dumps makes
        if isinstance(obj, str):  # (the C encoder takes containers and scalars; json does strings itself)
            return encode_basestring_ascii(obj)
        return "".join(make_encoder({}, _not_serializable, encode_basestring_ascii, None, key, item,
                                    False, False, True)(obj, 0))

    return encode


def _scanner() -> Callable[[str], Any]:
    from _json import make_scanner

    scan = make_scanner(_Context)  # type: ignore[arg-type]  # (it reads the attributes: a class will do)

    def decode(text: str) -> Any:
        start = len(text) - len(text.lstrip(_WHITESPACE))
        try:
            obj, end = scan(text, start)
        except StopIteration as e:
            raise ValueError(f"Expecting value: char {e.value}") from None
        if text[end:].strip(_WHITESPACE):
            raise ValueError(f"Extra data: char {end}")
        return obj

    return decode


try:
    _compact = _encoder((",", ":"))
    _spaced = _encoder((", ", ": "))
    _decode = _scanner()
except (ImportError, TypeError, AttributeError):  # no accelerator, or another one: json's own
    import json

    def _compact(obj: Any) -> str:
        return json.dumps(obj, separators=(",", ":"))

    def _spaced(obj: Any) -> str:
        return json.dumps(obj)

    _decode = json.loads


def dumps(obj: Any, compact: bool = False) -> str:
    """json.dumps(obj), or with separators=(",", ":") where `compact`."""
    return _compact(obj) if compact else _spaced(obj)


def loads(text: str | bytes) -> Any:
    """json.loads(text); ValueError where it is not one JSON document."""
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode()
    return _decode(text)

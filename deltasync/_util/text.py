"""Free text from elsewhere, made safe to print: :func:`escape_text`."""

from __future__ import annotations

__all__ = ["escape_text"]

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(ch: str) -> str:
    if ch in _NAMED:
        return _NAMED[ch]
    n = ord(ch)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def escape_text(text: str) -> str:
    """``text`` with every character a terminal could act on written as an escape: controls (ESC,
    CR, LF, DEL, C1), format characters (bidi overrides and isolates, zero-width ones), line and
    paragraph separators, surrogates, private and unassigned code points, and spaces other than
    ``" "``: ``"\\x1b[2J"``, ``"\\u202e"``, ``"\\n"``. Printable text comes back unchanged (the same object)."""
    if text.isprintable():
        return text
    return "".join(ch if ch == " " or ch.isprintable() else _escape(ch) for ch in text)

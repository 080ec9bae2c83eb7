"""uvicorn's httptools protocol, answering what its HTTP parser refuses in JSON.

llhttp refuses some requests before the app can see them: raw non-ASCII bytes or spaces
in the request target, a malformed or repeated ``Content-Length``, bad chunked framing,
invalid header bytes. uvicorn then writes a plain-text 400 ("Invalid HTTP request
received.") and closes the connection; this subclass writes the same 400 with the
project's JSON error body (``{"error": "malformed_request", ...}``) instead.
"""

from __future__ import annotations

import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MALFORMED_BODY = json.dumps(
    {
        "error": "malformed_request",
        "message": "the HTTP parser refused the request: a malformed request line or target "
        "(raw non-ASCII bytes must be percent-encoded), header or body framing",
        "part": None,
    }
).encode()


class JSONErrorsHttpToolsProtocol(HttpToolsProtocol):
    def send_400_response(self, msg: str) -> None:
        content = [b"HTTP/1.1 400 Bad Request\r\n"]
        for name, value in self.server_state.default_headers:
            content.extend([name, b": ", value, b"\r\n"])
        content.extend(
            [
                b"content-type: application/json\r\n",
                b"content-length: " + str(len(MALFORMED_BODY)).encode("ascii") + b"\r\n",
                b"connection: close\r\n",
                b"\r\n",
                MALFORMED_BODY,
            ]
        )
        self.transport.write(b"".join(content))
        self.transport.close()

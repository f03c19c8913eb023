"""The console's static files (its stylesheet and scripts, htmx's and
uPlot's), read once from the package at start and served from memory.

Not Starlette's StaticFiles: it reads each file on a worker thread of
AnyIO's, which outlive the process's loop (the CLI then reports leaked
threads), and the files are a few hundred kilobytes that never change while
the process runs. Only ``.js`` and ``.css`` files are served; a path not in
the package is 404, with no file system lookup.
"""

from __future__ import annotations

import hashlib
from importlib import resources
from importlib.resources.abc import Traversable

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}


def _walk(folder: Traversable, prefix: str = "") -> dict[str, bytes]:
    found: dict[str, bytes] = {}
    for item in folder.iterdir():
        if item.is_dir():
            found.update(_walk(item, f"{prefix}{item.name}/"))
        elif any(item.name.endswith(suffix) for suffix in TYPES):
            found[f"{prefix}{item.name}"] = item.read_bytes()
    return found


class StaticFiles:
    """``GET /static/{path}`` from memory, with an ETag."""

    def __init__(self) -> None:
        self._files = _walk(resources.files("ingest.web") / "static")
        self._etags = {name: hashlib.sha256(body).hexdigest()[:20] for name, body in self._files.items()}

    async def serve(self, request: Request) -> Response:
        name = request.path_params["path"]
        body = self._files.get(name)
        if body is None:
            return PlainTextResponse("not found", status_code=404)
        etag = f'"{self._etags[name]}"'
        headers = {"ETag": etag, "Cache-Control": "no-cache"}
        if request.headers.get("if-none-match") == etag:
            return Response(status_code=304, headers=headers)
        suffix = name[name.rfind(".") :]
        return Response(body, media_type=TYPES[suffix], headers=headers)

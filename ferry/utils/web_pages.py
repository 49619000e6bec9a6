"""The pages ferry's servers ship (`ferry serve`'s playground, `ferry gateway`'s dashboard).

Plain HTML, CSS and JavaScript files inside the package: no build step, no
CDN, nothing fetched from elsewhere (the machines they run on often reach no
network). They are read once when the server starts and served with headers
that keep each page to its own origin: the page talks only to the server that
served it, runs only its own scripts, and cannot be framed. The pages render
model output as text or through their own escaping markdown renderer; the
Content-Security-Policy is the second wall, should that one ever crack.
"""

from __future__ import annotations

from importlib import resources

from starlette.responses import Response

_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


class WebPages:
    """The files of one page directory (`package`/`folder`), by name."""

    def __init__(self, package: str, folder: str) -> None:
        root = resources.files(package).joinpath(folder)
        self.files: dict[str, tuple[bytes, str]] = {}
        for entry in root.iterdir():
            suffix = "." + entry.name.rsplit(".", 1)[-1]
            if entry.is_file() and suffix in _TYPES:
                self.files[entry.name] = (entry.read_bytes(), _TYPES[suffix])

    def add_routes(self, app, page: str, page_file: str, files: str) -> None:
        """Serve `page_file` at the path `page` and every shipped file at `files`/NAME (a FastAPI app)."""

        async def page_route() -> Response:
            return self.response(page_file)

        async def file_route(name: str) -> Response:
            return self.response(name)

        app.add_api_route(page, page_route, methods=["GET"], include_in_schema=False)
        app.add_api_route(files + "/{name}", file_route, methods=["GET"], include_in_schema=False)

    def response(self, name: str) -> Response:
        """The file, or a 404 for any name it does not ship (no path is ever opened from a request)."""
        found = self.files.get(name)
        if found is None:
            return Response("not found", status_code=404, media_type="text/plain")
        body, media_type = found
        return Response(body, media_type=media_type, headers=HEADERS)

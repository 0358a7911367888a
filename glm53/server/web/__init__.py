"""The built-in page: ``GET /`` (a chat and the engine's dashboard), its assets under ``/assets/<digest>/`` and
``/favicon.ico``.

There is no build step: the assets are the files of ``assets/`` as they are (JavaScript modules, a stylesheet, an
icon). Their URLs carry a digest of all of them together, so a browser keeps them for a year and still never mixes
two versions after an upgrade; the modules import each other by relative URL, which keeps the digest without
rewriting them. ``/`` itself is never cached. The page calls the API like any client (``/v1/chat/completions``,
``/stats``, ``/server_info``, ``/health``); nothing here needs the API key (``auth.py`` leaves this blueprint
open), since nothing here tells anything of the model.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from flask import Blueprint, Response

from ..errors import APIError, json_error
from ..jobs import runtime

bp = Blueprint("web", __name__)

HERE = Path(__file__).parent
TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
# Scripts, styles and images from this origin only; no inline script or style, no plugin, no frame, no form
# posted elsewhere. connect-src 'self' is what lets the page reach the API.
CSP = "; ".join([
    "default-src 'none'", "script-src 'self'", "style-src 'self'", "img-src 'self'", "connect-src 'self'",
    "base-uri 'none'", "form-action 'none'", "frame-ancestors 'none'",
])
SECURITY_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}
ASSET_MAX_AGE_S = 365 * 24 * 3600


@dataclass(frozen=True)
class Bundle:
    page: str  # index.html, before its placeholders are filled
    assets: dict[str, bytes]  # file name -> content
    digest: str  # of every asset's name and content


@cache
def bundle() -> Bundle:
    """The page and its assets, read once per process (an edited asset shows after a restart)."""
    assets = {p.name: p.read_bytes() for p in sorted((HERE / "assets").iterdir()) if p.suffix in TYPES}
    h = hashlib.sha256()
    for name, content in assets.items():
        h.update(name.encode() + b"\0" + hashlib.sha256(content).digest())
    return Bundle((HERE / "index.html").read_text(), assets, h.hexdigest()[:16])


@bp.get("/")
def page():
    """The page; it tells the scripts where the assets are and whether the API wants a key (not the key)."""
    b = bundle()
    html = b.page.replace("{{assets}}", f"/assets/{b.digest}").replace("{{api_key}}", "required" if runtime().settings.api_key else "none")
    return Response(html, mimetype="text/html", headers={"Cache-Control": "no-store"})


@bp.get("/assets/<digest>/<name>")
def asset(digest: str, name: str):
    """:raise 404: an asset of another version (a page from before an upgrade reloads), or no such asset."""
    b = bundle()
    if digest != b.digest or name not in b.assets:
        return json_error(APIError(404, f"no asset {digest}/{name}: reload the page", code="not_found"))
    headers = {"Cache-Control": f"public, max-age={ASSET_MAX_AGE_S}, immutable"}
    return Response(b.assets[name], content_type=TYPES[Path(name).suffix], headers=headers)


@bp.get("/favicon.ico")
def favicon():
    """The icon, where browsers look for it on any page of the origin (a JSON answer opened in a tab, too)."""
    return Response(bundle().assets["icon.svg"], content_type=TYPES[".svg"], headers={"Cache-Control": "public, max-age=86400"})


@bp.after_request
def _secure(response: Response) -> Response:
    response.headers.update(SECURITY_HEADERS)
    return response

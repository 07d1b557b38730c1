"""A Hugging Face Hub on loopback for the -hf tests: the few routes huggingface_hub calls to list a model
repository and download one file (HEAD and GET /OWNER/REPO/resolve/REV/PATH, ranges included, and GET
/api/models/OWNER/REPO/tree/REV), with the error codes it turns into typed exceptions. It records every request,
and can cut the body of a file's first GET short to test a resumed transfer."""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import threading
from urllib.parse import unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, repos: dict[str, dict[str, bytes]]):
        """repos: {"owner/name": {"path/in/repo": bytes}}."""
        self.repos = repos
        self.log: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.auth: list[str | None] = []  # each request's Authorization header
        self.cut_next_get: dict[str, int] = {}  # repo path -> bytes sent before the connection is dropped
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()

    def gets(self, repo: str, name: str) -> list[str | None]:
        """The Range headers of the GETs of one file of a repository."""
        return [r for m, p, r in self.log if m == "GET" and p == f"/{repo}/resolve/main/{name}"]

    def _handler(self):
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _error(self, code: int, error_code: str, message: str) -> None:
                body = json.dumps({"error": message}).encode()
                self.send_response(code)
                self.send_header("X-Error-Code", error_code)
                self.send_header("X-Error-Message", message)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _route(self):
                path = unquote(urlsplit(self.path).path)
                hub.log.append((self.command, path, self.headers.get("Range")))
                hub.auth.append(self.headers.get("Authorization"))
                m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(/.*)?", path)
                if m and self.command == "GET":
                    return self._tree(m.group(1))
                m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
                if m:
                    return self._file(m.group(1), m.group(3))
                self._error(404, "RepoNotFound", f"no route {path}")

            do_GET = do_HEAD = _route

            def _tree(self, repo: str) -> None:
                files = hub.repos.get(repo)
                if files is None:
                    return self._error(401, "RepoNotFound", "Repository not found")
                body = json.dumps([{"type": "file", "path": p, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                                   for p, b in files.items()]).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _file(self, repo: str, name: str) -> None:
                files = hub.repos.get(repo)
                if files is None:
                    return self._error(401, "RepoNotFound", "Repository not found")
                if name not in files:
                    return self._error(404, "EntryNotFound", f"{name} does not exist on main")
                data = files[name]
                start = 0
                rng = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
                if rng:
                    start = int(rng.group(1))
                self.send_response(206 if rng else 200)
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", '"' + hashlib.sha256(data).hexdigest() + '"')
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(len(data) - start))
                if rng:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                if self.command == "HEAD":
                    return
                cut = hub.cut_next_get.pop(f"{repo}/{name}", None)
                if cut is not None:  # the connection drops mid-body
                    self.wfile.write(data[start:start + cut])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(data[start:])

        return Handler

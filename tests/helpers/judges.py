"""A scripted OpenAI-compatible judge endpoint: real HTTP, a verdict fixed or read from what it is asked, and a record
of the questions (the appeal's tests, `r1 audit-rewards`'s)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class ScriptedJudge(BaseHTTPRequestHandler):
    """Serves the model "judge"; answers each chat request `VERDICT: <verdict>`, where `verdict` is "yes", "no", or a
    function of the request's last message (the rendered judge prompt). `asked` holds those messages."""

    verdict: str | Callable[[str], str] = "yes"
    asked: list[str] = []

    def do_GET(self):
        self._reply({"object": "list", "data": [{"id": "judge", "object": "model"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        content = body["messages"][-1]["content"]
        type(self).asked.append(content)
        verdict = self.verdict if isinstance(self.verdict, str) else self.verdict(content)
        self._reply({"choices": [{"message": {"content": f"VERDICT: {verdict}\nREASON: said so"}}]})

    def _reply(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@contextmanager
def scripted_judge(verdict: str | Callable[[str], str]) -> Iterator[tuple[str, type[ScriptedJudge]]]:
    """A scripted judge on a free port while the block runs: (its endpoint root, its handler, whose `asked` lists
    the questions)."""
    handler = type("Handler", (ScriptedJudge,), {"verdict": staticmethod(verdict) if callable(verdict) else verdict,
                                                 "asked": []})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}/v1", handler
    finally:
        srv.shutdown()
        srv.server_close()

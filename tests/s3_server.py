"""A real S3-compatible HTTP server on 127.0.0.1 for tests and benchmarks (moto's, in a thread).

Every request passes through a WSGI layer that counts it (method, path, Range header) and
can inject faults: a status for the next N requests (500, 403...), a delay per GET or per
PUT (a slow upload), or refusing connections (the server stopped). It also records the most
GET requests answered at once (``max_in_flight``): with a delay, whether a client's GETs overlap. Not a mock of the client: the client under test
speaks real HTTP to a real server.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class S3Server:
    """moto's S3 behind a counting, fault-injecting WSGI layer; ``start()`` / ``stop()``."""

    port: int = 0
    requests: list[tuple[str, str, str]] = field(default_factory=list)  # (method, path, range)
    fail_status: int = 0  # answer this status ...
    fail_count: int = 0  # ... to the next this many GETs (requests of `fail_methods`)
    fail_methods: tuple[str, ...] = ("GET",)
    delay_s: float = 0.0  # sleep before answering every GET
    put_delay_s: float = 0.0  # sleep before answering every PUT (a part, an object): slow uploads
    no_conditional_writes: bool = False  # answer 501 NotImplemented to a PUT/POST with If-None-Match (older stores)
    in_flight: int = 0  # GET requests being answered now
    max_in_flight: int = 0  # the most GET requests answered at once since the last reset()
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> S3Server:
        from moto.moto_server.threaded_moto_server import MotoRequestHandler
        from moto.server import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import make_server

        app = DomainDispatcherApplication(create_backend_app)
        self.port = self.port or free_port()
        self._server = make_server("127.0.0.1", self.port, self._wrap(app), threaded=True,
                                   request_handler=MotoRequestHandler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def _wrap(self, app: Any) -> Any:
        def counted(environ: dict, start_response: Any) -> Any:
            method = environ["REQUEST_METHOD"]
            if environ.get("PATH_INFO") == "/__requests__":  # the count, for a server in another process
                import json

                with self._lock:
                    body = json.dumps(self.requests).encode()
                    if method == "DELETE":
                        self.requests.clear()
                start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
                return [body]
            with self._lock:
                self.requests.append((method, environ.get("PATH_INFO", ""), environ.get("HTTP_RANGE", "")))
                status = 0
                if self.no_conditional_writes and method in ("PUT", "POST") and environ.get("HTTP_IF_NONE_MATCH"):
                    status = 501
                elif method in self.fail_methods and self.fail_count > 0:
                    self.fail_count -= 1
                    status = self.fail_status
                if method == "GET":
                    self.in_flight += 1
                    self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                if method == "GET" and self.delay_s:
                    time.sleep(self.delay_s)
                if method == "PUT" and self.put_delay_s:
                    time.sleep(self.put_delay_s)
                if status:
                    start_response(f"{status} Injected", [("Content-Type", "application/xml"),
                                                          ("Content-Length", "0")])
                    return [b""]
                return app(environ, start_response)  # moto answers whole: its body is made here
            finally:
                if method == "GET":
                    with self._lock:
                        self.in_flight -= 1

        return counted

    def gets(self) -> list[tuple[str, str, str]]:
        with self._lock:
            return [r for r in self.requests if r[0] == "GET"]

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()
            self.max_in_flight = self.in_flight

    def env(self) -> dict[str, str]:
        """The standard AWS variables pointing a client at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1"}

    def put(self, bucket: str, key: str, path: str) -> str:
        """Upload ``path`` as ``s3://bucket/key`` (creating the bucket); the URL."""
        import boto3

        s3 = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")
        try:
            s3.create_bucket(Bucket=bucket)
        except s3.exceptions.BucketAlreadyOwnedByYou:
            pass
        s3.upload_file(path, bucket, key)
        return f"s3://{bucket}/{key}"


def _serve(port: int, ready: Any) -> None:
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    S3Server(port=port).start()
    ready.set()
    threading.Event().wait()


class ProcessS3Server(S3Server):
    """The same server in a process of its own (benchmarks: its CPU is not the client's GIL)."""

    def start(self) -> ProcessS3Server:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.port = self.port or free_port()
        ready = ctx.Event()
        self._proc = ctx.Process(target=_serve, args=(self.port, ready), daemon=True)
        self._proc.start()
        if not ready.wait(60):
            raise RuntimeError("the S3 server did not start")
        return self

    def stop(self) -> None:
        self._proc.terminate()
        self._proc.join(10)

    def _count(self, method: str) -> list[tuple[str, str, str]]:
        import json
        import urllib.request

        req = urllib.request.Request(f"{self.endpoint}/__requests__", method=method)
        with urllib.request.urlopen(req, timeout=10) as r:
            return [tuple(x) for x in json.loads(r.read())]

    def gets(self) -> list[tuple[str, str, str]]:
        return [r for r in self._count("GET") if r[0] == "GET" and r[1] != "/__requests__"]

    def reset(self) -> None:
        self._count("DELETE")


@contextlib.contextmanager
def running_with_env() -> Iterator[S3Server]:
    """An :class:`S3Server` started, with the standard ``AWS_*`` variables pointing at it (spawned
    workers inherit them); the variables restored and the server stopped afterwards."""
    import logging
    import os

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = S3Server().start()
    saved = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    try:
        yield server
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()

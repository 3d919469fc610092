"""An OTLP/HTTP trace receiver on loopback, as a collector would be: it answers every export
with 200 over HTTP/1.1 keep-alive connections, and keeps each span it was sent (name, span id,
the connection it came on) and each request it could not decode."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


@dataclass
class Received:
    """What the sink was sent: (span name, span id in hex, the client's port) per span, and the
    errors of the requests it could not decode."""

    spans: list[tuple[str, str, int]] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class OtlpSink:
    """`with OtlpSink() as sink:` serves on `sink.endpoint` until the block ends."""

    def __init__(self) -> None:
        self.received = received = Received()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as a collector serves

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                request = ExportTraceServiceRequest()
                try:
                    request.ParseFromString(body)
                except Exception as exc:  # a request two processes' writes mixed up
                    with received.lock:
                        received.corrupt.append(repr(exc))
                else:
                    port = int(self.client_address[1])
                    spans = [
                        (span.name, span.span_id.hex(), port)
                        for resource in request.resource_spans
                        for scope in resource.scope_spans
                        for span in scope.spans
                    ]
                    with received.lock:
                        received.spans += spans
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                pass  # no line a request on the test's output

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> OtlpSink:
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._server.shutdown()
        self._server.server_close()

"""A stand-in OpenAI-compatible engine for benchmarks of br-shim's own cost: it reads the whole
request body, answers a small completion (SSE when the request asked to stream, with a usage
chunk), and keeps nothing. Usage: python3 echo_upstream.py PORT_FILE."""
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    def do_POST(self):
        n = int(self.headers.get("Content-Length", "0"))
        remaining = n
        head = b""
        while remaining:
            chunk = self.rfile.read(min(remaining, 1 << 20))
            if not chunk:
                break
            if len(head) < 4096:
                head += chunk[:4096]
            remaining -= len(chunk)
        stream = b'"stream":true' in head.replace(b" ", b"") or b'"stream": true' in head
        usage = {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8}
        if stream:
            events = [
                {"id": "x", "choices": [{"index": 0, "text": "a"}], "usage": usage},
                {"id": "x", "choices": [{"index": 0, "text": "", "finish_reason": "stop"}], "usage": usage},
            ]
            body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
            ctype = "text/event-stream"
        else:
            body = json.dumps({"id": "x", "choices": [{"index": 0, "text": "a", "finish_reason": "stop"}], "usage": usage}).encode()
            ctype = "application/json"
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
with open(sys.argv[1], "w") as f:
    f.write(str(server.server_address[1]))
server.serve_forever()

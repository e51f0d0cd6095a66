"""The gateway of the end-to-end tests: what a user's HTTP gateway does with BalanceRoute.

For each request it counts the prompt's tokens with the model's own tokenizer, asks Decision
for a rank with the `balanceroute` client (`Assign`), sends the request to the endpoint the rank's
shim announced with the request id in `X-Request-Id`, and streams the answer back, keeping
every byte.
"""

from __future__ import annotations

import json
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, List, Optional

import balanceroute
import httpx
from tokenizers import Tokenizer

from support import MODEL, MODEL_NAME

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def chat_prompt(messages: List[dict]) -> str:
    """The tiny model's chat template (scripts/vllm/tiny_model.py), with the generation prompt."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + "<|im_start|>assistant\n"


@dataclass
class Answer:
    request_id: str
    worker_id: int
    incarnation: int
    status: int
    raw: bytes
    events: List[dict] = field(default_factory=list)

    @property
    def usage(self) -> Optional[dict]:
        for ev in reversed(self.events):
            if ev.get("usage"):
                return ev["usage"]
        return None


def sse_events(raw: bytes) -> List[dict]:
    out = []
    for block in raw.split(b"\n\n"):
        for line in block.split(b"\n"):
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


class Gateway:
    def __init__(self, decision_addr: str, group: str):
        self.group = group
        self.client = balanceroute.Client(decision_addr)
        self.tokenizer = Tokenizer.from_file(str(Path(MODEL) / "tokenizer.json"))
        self.http = httpx.Client(timeout=httpx.Timeout(120.0, connect=5.0))

    def close(self) -> None:
        self.client.close()
        self.http.close()

    def prompt_tokens(self, path: str, body: dict) -> int:
        text = chat_prompt(body["messages"]) if path == CHAT else body["prompt"]
        return len(self.tokenizer.encode(text).ids)

    def assign(self, path: str, body: dict, request_id: Optional[str] = None,
               timeout: float = 60.0) -> "tuple[str, balanceroute.Assignment]":
        rid = request_id or f"e2e-{uuid.uuid4().hex}"
        a = self.client.assign(self.group, rid, self.prompt_tokens(path, body),
                               max_tokens=body.get("max_tokens"), timeout=timeout)
        return rid, a

    def send(self, path: str, body: dict) -> Answer:
        """Assign, then the whole request; the answer's bytes as the client got them."""
        rid, a = self.assign(path, body)
        with self.http.stream("POST", a.endpoint + path, json={"model": MODEL_NAME, **body},
                              headers={"X-Request-Id": rid}) as r:
            raw = b"".join(r.iter_raw())
            status = r.status_code
        events = sse_events(raw) if body.get("stream") else [json.loads(raw)] if status == 200 else []
        return Answer(rid, a.worker_id, a.incarnation, status, raw, events)

    def open_stream(self, path: str, body: dict, timeout: float = 60.0) -> "Stream":
        rid, a = self.assign(path, body, timeout=timeout)
        return Stream(self.http, a, rid, a.endpoint + path, {"model": MODEL_NAME, **body})


class Stream:
    """A streamed request held open by the test: read some of it, then all, or go away."""

    def __init__(self, http: httpx.Client, a, rid: str, url: str, body: dict):
        self.assignment = a
        self.request_id = rid
        self._cm = http.stream("POST", url, json=body, headers={"X-Request-Id": rid})
        self.response = self._cm.__enter__()
        self._chunks: Iterator[bytes] = self.response.iter_raw()
        # A bytearray: appending to bytes copies the whole stream per chunk, which for a
        # 20,000-token stream is gigabytes of copying on the cores the engines need.
        self._buf = bytearray()

    @property
    def raw(self) -> bytes:
        """What the client has read so far."""
        return bytes(self._buf)

    @property
    def finished(self) -> bool:
        """Whether the client has read the stream's end (`data: [DONE]`)."""
        return self._buf.endswith(b"data: [DONE]\n\n")

    @property
    def worker_id(self) -> int:
        return self.assignment.worker_id

    def read_events(self, n: int) -> None:
        """Reads until at least `n` SSE events have arrived."""
        while self._buf.count(b"\n\n") < n:
            self._buf += next(self._chunks)

    def finish(self) -> bytes:
        for c in self._chunks:
            self._buf += c
        self.close()
        return self.raw

    def read_until(self, stop: threading.Event) -> bytes:
        """Reads what arrives until the stream ends or `stop` is set, then goes away (the
        connection is closed by the thread that reads it)."""
        for c in self._chunks:
            self._buf += c
            if stop.is_set():
                break
        self.close()
        return self.raw

    def close(self) -> None:
        """Goes away: closes the connection whatever is left of the stream."""
        self._cm.__exit__(None, None, None)

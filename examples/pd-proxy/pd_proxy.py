"""A prefill/decode (PD) disaggregation proxy that asks BalanceRoute which decode rank takes each
request, in the shape of the small proxies vLLM and SGLang ship for disaggregated serving.

For every OpenAI-compatible generation request (`/v1/completions`, `/v1/chat/completions`):

1. prefill: the request goes to a prefill engine (round-robin over --prefill) with
   `max_tokens = 1` and `stream = false`; its `usage.prompt_tokens` is the prompt's token count
   (and, with --kv-transfer-params, vLLM's `kv_transfer_params` come back for the decode side);
2. `Assign(group, request_id, prompt_tokens)` through the `balanceroute` client: the decision
   service picks the decode rank, after prefill, which is where the paper's dispatcher belongs
   (with the request's max_tokens, a hash of its prompt, and its output-length hints when it
   gives them: `expected_output_tokens` and `request_class`);
3. decode: the original request goes to the chosen rank (the endpoint its br-shim announced,
   or --decode-url with the rank pinned by a header or a body field) with `X-Request-Id` set to
   the request id, so the rank's telemetry turns the reservation into an active request;
4. the decode response (a stream or one JSON body) is relayed to the client as it arrives.

A client that goes away at any point ends everything it started: the upstream calls are
closed (the shim sees its client go and reports the request finished) and the request is
cancelled (`Cancel`), so a reservation that would never be used is released at once rather
than expiring after the reservation TTL. A decode call that fails is cancelled the same way.

Run it: `python pd_proxy.py --prefill http://P:8000` asks br-all on its default port for the
group "default" (as br-shim reports to by default); `--decision` (else the balanceroute client's
own default: $BALANCEROUTE_DECISION_ADDR, then 127.0.0.1:50060) and `--group` name others. See
README.md beside this file for vLLM and SGLang.
"""

import argparse
import hashlib
import itertools
import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Union

import anyio
import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

import balanceroute

log = logging.getLogger("pd-proxy")

# vLLM's NixlConnector / P2pNcclConnector contract: the prefill request says it will be decoded
# elsewhere; its response carries the parameters the decode engine needs to pull the KV cache.
KV_TRANSFER_PREFILL = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# The proto's bounds of AssignRequest.max_tokens (and expected_output_tokens).
MAX_TOKENS_LIMIT = 10_000_000
# The output-length hints a client may give, by the names br-decision's ext_proc reads: the
# expected output tokens in a header of BalanceRoute's own (no gateway names one), else in the
# body as NVIDIA Dynamo takes it, `nvext.agent_hints.osl`; the request class in the Gateway API
# Inference Extension's objective header. OpenAI's API has neither: its max_tokens is a cap
# (sent as max_tokens), and its user, safety_identifier and prompt_cache_key identify users or
# cache prefixes, not a small set of classes.
EXPECTED_OUTPUT_HEADER = "x-balanceroute-expected-output-tokens"
REQUEST_CLASS_HEADER = "x-gateway-inference-objective"
# The proto's bound of AssignRequest.request_class, in bytes (printable ASCII without spaces).
MAX_CLASS_BYTES = 64
# Headers a client sends that the engines should see too.
FORWARDED_HEADERS = ("authorization",)


@dataclass
class Config:
    prefill: List[str]
    # host:port of each decision replica, a list or one string separated by commas; None: the
    # balanceroute client's default (BALANCEROUTE_DECISION_ADDR, else br-all's port).
    decision: Union[str, List[str], None] = None
    # The decode ranks' group: by default the one br-shim and br-decision default to.
    group: str = "default"
    tls: Optional[balanceroute.TLSConfig] = None
    assign_timeout: float = 10.0
    # One URL for every rank (vLLM with all DP ranks behind one API server, SGLang's DP
    # controller): the rank is then pinned by dp_rank_header or dp_rank_field.
    decode_url: Optional[str] = None
    dp_rank_header: Optional[str] = None
    dp_rank_field: Optional[str] = None
    kv_transfer_params: bool = False
    connect_timeout: float = 5.0
    prefill_timeout: float = 600.0


@dataclass
class State:
    cfg: Config
    http: httpx.AsyncClient
    br: balanceroute.AsyncClient
    prefill_rr: "itertools.cycle[str]" = field(init=False)
    # What happened to the requests so far (GET /stats): requests taken, decodes relayed to
    # the end, clients gone before the end, Cancels answered and failed.
    stats: Dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(
            ("requests", "decoded", "client_gone", "cancelled", "cancel_failed"), 0
        )
    )

    def __post_init__(self):
        self.prefill_rr = itertools.cycle(self.cfg.prefill)


def prompt_hash(body: dict) -> int:
    """A stable 64-bit hash of the prompt (for BR-H's ExactMatch predictor): the same prompt or
    messages give the same hash on every proxy replica."""
    prompt = body.get("messages", body.get("prompt"))
    text = json.dumps(prompt, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def requested_max_tokens(body: dict) -> Optional[int]:
    v = body.get("max_completion_tokens", body.get("max_tokens"))
    if isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_TOKENS_LIMIT:
        return v
    return None


def expected_output_tokens(body: dict, headers, max_tokens: Optional[int]) -> Optional[int]:
    """The client's expected output tokens: the header, else `nvext.agent_hints.osl`. A hint
    outside the proto's bounds (1..=10M, at most max_tokens) is left out, as an out-of-range
    max_tokens is: a hint never fails the request."""
    v = headers.get(EXPECTED_OUTPUT_HEADER)
    if v is not None:
        try:
            v = int(v.strip())
        except ValueError:
            return None
    else:
        nvext = body.get("nvext")
        hints = nvext.get("agent_hints") if isinstance(nvext, dict) else None
        v = hints.get("osl") if isinstance(hints, dict) else None
    if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= MAX_TOKENS_LIMIT:
        return None
    if max_tokens is not None and v > max_tokens:
        return None
    return v


def request_class(headers) -> Optional[str]:
    """The request's class key from the objective header, if it is one the proto takes
    (1..=64 bytes of printable ASCII without spaces); else none."""
    v = headers.get(REQUEST_CLASS_HEADER)
    if not v or len(v) > MAX_CLASS_BYTES or not all("!" <= c <= "~" for c in v):
        return None
    return v


def error_body(message: str, kind: str, code: str) -> bytes:
    """An OpenAI-shaped error, as the engines send them."""
    return json.dumps({"error": {"message": message, "type": kind, "code": code}}).encode()


# How each BalanceRoute error reaches an HTTP client.
ASSIGN_HTTP_STATUS = {
    balanceroute.InvalidArgument: 400,
    balanceroute.NotFound: 404,
    balanceroute.ResourceExhausted: 429,
    balanceroute.Unavailable: 503,
    balanceroute.DeadlineExceeded: 504,
}


class Exchange(Response):
    """One client request through prefill, Assign and decode, as an ASGI response: it owns the
    connection to the client, so it can watch for the client going away from the first byte to
    the last and end what it started. (A Response subclass only so that FastAPI hands it the
    connection as it is; its status and headers are decided on the way.)"""

    def __init__(
        self,
        state: State,
        path: str,
        body: dict,
        request_id: str,
        headers: Dict[str, str],
        expected_output: Optional[int] = None,
        request_class: Optional[str] = None,
    ):
        super().__init__()
        self.s = state
        self.path = path
        self.body = body
        self.rid = request_id
        self.fwd_headers = headers
        # The output-length hints Assign gets (`expected_output_tokens`, `request_class`).
        self.expected_output = expected_output
        self.request_class = request_class
        self.assigned: Optional[balanceroute.Assignment] = None
        self.assign_started = False
        self.upstream: Optional[httpx.Response] = None
        self.completed = False
        self.client_gone = False
        self.response_started = False
        self.finished = False

    async def __call__(self, scope, receive, send) -> None:
        self.send = send
        try:
            async with anyio.create_task_group() as tg:

                async def watch():
                    # The body was read already: the next message is the client leaving.
                    while True:
                        msg = await receive()
                        if msg["type"] == "http.disconnect":
                            # After the last byte, a client closing is no disconnect.
                            self.client_gone = not self.finished
                            tg.cancel_scope.cancel()
                            return

                async def exchange():
                    try:
                        await self.run()
                    except OSError:
                        # A server on ASGI 2.4 reports a client gone when a send fails.
                        self.client_gone = True
                    except Exception as e:  # noqa: BLE001 - answered, not lost
                        log.exception("request %s failed", self.rid)
                        if not self.response_started:
                            await self.fail(500, f"proxy error: {e!r}", "internal")
                    finally:
                        tg.cancel_scope.cancel()

                tg.start_soon(watch)
                tg.start_soon(exchange)
        finally:
            with anyio.CancelScope(shield=True):
                await self.cleanup()

    async def run(self) -> None:
        cfg = self.s.cfg
        # 1. Prefill: one token, no stream; the usage says how long the prompt is.
        pbody = dict(self.body)
        pbody["max_tokens"] = 1
        if "max_completion_tokens" in pbody:
            pbody["max_completion_tokens"] = 1
        pbody["stream"] = False
        pbody.pop("stream_options", None)
        if cfg.kv_transfer_params:
            pbody["kv_transfer_params"] = dict(KV_TRANSFER_PREFILL)
        prefill_url = next(self.s.prefill_rr)
        try:
            pr = await self.s.http.post(
                prefill_url + self.path,
                json=pbody,
                headers={**self.fwd_headers, "X-Request-Id": self.rid},
                timeout=httpx.Timeout(cfg.prefill_timeout, connect=cfg.connect_timeout),
            )
        except httpx.HTTPError as e:
            await self.fail(502, f"prefill {prefill_url}: {e!r}", "prefill_unreachable")
            return
        if pr.status_code != 200:
            # The engine's own error (a bad request is the client's to see as it is).
            await self.reply(pr.status_code, pr.content, pr.headers.get("content-type"))
            return
        try:
            presp = pr.json()
            prompt_tokens = int(presp["usage"]["prompt_tokens"])
        except (ValueError, KeyError, TypeError):
            await self.fail(
                502,
                f"prefill {prefill_url} answered without usage.prompt_tokens",
                "prefill_no_usage",
            )
            return

        # 2. Assign: which decode rank, now that prefill is done.
        self.assign_started = True
        try:
            self.assigned = await self.s.br.assign(
                cfg.group,
                self.rid,
                max(prompt_tokens, 1),
                prompt_hash=prompt_hash(self.body),
                max_tokens=requested_max_tokens(self.body),
                timeout=cfg.assign_timeout,
                expected_output_tokens=self.expected_output,
                request_class=self.request_class,
            )
        except balanceroute.BalanceRouteError as e:
            status = next((s for cls, s in ASSIGN_HTTP_STATUS.items() if isinstance(e, cls)), 502)
            await self.fail(status, f"assign: {e.message}", e.code.name.lower())
            return
        a = self.assigned

        # 3. Decode on the chosen rank, with the request id its telemetry reports.
        base = cfg.decode_url or a.endpoint
        if not base:
            await self.fail(
                502, f"rank {a.worker_id} announced no endpoint; set --decode-url", "no_endpoint"
            )
            return
        dbody = dict(self.body)
        kv = presp.get("kv_transfer_params") if isinstance(presp, dict) else None
        if kv:
            dbody["kv_transfer_params"] = kv
        if cfg.dp_rank_field:
            dbody[cfg.dp_rank_field] = a.worker_id
        dheaders = {**self.fwd_headers, "X-Request-Id": self.rid}
        if cfg.dp_rank_header:
            dheaders[cfg.dp_rank_header] = str(a.worker_id)
        req = self.s.http.build_request(
            "POST",
            base.rstrip("/") + self.path,
            json=dbody,
            headers=dheaders,
            # A decode stream may wait long between tokens (queued behind a full batch).
            timeout=httpx.Timeout(None, connect=cfg.connect_timeout),
        )
        try:
            self.upstream = await self.s.http.send(req, stream=True)
        except httpx.HTTPError as e:
            await self.fail(502, f"decode {base}: {e!r}", "decode_unreachable")
            return

        # 4. Relay, byte for byte, as it arrives.
        up = self.upstream
        headers = [
            (b"content-type", up.headers.get("content-type", "application/json").encode()),
            (b"x-request-id", self.rid.encode()),
            (b"x-balanceroute-worker", str(a.worker_id).encode()),
            (b"x-balanceroute-endpoint", base.encode()),
        ]
        await self.start(up.status_code, headers)
        async for chunk in up.aiter_raw():
            await self.send({"type": "http.response.body", "body": chunk, "more_body": True})
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})
        self.finished = True
        # Only a decode the engine took and finished used its reservation.
        self.completed = up.status_code == 200

    async def start(self, status: int, headers) -> None:
        self.response_started = True
        await self.send({"type": "http.response.start", "status": status, "headers": headers})

    async def reply(self, status: int, body: bytes, content_type: Optional[str]) -> None:
        await self.start(
            status,
            [
                (b"content-type", (content_type or "application/json").encode()),
                (b"x-request-id", self.rid.encode()),
            ],
        )
        await self.send({"type": "http.response.body", "body": body, "more_body": False})
        self.finished = True

    async def fail(self, status: int, message: str, code: str) -> None:
        log.warning("request %s: %s", self.rid, message)
        await self.reply(status, error_body(message, "pd_proxy_error", code), "application/json")

    async def cleanup(self) -> None:
        """Runs whatever happened (shielded from the cancellation that may have brought it
        here): closes the decode call, and cancels the request unless its decode finished."""
        stats = self.s.stats
        if self.upstream is not None:
            await self.upstream.aclose()
        if self.completed:
            stats["decoded"] += 1
        if self.client_gone:
            stats["client_gone"] += 1
            log.info(
                "request %s: client went away (assigned: %s)", self.rid, self.assigned is not None
            )
        if self.assign_started and not self.completed:
            try:
                outcome = await self.s.br.cancel(self.s.cfg.group, self.rid)
                stats["cancelled"] += 1
                log.info("request %s: cancelled (%s)", self.rid, outcome.name)
            except balanceroute.BalanceRouteError as e:
                stats["cancel_failed"] += 1
                log.warning("request %s: cancel failed: %s", self.rid, e)


def create_app(cfg: Config) -> FastAPI:
    """The proxy as an ASGI app (the connections are opened in its lifespan, on its loop)."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        http = httpx.AsyncClient(
            # Engines are on the cluster network: a proxy meant for the internet
            # (HTTP_PROXY in the environment) must not capture their traffic.
            trust_env=False,
            limits=httpx.Limits(max_connections=4096, max_keepalive_connections=256),
        )
        br = balanceroute.AsyncClient(cfg.decision, tls=cfg.tls)
        app.state.pd = State(cfg, http, br)
        try:
            yield
        finally:
            await http.aclose()
            await br.close()

    app = FastAPI(title="BalanceRoute PD proxy", lifespan=lifespan)

    async def generate(request: Request, path: str):
        try:
            body = json.loads(await request.body())
            if not isinstance(body, dict):
                raise ValueError("not an object")
        except ValueError as e:
            return JSONResponse(
                {
                    "error": {
                        "message": f"invalid JSON body: {e}",
                        "type": "invalid_request_error",
                        "code": "bad_json",
                    }
                },
                status_code=400,
            )
        request.app.state.pd.stats["requests"] += 1
        rid = request.headers.get("x-request-id") or f"pd-{uuid.uuid4().hex}"
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        return Exchange(
            request.app.state.pd,
            path,
            body,
            rid,
            headers,
            expected_output=expected_output_tokens(
                body, request.headers, requested_max_tokens(body)
            ),
            request_class=request_class(request.headers),
        )

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request):
        s: State = request.app.state.pd
        r = await s.http.get(s.cfg.prefill[0] + "/v1/models", timeout=s.cfg.connect_timeout)
        return JSONResponse(r.json(), status_code=r.status_code)

    @app.get("/stats")
    async def stats(request: Request):
        return request.app.state.pd.stats

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    return app


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--listen", default="127.0.0.1:8200", help="host:port to serve on")
    p.add_argument(
        "--prefill",
        action="append",
        required=True,
        help="a prefill engine's base URL (repeat for several: round-robin)",
    )
    p.add_argument(
        "--decision",
        help="decision replicas, host:port separated by commas (ordered failover); default: "
        f"${balanceroute.ADDRESS_ENV}, else br-all on {balanceroute.DEFAULT_ADDRESS}",
    )
    p.add_argument(
        "--group", default="default", help="the decode ranks' lockstep group (default: default)"
    )
    p.add_argument("--assign-timeout", type=float, default=10.0, help="seconds an Assign may take")
    p.add_argument(
        "--decode-url",
        help="one base URL for every decode rank (then pin the rank "
        "with --dp-rank-header or --dp-rank-field); default: the endpoint of the "
        "rank's shim from Assign",
    )
    p.add_argument(
        "--dp-rank-header", help="header naming the rank, e.g. X-data-parallel-rank (vLLM)"
    )
    p.add_argument(
        "--dp-rank-field", help="body field naming the rank, e.g. routed_dp_rank (SGLang)"
    )
    p.add_argument(
        "--kv-transfer-params",
        action="store_true",
        help="vLLM NixlConnector/P2pNcclConnector: ask prefill for kv_transfer_params "
        "and hand them to decode",
    )
    p.add_argument("--tls-ca", help="CA of the decision service's certificate (mutual TLS)")
    p.add_argument("--tls-cert", help="the gateway's certificate")
    p.add_argument("--tls-key", help="the gateway's key")
    p.add_argument("--log-level", default="info")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # One line per upstream call is too much at INFO; the proxy logs what went wrong itself.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    tls = None
    if args.tls_ca:
        tls = balanceroute.TLSConfig(ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key)
    cfg = Config(
        prefill=[u.rstrip("/") for u in args.prefill],
        decision=args.decision,
        group=args.group,
        tls=tls,
        assign_timeout=args.assign_timeout,
        decode_url=args.decode_url,
        dp_rank_header=args.dp_rank_header,
        dp_rank_field=args.dp_rank_field,
        kv_transfer_params=args.kv_transfer_params,
    )
    host, _, port = args.listen.rpartition(":")
    uvicorn.run(create_app(cfg), host=host, port=int(port), log_level=args.log_level.lower())


if __name__ == "__main__":
    main()

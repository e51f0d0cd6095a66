"""The blocking client: `Client.assign` and `Client.cancel`, safe to call from many threads
at once (one `Client` per process; its connections are shared). The rules are those of
`_core.assign_plan` and `_core.cancel_plan`; this module only makes the calls."""

import time
from typing import Iterable, List, Optional, Tuple, Union

import grpc

from . import _core, errors
from ._core import (
    DEFAULT_ASSIGN_TIMEOUT,
    DEFAULT_CANCEL_TIMEOUT,
    Assignment,
    CancelOutcome,
    ClientOptions,
    RetryPolicy,
    TLSConfig,
)


def _stubs():
    try:
        from .v1 import decision_pb2, decision_pb2_grpc
    except ImportError as e:  # the package was not built (e.g. imported from its source tree)
        raise ImportError(
            "balanceroute's gRPC stubs are generated when the package is built: "
            "pip install ./clients/python (from the repository)"
        ) from e
    return decision_pb2, decision_pb2_grpc


def _channel_args(tls: Optional[TLSConfig], options: ClientOptions) -> List[Tuple[str, object]]:
    args: List[Tuple[str, object]] = list(options.channel_options())
    if tls is not None and tls.server_name:
        args.append(("grpc.ssl_target_name_override", tls.server_name))
    return args


class Client:
    """The gateway's Decision client over one or several replicas.

    addresses: `host:port` (or `http://` / `https://host:port`), a list of them or one string
        separated by commas, in the order the default `Selection.ORDERED` tries them. None:
        `$BALANCEROUTE_DECISION_ADDR` if set, else br-all's default port, 127.0.0.1:50060
        (`_core.default_addresses`).
    tls: `TLSConfig` for mutual TLS (the gateway's certificate); plaintext when None.
    options, retry: see `ClientOptions` and `RetryPolicy`.

    Connections are made on first use and remade as needed: a client may be built before the
    decision service is up.
    """

    def __init__(
        self,
        addresses: Union[str, Iterable[str], None] = None,
        *,
        tls: Optional[TLSConfig] = None,
        options: ClientOptions = ClientOptions(),
        retry: RetryPolicy = RetryPolicy(),
    ):
        self._pb, rpc = _stubs()
        self._options = options
        self._retry = retry
        creds = tls.credentials() if tls is not None else None
        args = _channel_args(tls, options)
        if addresses is None:
            addresses = _core.default_addresses()
        replicas = []
        for addr in _core.split_addresses(addresses):
            target = _core.parse_address(addr, tls is not None)
            if creds is None:
                ch = grpc.insecure_channel(target, options=args)
            else:
                ch = grpc.secure_channel(target, creds, options=args)
            replicas.append(_core.Replica(addr, ch, rpc.DecisionStub(ch)))
        self._replicas = _core.Replicas(replicas, options.selection)

    def assign(
        self,
        group: str,
        request_id: str,
        prompt_tokens: int,
        prompt_hash: Optional[int] = None,
        max_tokens: Optional[int] = None,
        timeout: float = DEFAULT_ASSIGN_TIMEOUT,
        *,
        expected_output_tokens: Optional[int] = None,
        request_class: Optional[str] = None,
    ) -> Assignment:
        """Asks for the rank of one request whose prefill is done, waiting at most `timeout`
        seconds (pool wait, retries and failovers included). Retries keep `request_id`. Raises
        a `BalanceRouteError` subclass (`DeadlineExceeded`, `InvalidArgument`, ...).

        Optional hints, read by the `brh-hinted` predictor and by `--stagger-weight`:
        `expected_output_tokens`, the client's own estimate of the tokens the request generates
        (1..=10,000,000, at most `max_tokens`), and `request_class`, a short key of the
        request's class (template, tenant, tool use, thinking: 1..=64 bytes of printable ASCII
        without spaces)."""
        req = _core.assign_request(
            self._pb,
            group,
            request_id,
            prompt_tokens,
            prompt_hash,
            max_tokens,
            expected_output_tokens,
            request_class,
        )
        plan = _core.assign_plan(
            self._replicas, self._options, self._retry, time.monotonic() + timeout
        )
        outcome = None
        while True:
            try:
                step = plan.send(outcome)
            except StopIteration as done:
                return done.value
            if isinstance(step, _core.Sleep):
                time.sleep(step.seconds)
                outcome = None
                continue
            try:
                resp = step.replica.stub.Assign(req, timeout=step.timeout)
                outcome = _core.Outcome(response=resp)
            except grpc.RpcError as e:
                outcome = _core.outcome_of_error(e)

    def cancel(
        self, group: str, request_id: str, timeout: float = DEFAULT_CANCEL_TIMEOUT
    ) -> CancelOutcome:
        """Withdraws a request: it leaves the pool if it waits there (its `assign` then raises
        `Cancelled`), or its reservation is released if it was assigned and not yet sent.
        Sent to every replica at once; the strongest outcome wins. Idempotent."""
        if not isinstance(group, str) or not isinstance(request_id, str):
            raise errors.InvalidArgument(
                grpc.StatusCode.INVALID_ARGUMENT, "group and request_id must be strings", 0
            )
        req = self._pb.CancelRequest(group=group, request_id=request_id)
        plan = _core.cancel_plan(self._replicas, self._retry, time.monotonic() + timeout)
        outcomes = None
        while True:
            try:
                step = plan.send(outcomes)
            except StopIteration as done:
                return done.value
            if isinstance(step, _core.Sleep):
                time.sleep(step.seconds)
                outcomes = None
                continue
            # One future per replica: the calls run at once.
            futures = [r.stub.Cancel.future(req, timeout=step.timeout) for r in step.replicas]
            outcomes = []
            for f in futures:
                try:
                    outcomes.append(_core.Outcome(response=f.result()))
                except grpc.RpcError as e:
                    outcomes.append(_core.outcome_of_error(e))

    def replicas(self) -> List[Tuple[str, bool]]:
        """The replicas' addresses in order, each with whether it is currently skipped as down."""
        now = time.monotonic()
        return [(r.addr, r.is_down(now)) for r in self._replicas.list]

    def close(self) -> None:
        for r in self._replicas.list:
            r.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

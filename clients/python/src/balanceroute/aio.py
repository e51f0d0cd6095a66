"""The asyncio client: `AsyncClient.assign` and `AsyncClient.cancel` on grpc.aio, with the same
rules as the blocking `Client` (`_core.assign_plan`, `_core.cancel_plan`). Its channels belong
to the event loop of its first call; use one client per loop."""

import asyncio
import time
from typing import Iterable, List, Optional, Tuple, Union

import grpc
import grpc.aio

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
from .client import _channel_args, _stubs


class AsyncClient:
    """The asyncio form of `balanceroute.Client` (same arguments, same errors).

    Channels are opened on the first call, inside the running loop (grpc.aio binds a channel
    to the loop it was made in). `async with AsyncClient(...) as c:` closes them at the end;
    otherwise `await c.close()`.
    """

    def __init__(
        self,
        addresses: Union[str, Iterable[str], None] = None,
        *,
        tls: Optional[TLSConfig] = None,
        options: ClientOptions = ClientOptions(),
        retry: RetryPolicy = RetryPolicy(),
    ):
        self._pb, self._rpc = _stubs()
        self._options = options
        self._retry = retry
        self._tls = tls
        # Checked now, so a bad address or certificate path fails at construction.
        self._creds = tls.credentials() if tls is not None else None
        if addresses is None:
            addresses = _core.default_addresses()
        self._targets = [
            (a, _core.parse_address(a, tls is not None)) for a in _core.split_addresses(addresses)
        ]
        self._replicas: Optional[_core.Replicas] = None

    def _ensure(self) -> _core.Replicas:
        if self._replicas is None:
            args = _channel_args(self._tls, self._options)
            replicas = []
            for addr, target in self._targets:
                if self._creds is None:
                    ch = grpc.aio.insecure_channel(target, options=args)
                else:
                    ch = grpc.aio.secure_channel(target, self._creds, options=args)
                replicas.append(_core.Replica(addr, ch, self._rpc.DecisionStub(ch)))
            self._replicas = _core.Replicas(replicas, self._options.selection)
        return self._replicas

    async def assign(
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
        """See `balanceroute.Client.assign`. Cancelling the awaiting task abandons the call (the
        server withdraws the request when its caller goes away)."""
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
            self._ensure(), self._options, self._retry, time.monotonic() + timeout
        )
        outcome = None
        while True:
            try:
                step = plan.send(outcome)
            except StopIteration as done:
                return done.value
            if isinstance(step, _core.Sleep):
                await asyncio.sleep(step.seconds)
                outcome = None
                continue
            try:
                resp = await step.replica.stub.Assign(req, timeout=step.timeout)
                outcome = _core.Outcome(response=resp)
            except grpc.RpcError as e:
                outcome = _core.outcome_of_error(e)

    async def cancel(
        self, group: str, request_id: str, timeout: float = DEFAULT_CANCEL_TIMEOUT
    ) -> CancelOutcome:
        """See `balanceroute.Client.cancel`."""
        if not isinstance(group, str) or not isinstance(request_id, str):
            raise errors.InvalidArgument(
                grpc.StatusCode.INVALID_ARGUMENT, "group and request_id must be strings", 0
            )
        req = self._pb.CancelRequest(group=group, request_id=request_id)
        plan = _core.cancel_plan(self._ensure(), self._retry, time.monotonic() + timeout)
        outcomes = None
        while True:
            try:
                step = plan.send(outcomes)
            except StopIteration as done:
                return done.value
            if isinstance(step, _core.Sleep):
                await asyncio.sleep(step.seconds)
                outcomes = None
                continue
            outcomes = list(
                await asyncio.gather(
                    *(self._cancel_one(r, req, step.timeout) for r in step.replicas)
                )
            )

    @staticmethod
    async def _cancel_one(replica: _core.Replica, req, timeout: float) -> _core.Outcome:
        try:
            return _core.Outcome(response=await replica.stub.Cancel(req, timeout=timeout))
        except grpc.RpcError as e:
            return _core.outcome_of_error(e)

    def replicas(self) -> List[Tuple[str, bool]]:
        """The replicas' addresses in order, each with whether it is currently skipped as down."""
        now = time.monotonic()
        if self._replicas is None:
            return [(a, False) for a, _ in self._targets]
        return [(r.addr, r.is_down(now)) for r in self._replicas.list]

    async def close(self) -> None:
        if self._replicas is not None:
            await asyncio.gather(*(r.channel.close() for r in self._replicas.list))
            self._replicas = None

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

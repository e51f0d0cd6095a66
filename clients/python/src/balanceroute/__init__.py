"""BalanceRoute's Python client: ask the decision service which decode rank (DP rank) a request
goes to once its prefill is done, and withdraw the request if the client goes away.

    from balanceroute import Client

    client = Client(["10.0.0.5:50063", "10.0.0.6:50063"])
    a = client.assign("g8", "req-42", prompt_tokens=3197, max_tokens=1024, timeout=5.0)
    # send the decode request to a.endpoint (or rank a.worker_id) with X-Request-Id: req-42
    client.cancel("g8", "req-42")  # if the client went away before it was sent

`Client()` with no addresses connects where `$BALANCEROUTE_DECISION_ADDR` says, else to br-all on
its default port, 127.0.0.1:50060. `AsyncClient` is the same on asyncio. Errors are typed per
gRPC status (`balanceroute.errors`).
"""

from ._core import (
    ADDRESS_ENV,
    DEFAULT_ADDRESS,
    DEFAULT_ASSIGN_TIMEOUT,
    DEFAULT_CANCEL_TIMEOUT,
    Assignment,
    CancelOutcome,
    ClientOptions,
    RetryPolicy,
    Selection,
    TLSConfig,
)
from .aio import AsyncClient
from .client import Client
from .errors import (
    BalanceRouteError,
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)

__all__ = [
    "ADDRESS_ENV",
    "AsyncClient",
    "Assignment",
    "BalanceRouteError",
    "CancelOutcome",
    "Cancelled",
    "Client",
    "ClientOptions",
    "DEFAULT_ADDRESS",
    "DEFAULT_ASSIGN_TIMEOUT",
    "DEFAULT_CANCEL_TIMEOUT",
    "DeadlineExceeded",
    "FailedPrecondition",
    "Internal",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "RetryPolicy",
    "Selection",
    "TLSConfig",
    "Unauthenticated",
    "Unavailable",
]

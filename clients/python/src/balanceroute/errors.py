"""The typed errors of the client: one class per gRPC status the Decision service answers (see
proto/balanceroute/v1/decision.proto), all under `BalanceRouteError`, which carries the code and
the server's message. `from_status` is the one mapping from a status to a class."""

from typing import Optional

import grpc


class BalanceRouteError(Exception):
    """Any failed `assign` or `cancel`.

    Attributes:
        code: the `grpc.StatusCode` of the (last) failed call.
        message: the server's message (or this client's, for errors made here).
        attempts: how many calls were made (0 when the request never left this client).
    """

    #: Whether the gateway may try the same request id again, later or elsewhere.
    retryable = False

    def __init__(self, code: grpc.StatusCode, message: str, attempts: int = 1):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.attempts = attempts


class InvalidArgument(BalanceRouteError):
    """The request failed validation (the message names the field), or a retry reused a request
    id with different prompt_tokens. Never retried."""


class DeadlineExceeded(BalanceRouteError):
    """Not assigned before the deadline. The request left the pool; nothing is reserved."""


class Cancelled(BalanceRouteError):
    """A `cancel` withdrew the request while it waited in the pool."""


class ResourceExhausted(BalanceRouteError):
    """The group's pool is full (or a message limit was hit): shed the request or retry later.
    Not retried by the client, since retrying at once only adds load."""

    retryable = True


class NotFound(BalanceRouteError):
    """The decision service does not serve this group (see br-decision --groups)."""


class Unavailable(BalanceRouteError):
    """Every replica stayed unreachable or unavailable (no σ or no live worker yet, shutting
    down, connection refused or reset) until the deadline or the last attempt."""

    retryable = True


class FailedPrecondition(Unavailable):
    """The replica that answered last is a standby for the group, not its active decider."""


class PermissionDenied(BalanceRouteError):
    """The client's certificate does not carry a role allowed to call the method (gateway or
    admin for Assign and Cancel)."""


class Unauthenticated(BalanceRouteError):
    """The server could not identify the client."""


class Internal(BalanceRouteError):
    """The service failed in a way a retry will not fix (e.g. the snapshot service refused the
    reservation)."""


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.INTERNAL: Internal,
}


def from_status(
    code: grpc.StatusCode, message: Optional[str], attempts: int = 1
) -> BalanceRouteError:
    """The typed error for a status (`BalanceRouteError` itself for a code without a class)."""
    cls = _BY_CODE.get(code, BalanceRouteError)
    return cls(code, message or "", attempts)

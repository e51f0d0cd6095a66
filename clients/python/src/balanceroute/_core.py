"""What the sync `Client` and the asyncio `AsyncClient` share: the options, the answer types,
the replicas' health, and the retry and failover rules themselves.

The rules are written once, as generators that do no I/O (`assign_plan`, `cancel_plan`): they
yield what to do next (`Call` one replica, `CallAll` for a cancel, `Sleep`) and are sent what
happened; each client drives them with its own blocking or awaiting calls. They mirror the Rust
client, `br_client::assign`, rule for rule and name for name: its call loop in
shared/client/src/assign.rs, the retry rule in assign/error.rs, the backoff and replica order in
assign/options.rs and the replicas' health in assign/replicas.rs (under shared/client/src/).
"""

import enum
import os
import random
import threading
import time
from dataclasses import dataclass
from typing import Generator, Iterable, List, Optional, Sequence, Tuple, Union

import grpc

from . import errors

#: Where a client given no addresses connects (unless ADDRESS_ENV is set): br-all's one gRPC
#: port on loopback, where every BalanceRoute binary looks by default (br_proto::defaults).
DEFAULT_ADDRESS = "127.0.0.1:50060"
#: The variable naming the decision service when a client is given no addresses: the one
#: br-emu load and the bench drivers read, and deploy/split.env sets for the split deployment.
ADDRESS_ENV = "BALANCEROUTE_DECISION_ADDR"
#: How long `cancel` tries (retries included) when no timeout is given.
DEFAULT_CANCEL_TIMEOUT = 2.0
#: How long `assign` may take (pool wait, retries and failovers included) when no timeout is
#: given. The server caps any wait at its --max-wait.
DEFAULT_ASSIGN_TIMEOUT = 10.0
#: First time a failed replica is skipped; doubled per further failure up to MAX_EJECTION.
FIRST_EJECTION = 0.25
#: Longest time a failing replica is skipped before one call probes it again.
MAX_EJECTION = 5.0
#: The largest value of a proto uint32 / uint64 field.
_U32 = 2**32 - 1
_U64 = 2**64 - 1


def _ceiling(initial: float, maximum: float, attempt: int) -> float:
    """min(initial * 2^attempt, max), as br-backoff's `ceiling` (a max below initial is initial)."""
    return min(initial * (2 ** min(attempt, 31)), max(maximum, initial))


def _equal_jitter(ceiling: float) -> float:
    """Uniform in [ceiling / 2, ceiling]: br-backoff's equal jitter (never a burst of instant
    retries against a peer that stays down, yet spread out across many clients)."""
    return random.uniform(ceiling / 2, ceiling)


@dataclass(frozen=True)
class RetryPolicy:
    """Backoff between rounds of retries (a round: every replica tried once and failed):
    `initial_backoff` seconds, doubling up to `max_backoff`, each drawn with equal jitter, and
    never past the deadline.

    By default a call is retried until the caller's deadline, however many attempts that
    takes: a restart of the decision service (refused connections, then "no σ yet" until the
    workers have reconnected) lasts seconds, and a fixed count of quick retries gave up long
    before it was over while the deadline still allowed waiting. `max_attempts`, when set,
    bounds the calls of one `assign` (the first included) as well."""

    initial_backoff: float = 0.005
    max_backoff: float = 0.25
    max_attempts: Optional[int] = None

    def backoff(self, round_: int) -> float:
        """The pause after the `round_`-th round of failed calls (1-based)."""
        return _equal_jitter(_ceiling(self.initial_backoff, self.max_backoff, max(round_ - 1, 0)))

    def exhausted(self, attempts: int) -> bool:
        """Whether `attempts` calls used up an explicit `max_attempts`."""
        return self.max_attempts is not None and attempts >= self.max_attempts


class Selection(enum.Enum):
    """Which replica a call goes to first."""

    #: The first healthy replica in the given order: one pool decides for the group while it is
    #: healthy (batch admission sees the whole group), the others take over when it fails.
    ORDERED = "ordered"
    #: Round-robin over the healthy replicas: every replica runs a pool of its own, so load
    #: spreads, at some cost in routing quality.
    ROUND_ROBIN = "round-robin"


@dataclass(frozen=True)
class ClientOptions:
    """Connection and failover settings.

    attempt_timeout: longest one attempt may take before the call moves to another replica
        (still within the caller's deadline). None (the default): an attempt may use the whole
        deadline, since a pooled Assign legitimately waits in the pool; a dead or frozen replica
        is then found by the connection (reset, refused, or keepalive). Set it for on-arrival
        policies (jsq, ...), whose answers take milliseconds.
    connect_timeout: how long a connection attempt may take before its calls fail over.
    keepalive_interval, keepalive_timeout: HTTP/2 PINGs on every replica's connection, also
        while idle; a PING not answered in time closes the connection and fails its calls, so
        a frozen replica or a half-open connection is found in about two seconds.
    """

    selection: Selection = Selection.ORDERED
    attempt_timeout: Optional[float] = None
    connect_timeout: float = 1.0
    keepalive_interval: float = 1.0
    keepalive_timeout: float = 1.0

    def channel_options(self) -> List[Tuple[str, int]]:
        return [
            ("grpc.keepalive_time_ms", int(self.keepalive_interval * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            # A connection attempt gives up after connect_timeout (gRPC's "minimum connect
            # timeout"), and a replica that failed is dialled again on the ejection schedule
            # rather than gRPC's default (1 s growing to 120 s), so a replica that comes back is
            # used again within MAX_EJECTION.
            ("grpc.min_reconnect_backoff_ms", int(self.connect_timeout * 1000)),
            ("grpc.initial_reconnect_backoff_ms", int(FIRST_EJECTION * 1000)),
            ("grpc.max_reconnect_backoff_ms", int(MAX_EJECTION * 1000)),
            # One connection per replica for this client, not one shared with other clients
            # of the process: its failures are this replica's own.
            ("grpc.use_local_subchannel_pool", 1),
        ]


@dataclass(frozen=True)
class TLSConfig:
    """Mutual TLS: the CA that signed the decision service's certificate, and the gateway's own
    certificate and key (PEM files, e.g. from scripts/dev-certs.sh: ca.pem, gateway.pem,
    gateway-key.pem). The server is verified by its chain and its name (the address's host, or
    `server_name`). cert and key may be left out to connect without a client certificate (the
    services then refuse the handshake)."""

    ca: str
    cert: Optional[str] = None
    key: Optional[str] = None
    server_name: Optional[str] = None

    def credentials(self) -> grpc.ChannelCredentials:
        if (self.cert is None) != (self.key is None):
            raise ValueError("TLSConfig: give both cert and key, or neither")

        def read(path: Optional[str]) -> Optional[bytes]:
            if path is None:
                return None
            with open(path, "rb") as f:
                return f.read()

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ca),
            private_key=read(self.key),
            certificate_chain=read(self.cert),
        )


@dataclass(frozen=True)
class Assignment:
    """The rank chosen for a request.

    worker_id: the DP rank within the group.
    endpoint: the rank's endpoint as its shim announced it ("" if none).
    incarnation: the worker incarnation the reservation is for.
    policy: the policy that decided ("br0", "jsq", ...).
    pool_wait: seconds the request waited in the pool before admission (0 when immediate).
    sigma_version: σ's version in the deciding replica when it decided.
    stale: decided while the snapshot service was unreachable.
    attempts: how many calls this took (1 without retries).
    replica: the address of the decision replica that answered, as given to the client.
    """

    worker_id: int
    endpoint: str
    incarnation: int
    policy: str
    pool_wait: float
    sigma_version: int
    stale: bool
    attempts: int
    replica: str


class CancelOutcome(enum.IntEnum):
    """What a cancel did; ordered by strength (a cancel sent to several replicas reports the
    strongest)."""

    #: No replica knew the request (never seen, expired, or already cancelled).
    NOT_FOUND = 0
    #: The request had been assigned; its reservation was released.
    RELEASED = 1
    #: The request was waiting in the pool and left it (its assign ends with `Cancelled`).
    WITHDRAWN = 2


def parse_address(addr: str, tls: bool) -> str:
    """The gRPC target of one replica address: `host:port`, `http://host:port` (plaintext) or
    `https://host:port` (TLS); an IPv6 host in brackets."""
    a = addr.strip()
    for scheme, wants_tls in (("http://", False), ("https://", True)):
        if a.startswith(scheme):
            if wants_tls != tls:
                raise ValueError(
                    f"decision address {addr!r}: {scheme} but the client is "
                    + ("configured with TLS" if tls else "not configured with TLS")
                )
            a = a[len(scheme) :]
            break
    a = a.rstrip("/")
    host, sep, port = a.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in a:
        raise ValueError(
            f"decision address {addr!r}: want host:port (http:// or https:// optional)"
        )
    return a


def default_addresses() -> List[str]:
    """The addresses of a client given none: ADDRESS_ENV's (comma-separated) when it is set and
    not empty, else DEFAULT_ADDRESS.

    The variable is read as the Rust binaries read it: its URLs say where, and the client's
    certificates (`tls`), not the scheme, say whether the connection uses TLS (the services'
    addresses stay `http://` under mutual TLS). So a scheme there is dropped, where an explicit
    address's scheme must agree with `tls`."""
    value = os.environ.get(ADDRESS_ENV, "").strip()
    if not value:
        return [DEFAULT_ADDRESS]
    out = []
    for a in split_addresses(value):
        for scheme in ("http://", "https://"):
            if a.startswith(scheme):
                a = a[len(scheme) :]
                break
        out.append(a)
    return out


def split_addresses(addresses: Union[str, Iterable[str]]) -> List[str]:
    """A list of addresses from a list, or from one string separated by commas (as the
    services' address flags take them)."""
    items = addresses.split(",") if isinstance(addresses, str) else list(addresses)
    out: List[str] = []
    for a in items:
        a = a.strip()
        if a and a not in out:
            out.append(a)
    if not out:
        raise ValueError("no decision service address")
    return out


class Replica:
    """One decision replica: its address, its stub, and what the calls through it showed.
    Thread-safe (the sync client is called from many threads)."""

    def __init__(self, addr: str, channel, stub):
        self.addr = addr
        self.channel = channel
        self.stub = stub
        self._lock = threading.Lock()
        self._failures = 0
        self._down_until: Optional[float] = None

    def succeeded(self) -> None:
        with self._lock:
            self._failures = 0
            self._down_until = None

    def failed(self, now: float) -> None:
        with self._lock:
            self._failures += 1
            self._down_until = now + _ejection(self._failures)

    def try_take(self, now: float) -> bool:
        """Takes the replica for one call if it is healthy, or if its time out is up (then this
        call is the probe, and the others keep skipping it until the probe fails or succeeds)."""
        with self._lock:
            if self._down_until is None:
                return True
            if self._down_until <= now:
                self._down_until = now + _ejection(self._failures)
                return True
            return False

    def down_until(self) -> Optional[float]:
        with self._lock:
            return self._down_until

    def is_down(self, now: float) -> bool:
        d = self.down_until()
        return d is not None and d > now


def _ejection(failures: int) -> float:
    """How long a replica with `failures` consecutive failures is skipped."""
    return _ceiling(FIRST_EJECTION, MAX_EJECTION, max(failures - 1, 0))


class Replicas:
    """The replicas in the given order, and which one a call tries next."""

    def __init__(self, replicas: Sequence[Replica], selection: Selection):
        self.list = list(replicas)
        self.selection = selection
        self._next = 0
        self._lock = threading.Lock()

    def pick(self, tried: List[bool], now: float) -> Optional[int]:
        """The replica for the next attempt of a call that already tried `tried`: a healthy (or
        due for a probe) one it has not tried, in the order of the selection; else the untried
        one back soonest. None: every replica was tried."""
        n = len(self.list)
        start = 0
        if self.selection is Selection.ROUND_ROBIN:
            with self._lock:
                start = self._next % n
                self._next += 1
        order = [(start + i) % n for i in range(n)]
        for i in order:
            if not tried[i] and self.list[i].try_take(now):
                return i
        untried = [i for i in order if not tried[i]]
        if not untried:
            return None
        # Every untried replica is down: try the one back soonest rather than none.
        return min(untried, key=lambda i: self.list[i].down_until() or 0.0)


# --- the plans -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """Call Assign on one replica with this timeout (seconds)."""

    replica: Replica
    timeout: float


@dataclass(frozen=True)
class CallAll:
    """Call Cancel on each of these replicas at once with this timeout; send back one Outcome
    per replica, in order."""

    replicas: List[Replica]
    timeout: float


@dataclass(frozen=True)
class Sleep:
    seconds: float


@dataclass(frozen=True)
class Outcome:
    """What one call gave: a response, or a status code and its details."""

    response: object = None
    code: Optional[grpc.StatusCode] = None
    details: str = ""


def outcome_of_error(e: grpc.RpcError) -> Outcome:
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = e.details() if hasattr(e, "details") else str(e)
    return Outcome(code=code, details=details or "")


def retryable(code: grpc.StatusCode, details: str) -> bool:
    """Whether a failed call may be repeated with the same request id (on another replica)."""
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION):
        return True
    if code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL):
        # A connection that broke under the call ("Stream removed", "Socket closed"); the
        # decision service itself never sends UNKNOWN, and its INTERNAL names a refusal.
        d = details.lower()
        return any(w in d for w in ("stream removed", "socket closed", "connection", "transport"))
    return False


def validate(
    group: str,
    request_id: str,
    prompt_tokens: int,
    prompt_hash,
    max_tokens,
    expected_output_tokens=None,
    request_class=None,
) -> None:
    """What cannot even be encoded is refused here, typed as the server would (the server
    validates everything else: lengths, ranges, the group, the class key's characters)."""

    def bad(msg: str):
        raise errors.InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, msg, attempts=0)

    if not isinstance(group, str) or not isinstance(request_id, str):
        bad("group and request_id must be strings")
    if request_class is not None and not isinstance(request_class, str):
        bad(f"request_class must be a string, not {request_class!r}")
    for name, value, top in (
        ("prompt_tokens", prompt_tokens, _U32),
        ("max_tokens", max_tokens, _U32),
        ("prompt_hash", prompt_hash, _U64),
        ("expected_output_tokens", expected_output_tokens, _U32),
    ):
        if value is None and name != "prompt_tokens":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
            bad(f"{name} must be an integer in 0..={top}, not {value!r}")


AssignPlan = Generator[Union[Call, Sleep], Optional[Outcome], Assignment]


def assign_request(
    pb,
    group: str,
    request_id: str,
    prompt_tokens: int,
    prompt_hash,
    max_tokens,
    expected_output_tokens,
    request_class,
):
    """The AssignRequest of one call (`pb` the generated module), after `validate`: the same
    for the blocking and the asyncio client."""
    validate(
        group,
        request_id,
        prompt_tokens,
        prompt_hash,
        max_tokens,
        expected_output_tokens,
        request_class,
    )
    return pb.AssignRequest(
        group=group,
        request_id=request_id,
        prompt_tokens=prompt_tokens,
        prompt_hash=prompt_hash,
        max_tokens=max_tokens,
        expected_output_tokens=expected_output_tokens,
        request_class=request_class,
    )


def assign_plan(
    replicas: Replicas,
    options: ClientOptions,
    retry: RetryPolicy,
    deadline: float,
    clock=time.monotonic,
) -> AssignPlan:
    """The rules of one `assign` until `deadline` (a `clock()` value); returns the Assignment
    or raises the typed error. Every attempt carries the same request (the caller's), so a
    retry joins the same wait or gets the original answer: Assign is idempotent by (group,
    request_id) on the server, for as long as it remembers the answer (at least the reservation
    TTL), and on another replica the snapshot service's serialised Reserve answers with the
    first placement.

    * UNAVAILABLE, FAILED_PRECONDITION and broken connections are retried at once on the next
      replica (marking this one down for a while); when every replica failed in this round, a
      jittered backoff first.
    * An attempt cut short by `attempt_timeout` (DEADLINE_EXCEEDED before the caller's deadline)
      is retried the same way; DEADLINE_EXCEEDED at the caller's deadline is final: the server
      withdrew the request, nothing is reserved.
    * Anything else (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, NOT_FOUND, PERMISSION_DENIED, a
      CANCELLED the server sent because of a Cancel) is final.
    """
    attempts = 0
    rounds = 0
    tried = [False] * len(replicas.list)
    last: Optional[errors.BalanceRouteError] = None

    def out_of_time() -> errors.BalanceRouteError:
        if last is not None:
            return last
        return errors.DeadlineExceeded(
            grpc.StatusCode.DEADLINE_EXCEEDED, "not assigned before the deadline", attempts
        )

    while True:
        remaining = deadline - clock()
        if remaining <= 0:
            raise out_of_time()
        i = replicas.pick(tried, clock())
        if i is None:
            # Every replica failed once in this call: back off, then try them all again.
            rounds += 1
            tried = [False] * len(replicas.list)
            pause = retry.backoff(rounds)
            if pause >= deadline - clock():
                raise out_of_time()
            yield Sleep(pause)
            continue
        tried[i] = True
        replica = replicas.list[i]
        attempts += 1
        budget = (
            remaining
            if options.attempt_timeout is None
            else min(options.attempt_timeout, remaining)
        )
        started = clock()
        outcome = yield Call(replica, budget)
        assert outcome is not None
        if outcome.code is None:
            replica.succeeded()
            r = outcome.response
            return Assignment(
                worker_id=r.worker_id,
                endpoint=r.endpoint,
                incarnation=r.incarnation,
                policy=r.policy,
                pool_wait=r.pool_wait_us / 1e6,
                sigma_version=r.sigma_version,
                stale=r.stale,
                attempts=attempts,
                replica=replica.addr,
            )
        code, details = outcome.code, outcome.details
        # An attempt that ended at its timeout: DEADLINE_EXCEEDED (the server's or this side's),
        # or a CANCELLED that came at the timeout rather than well before it (a real Cancel).
        timed_out = code == grpc.StatusCode.DEADLINE_EXCEEDED or (
            code == grpc.StatusCode.CANCELLED and clock() - started >= 0.9 * budget
        )
        if timed_out and budget >= remaining:
            raise errors.DeadlineExceeded(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                details or "not assigned before the deadline",
                attempts,
            )
        if not (retryable(code, details) or timed_out) or retry.exhausted(attempts):
            raise errors.from_status(code, details, attempts)
        replica.failed(clock())
        if timed_out:
            last = errors.Unavailable(
                grpc.StatusCode.UNAVAILABLE,
                f"{replica.addr}: no answer within the attempt timeout {budget:.3f}s",
                attempts,
            )
        else:
            kind = (
                errors.FailedPrecondition
                if code == grpc.StatusCode.FAILED_PRECONDITION
                else errors.Unavailable
            )
            c = code if kind is errors.FailedPrecondition else grpc.StatusCode.UNAVAILABLE
            last = kind(c, f"{replica.addr}: {details}", attempts)


CancelPlan = Generator[Union[CallAll, Sleep], Optional[List[Outcome]], CancelOutcome]


def cancel_plan(
    replicas: Replicas, retry: RetryPolicy, deadline: float, clock=time.monotonic
) -> CancelPlan:
    """The rules of one `cancel`: sent to every replica at once (an earlier attempt of the
    request may wait in one replica's pool while another reserved it); transient failures are
    retried, with backoff, until `deadline`. The outcome is the strongest any replica reported;
    an error only if no replica answered."""
    pending = list(replicas.list)
    best: Optional[CancelOutcome] = None
    error: Optional[errors.BalanceRouteError] = None
    rounds = 0
    while pending:
        remaining = deadline - clock()
        if remaining <= 0:
            break
        outcomes = yield CallAll(pending, remaining)
        assert outcomes is not None
        rounds += 1
        again = []
        for replica, o in zip(pending, outcomes):
            if o.code is None:
                best = (
                    max(best, _cancel_outcome(o.response))
                    if best is not None
                    else _cancel_outcome(o.response)
                )
                continue
            if retryable(o.code, o.details) and not retry.exhausted(rounds):
                again.append(replica)
            e = errors.from_status(o.code, f"{replica.addr}: {o.details}", rounds)
            # The first final error is the most telling (e.g. PERMISSION_DENIED).
            if error is None or (error.retryable and not e.retryable):
                error = e
        pending = again
        if pending:
            pause = retry.backoff(rounds)
            if pause >= deadline - clock():
                break
            yield Sleep(pause)
    if best is not None:
        return best
    if error is not None:
        raise error
    raise errors.DeadlineExceeded(
        grpc.StatusCode.DEADLINE_EXCEEDED, "no replica answered the cancel in time", rounds
    )


def _cancel_outcome(resp) -> CancelOutcome:
    # The wire enum: 1 WITHDRAWN, 2 RELEASED, 3 NOT_FOUND (0 UNSPECIFIED reads as NOT_FOUND).
    return {1: CancelOutcome.WITHDRAWN, 2: CancelOutcome.RELEASED}.get(
        resp.outcome, CancelOutcome.NOT_FOUND
    )

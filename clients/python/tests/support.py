"""Test helpers: bounded waits, a br-decision process the test owns (to kill -9 or freeze), a
port nobody listens on, and a TCP proxy that loses one answer."""

import json
import os
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid


def wait_until(predicate, timeout, what):
    """Polls `predicate` until it returns a truthy value (returned) or `timeout` seconds pass
    (AssertionError naming `what`)."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except Exception as e:  # noqa: BLE001 - kept for the failure message
            last = e
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout}s waiting for {what} (last error: {last!r})"
            )
        time.sleep(0.05)


def http_ok(url):
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


class DecisionProcess:
    """A br-decision of the test's own (port 0, --ready-file) against the stack's snapshot
    service, deciding for `group` like the stack's decision (active-active). Killed by its pid
    only, at the latest in `stop`."""

    def __init__(self, bin_dir, snapshot_addr, group, policy="jsq", log_dir=None):
        self.dir = tempfile.mkdtemp(prefix="br-decision-", dir=log_dir)
        ready = os.path.join(self.dir, "ready.json")
        self.log = open(os.path.join(self.dir, "decision.log"), "wb")
        self.proc = subprocess.Popen(
            [
                os.path.join(bin_dir, "br-decision"),
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
                "--ready-file",
                ready,
                "--snapshot-addr",
                f"http://{snapshot_addr}",
                "--groups",
                group,
                "--policy",
                policy,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

        def bound():
            assert self.proc.poll() is None, (
                f"br-decision exited with {self.proc.returncode}; see {self.dir}"
            )
            with open(ready) as f:
                return json.load(f)

        ports = wait_until(bound, 30, f"br-decision's ready file ({self.dir})")
        self.addr = ports["grpc"]
        self.admin = ports["admin"]
        wait_until(
            lambda: http_ok(f"http://{self.admin}/readyz"), 30, f"br-decision ready ({self.dir})"
        )

    def kill9(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def freeze(self):
        """SIGSTOP, then waits until every thread of the process is stopped: the signal is
        delivered asynchronously, and a thread still running could answer a call the test
        sends next as if the process were not frozen."""
        self.proc.send_signal(signal.SIGSTOP)
        wait_until(
            lambda: self._thread_states() <= {"T"}, 10, f"br-decision stopped ({self.dir})"
        )

    def thaw(self):
        self.proc.send_signal(signal.SIGCONT)
        wait_until(
            lambda: "T" not in self._thread_states(), 10, f"br-decision resumed ({self.dir})"
        )

    def _thread_states(self):
        """The scheduler states (/proc/<pid>/task/<tid>/stat, field 3) of the process's threads;
        'T' is stopped by a signal."""
        states = set()
        task_dir = f"/proc/{self.proc.pid}/task"
        for tid in os.listdir(task_dir):
            try:
                with open(f"{task_dir}/{tid}/stat") as f:
                    # The name (field 2) is in parentheses and may hold spaces.
                    states.add(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:
                pass  # a thread that exited meanwhile
        return states

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.log.close()


def unread_bytes(port):
    """Bytes waiting unread in the receive queues of the established loopback TCP connections
    whose local port is `port` (/proc/net/tcp): how a test sees that a call reached a process
    that is frozen and cannot read it."""
    total = 0
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            local, state, queues = fields[1], fields[3], fields[4]
            if state == "01" and int(local.split(":")[1], 16) == port:
                total += int(queues.split(":")[1], 16)
    return total


class DeadPort:
    """A loopback port bound but never listened on: connecting is refused, and nobody else can
    take the port while the test holds it."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.addr = "127.0.0.1:%d" % self.sock.getsockname()[1]

    def close(self):
        self.sock.close()


_HEADERS = 0x1
_END_STREAM = 0x1


class LosingProxy:
    """A TCP proxy to `upstream` whose FIRST connection loses the server's answer: the client's
    bytes go through, the server's HTTP/2 frames of every stream are dropped (connection-level
    frames, stream 0, pass so the connection works), and once the server ends a stream (a
    HEADERS frame with END_STREAM: the answer's trailers) the client's connection is reset.
    The server answered; the client never heard it. Later connections pass untouched."""

    def __init__(self, upstream):
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.addr = "127.0.0.1:%d" % self.listener.getsockname()[1]
        self.lost = threading.Event()
        self.connections = 0
        self._lock = threading.Lock()
        self._socks = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
                first = self.connections == 1
            up = socket.create_connection(self.upstream)
            self._socks += [conn, up]
            threading.Thread(target=self._pump, args=(conn, up), daemon=True).start()
            target = self._lose if first else self._pump
            threading.Thread(target=target, args=(up, conn), daemon=True).start()

    @staticmethod
    def _pump(src, dst):
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _lose(self, up, conn):
        buf = b""
        try:
            while True:
                data = up.recv(65536)
                if not data:
                    break
                buf += data
                while len(buf) >= 9:
                    length = int.from_bytes(buf[0:3], "big")
                    if len(buf) < 9 + length:
                        break
                    frame, buf = buf[: 9 + length], buf[9 + length :]
                    ftype, flags = frame[3], frame[4]
                    stream = int.from_bytes(frame[5:9], "big") & 0x7FFFFFFF
                    if stream == 0:
                        conn.sendall(frame)
                    elif ftype == _HEADERS and flags & _END_STREAM:
                        # The answer is complete and lost: reset the client's connection.
                        self.lost.set()
                        conn.setsockopt(
                            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                        )
                        conn.close()
                        up.close()
                        return
        except OSError:
            pass

    def close(self):
        self.listener.close()
        for s in self._socks:
            try:
                s.close()
            except OSError:
                pass


def rid(name):
    """A request id no other run of the tests used (the stack may outlive one run)."""
    return f"py-client-{name}-{uuid.uuid4().hex[:8]}"


def same_answer(a, b):
    return (a.worker_id, a.incarnation, a.endpoint, a.sigma_version) == (
        b.worker_id,
        b.incarnation,
        b.endpoint,
        b.sigma_version,
    )

"""Holds many HTTP/JSON request bodies half-sent, then lets them all go.

Opens CONNECTIONS connections to br-decision's HTTP/JSON port, spread over the source addresses
127.0.0.1 .. 127.0.0.N (so the per-address connection limit is not what stops them), and on each
sends an Assign's headers with `Content-Length: DECLARED` and SENT bytes of the body, never the
rest. Holds them HOLD seconds, then closes every one. Prints how many were held open to the end
and how many the server answered early (the in-flight budget's 429, or a closed connection).

    python3 hold_http_bodies.py HOST:PORT [--connections 2000] [--declared 60000]
        [--sent 40000] [--hold 10] [--sources 4]
"""

import argparse
import asyncio
import sys


async def hold_one(host, port, source, declared, sent, release, counts):
    try:
        reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
    except OSError:
        counts["refused_at_connect"] += 1
        return
    head = (
        f"POST /v1/assign HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {declared}\r\n\r\n"
    ).encode()
    try:
        writer.write(head + b'{"request_id": "' + b"x" * (sent - 16))
        await writer.drain()
        # Either the server answers before the body is done (refused) or the hold ends.
        answer = asyncio.ensure_future(reader.read(1))
        done, _ = await asyncio.wait({answer, release}, return_when=asyncio.FIRST_COMPLETED)
        if answer in done:
            counts["answered_early"] += 1
        else:
            answer.cancel()
            counts["held"] += 1
    except OSError:
        counts["broken"] += 1
    finally:
        writer.close()


async def main():
    p = argparse.ArgumentParser()
    p.add_argument("addr")
    p.add_argument("--connections", type=int, default=2000)
    p.add_argument("--declared", type=int, default=60000)
    p.add_argument("--sent", type=int, default=40000)
    p.add_argument("--hold", type=float, default=10.0)
    p.add_argument("--sources", type=int, default=4)
    a = p.parse_args()
    host, port = a.addr.rsplit(":", 1)
    counts = {"held": 0, "answered_early": 0, "refused_at_connect": 0, "broken": 0}
    release = asyncio.get_running_loop().create_future()
    tasks = [
        asyncio.ensure_future(
            hold_one(host, int(port), f"127.0.0.{1 + i % a.sources}", a.declared, a.sent, release, counts)
        )
        for i in range(a.connections)
    ]
    await asyncio.sleep(a.hold)
    release.set_result(None)
    await asyncio.gather(*tasks)
    print(
        f"{a.connections} connections, {a.sent} of {a.declared} body bytes each: "
        + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in counts.items()),
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))

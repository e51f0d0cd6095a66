//! The Lua gateways' end-to-end harness (`gateways/`): a real nginx or HAProxy process running
//! the example configuration from `gateways/<kind>/` with its listen address, br-decision's
//! address and its paths replaced, in front of br-all, one br-shim serving every rank of a
//! `br-emu engine`.
//!
//! Without the gateway's binary (or nginx's Lua module) a test prints SKIPPED and passes,
//! unless `BR_REQUIRE_GATEWAYS=1` (CI, after `make gateways`) makes that a failure.

use std::io::Write as _;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use br_proto::v1;
use br_proto::v1::snapshot_client::SnapshotClient;
use br_testkit::eventually_some;

use crate::engine::EmuEngine;
use crate::{Service, root};

/// The group the gateways' configurations assign in (they are rendered with it).
pub const GROUP: &str = "gw";
/// Ranks of the emulated engine, one shim serving them all (`/rank/<n>` endpoints).
pub const RANKS: u32 = 2;
/// A hang guard for one wait on a loaded 2-core machine, not a timing assertion.
pub const LONG: Duration = Duration::from_secs(60);
/// The header a client gives its expected output tokens in (as for decision's ext_proc).
pub const EXPECTED_OUTPUT_HEADER: &str = "X-BalanceRoute-Expected-Output-Tokens";
/// The Gateway API Inference Extension's header of the request's class.
pub const CLASS_HEADER: &str = "X-Gateway-Inference-Objective";

/// Which gateway.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Nginx,
    Haproxy,
}

impl Kind {
    fn binary(self) -> &'static str {
        match self {
            Kind::Nginx => "nginx",
            Kind::Haproxy => "haproxy",
        }
    }

    fn dir(self) -> &'static str {
        match self {
            Kind::Nginx => "openresty",
            Kind::Haproxy => "haproxy",
        }
    }

    fn config_name(self) -> &'static str {
        match self {
            Kind::Nginx => "nginx.conf",
            Kind::Haproxy => "haproxy.cfg",
        }
    }
}

/// The gateway's binary, or why not: `None` (the test prints SKIPPED) without it, a panic
/// when `BR_REQUIRE_GATEWAYS=1` asks for it.
pub fn find(kind: Kind, test: &str) -> Option<PathBuf> {
    let required = std::env::var("BR_REQUIRE_GATEWAYS").is_ok_and(|v| v == "1");
    let found = ["/usr/sbin", "/usr/bin", "/usr/local/sbin", "/usr/local/bin"]
        .iter()
        .map(|d| Path::new(d).join(kind.binary()))
        .find(|p| p.is_file());
    let why = match (&found, kind) {
        (None, _) => Some(format!(
            "no {} installed; run scripts/install-gateways.sh (Debian's packages)",
            kind.binary()
        )),
        (Some(_), Kind::Nginx) if !Path::new(NGINX_LUA_MODULE).is_file() => Some(format!(
            "no {NGINX_LUA_MODULE}; run scripts/install-gateways.sh (libnginx-mod-http-lua)"
        )),
        _ => None,
    };
    if let Some(why) = why {
        assert!(!required, "BR_REQUIRE_GATEWAYS=1 but {why}");
        // On the real stderr: libtest captures the output of passing tests, and a skip nobody
        // sees is a silent pass.
        let _ = writeln!(std::io::stderr(), "\n{test}: SKIPPED: {why}");
        return None;
    }
    found
}

const NGINX_LUA_MODULE: &str = "/usr/lib/nginx/modules/ngx_http_lua_module.so";

/// A port free right now on 127.0.0.1 (bound and let go), for a process that must keep its
/// port across a restart or takes its port from a configuration file. It is chosen below the
/// kernel's ephemeral range (`ip_local_port_range`): a port from `bind(0)` comes from that
/// range, where the outgoing connections of every test running beside this one, and their
/// own `bind(0)`s, could take it before the process bound it (br-all then exited at start,
/// a few times in a thousand runs with three test binaries side by side).
pub fn free_port() -> u16 {
    use std::hash::{BuildHasher as _, Hasher as _};
    const LOWEST: u32 = 10_000;
    let ephemeral_from = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32_768);
    let span = ephemeral_from.saturating_sub(LOWEST);
    // A different start in every process, so tests side by side do not try the same ports.
    let start = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    for i in 0..u64::from(span.min(4_096)) {
        let port = LOWEST + (start.wrapping_add(i) % u64::from(span)) as u32;
        let port = u16::try_from(port).expect("below the ephemeral range, so below 65,536");
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    // No room below the ephemeral range (an unusual ip_local_port_range): take one from it.
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// br-all with HTTP/JSON on a fixed port (kept across a restart), the engine, and one shim
/// serving every rank.
pub struct Stack {
    pub all: Service,
    pub engine: EmuEngine,
    pub shim: Service,
    /// br-all's `--http-listen` address, which the gateway calls.
    pub decision_http: SocketAddr,
}

impl Stack {
    /// Starts everything and waits until σ holds every rank LIVE and decision is ready.
    /// `capacity` is each rank's number of places (`--capacity`).
    pub async fn start(capacity: u32) -> Stack {
        let decision_http = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let http = decision_http.to_string();
        let all = Service::start(
            "br-all",
            &[
                "--groups",
                GROUP,
                "--http-listen",
                &http,
                // A reservation nobody releases stays for the whole test: only a Cancel or the
                // shim can make σ let it go.
                "--reservation-ttl",
                "10m",
                "--worker-grace",
                "1s",
                // An Assign waiting for a place waits past the tests' hang guards: only the
                // gateway (a Cancel, a closed connection) ends it within a test.
                "--max-wait",
                "10m",
            ],
        );
        let engine = EmuEngine::start(&[
            "--ranks",
            &RANKS.to_string(),
            "--slots",
            "64",
            "--time-scale",
            "0.1",
        ]);
        let shim = Service::start(
            "br-shim",
            &[
                "--upstream",
                &engine.dp_url(),
                "--ingest-addr",
                &all.grpc_url(),
                "--group",
                GROUP,
                "--worker-ids",
                &format!("0-{}", RANKS - 1),
                "--dp-rank-header",
                "X-data-parallel-rank",
                "--capacity",
                &capacity.to_string(),
            ],
        );
        let stack = Stack {
            all,
            engine,
            shim,
            decision_http,
        };
        stack.wait_ready().await;
        stack
    }

    /// Waits until σ holds every rank LIVE and decision's `/readyz` answers 200.
    pub async fn wait_ready(&self) {
        eventually_some(LONG, "every rank LIVE in σ", || async {
            let live = self
                .sigma()
                .await?
                .workers
                .iter()
                .filter(|w| w.liveness == v1::Liveness::Live as i32)
                .count();
            (live == RANKS as usize).then_some(())
        })
        .await;
        self.all.wait_for("/readyz", LONG).await;
    }

    /// σ of [`GROUP`], or None while br-all does not answer.
    pub async fn sigma(&self) -> Option<v1::ClusterSnapshot> {
        let mut c = SnapshotClient::connect(self.all.grpc_url()).await.ok()?;
        let r = c
            .get(v1::GetRequest {
                group: GROUP.into(),
            })
            .await
            .ok()?;
        Some(r.into_inner())
    }

    /// The request `id` in σ, if σ holds it.
    pub async fn request(&self, id: &str) -> Option<v1::RequestState> {
        self.sigma()
            .await?
            .requests
            .into_iter()
            .find(|r| r.request_id == id)
    }

    /// A series' value from br-all's metrics, summed over the series whose labels include
    /// every `label="value"` in `want`.
    pub async fn metric(&self, name: &str, want: &[&str]) -> f64 {
        let text = self.all.metrics().await;
        text.lines()
            .filter(|l| l.starts_with(name) && l[name.len()..].starts_with('{'))
            .filter(|l| want.iter().all(|w| l.contains(w)))
            .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
            .sum()
    }
}

/// A running gateway process, killed on drop; its configuration, pid file and logs live in a
/// temporary directory.
pub struct Gateway {
    pub addr: SocketAddr,
    child: Option<Child>,
    dir: tempfile::TempDir,
    kind: Kind,
}

impl Gateway {
    /// Renders `gateways/<kind>/<config>` (listen address, decision address, group, paths,
    /// and `extra` replacements of the test's own) and starts `binary` on it; returns once it
    /// accepts connections.
    pub async fn start(
        kind: Kind,
        binary: &Path,
        decision: SocketAddr,
        extra: &[(&str, &str)],
    ) -> Gateway {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let template_path = root()
            .join("gateways")
            .join(kind.dir())
            .join(kind.config_name());
        let template = std::fs::read_to_string(&template_path)
            .unwrap_or_else(|e| panic!("reading {}: {e}", template_path.display()));
        let state = dir.path().to_str().expect("a UTF-8 temporary path");
        let gateways = root().join("gateways");
        let mut replacements: Vec<(String, String)> = vec![
            (
                format!("/tmp/balanceroute-{}", kind.binary()),
                state.to_owned(),
            ),
            (
                "/usr/local/share/balanceroute/gateways".into(),
                gateways.to_str().expect("a UTF-8 path").to_owned(),
            ),
            ("127.0.0.1:8080".into(), addr.to_string()),
            ("127.0.0.1:8063".into(), decision.to_string()),
        ];
        replacements.extend(
            extra
                .iter()
                .map(|(a, b)| ((*a).to_owned(), (*b).to_owned())),
        );
        let mut config = template;
        for (from, to) in &replacements {
            assert!(
                config.contains(from.as_str()),
                "{} no longer contains {from:?}",
                template_path.display()
            );
            config = config.replace(from.as_str(), to);
        }
        let config_path = dir.path().join(kind.config_name());
        std::fs::write(&config_path, config).expect("writing the configuration");
        let log = std::fs::File::create(dir.path().join("stderr.log")).expect("a log file");
        let mut cmd = Command::new(binary);
        match kind {
            // -e: the error log before the configuration is read (the compiled-in one is
            // under /var/log, which another user may not write)
            Kind::Nginx => cmd
                .arg("-p")
                .arg(dir.path())
                .arg("-e")
                .arg(dir.path().join("error.log"))
                .arg("-c")
                .arg(&config_path),
            Kind::Haproxy => cmd.arg("-db").arg("-f").arg(&config_path),
        };
        let child = cmd
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("a log file"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", binary.display()));
        let mut gateway = Gateway {
            addr,
            child: Some(child),
            dir,
            kind,
        };
        gateway.wait_listening().await;
        gateway
    }

    async fn wait_listening(&mut self) {
        let addr = self.addr;
        eventually_some(
            LONG,
            &format!("{:?} accepts connections on {addr}", self.kind),
            || {
                let exited = self
                    .child
                    .as_mut()
                    .and_then(|c| c.try_wait().ok().flatten());
                if let Some(status) = exited {
                    panic!(
                        "{:?} exited ({status}) before it listened: {}",
                        self.kind,
                        self.logs()
                    );
                }
                async move { tokio::net::TcpStream::connect(addr).await.ok().map(drop) }
            },
        )
        .await;
    }

    /// What the gateway logged (its stderr and, for nginx, its error log), for failure messages.
    pub fn logs(&self) -> String {
        ["stderr.log", "error.log"]
            .iter()
            .filter_map(|f| std::fs::read_to_string(self.dir.path().join(f)).ok())
            .collect::<Vec<_>>()
            .join("\n")
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

impl Drop for Gateway {
    /// SIGTERM first: nginx's master then stops its worker, which a SIGKILL of the master
    /// would leave running with the port; SIGKILL if it has not exited within a bound.
    fn drop(&mut self) {
        let Some(mut c) = self.child.take() else {
            return;
        };
        let _ = Command::new("kill")
            .args(["-TERM", &c.id().to_string()])
            .status();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::time::Instant::now() < deadline {
            if let Ok(Some(_)) = c.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// A streaming completion's body for the emulated engine.
pub fn completion(max_tokens: u32) -> String {
    serde_json::json!({"model": "br-emu", "prompt": "x", "max_tokens": max_tokens, "stream": true})
        .to_string()
}

/// A client holding a streaming answer open through the gateway: a raw connection (dropped
/// to leave mid-stream) that has read the response head and the first event.
pub struct OpenStream {
    pub stream: tokio::net::TcpStream,
    /// The response head and what came after it so far.
    pub received: String,
}

impl OpenStream {
    /// `X-BalanceRoute-Worker`, the rank the gateway sent the request to.
    pub fn worker(&self) -> Option<u32> {
        header(&self.received, "x-balanceroute-worker").and_then(|v| v.parse().ok())
    }
}

/// A header's value in a raw response head (names compared without case).
pub fn header(head: &str, name: &str) -> Option<String> {
    head.split("\r\n\r\n").next()?.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim()
            .eq_ignore_ascii_case(name)
            .then(|| v.trim().to_owned())
    })
}

/// The raw `POST /v1/completions` of `body` with `id` (none: the gateway makes one) and
/// `headers`, closing the connection after the answer.
fn completion_request(id: Option<&str>, headers: &[(&str, &str)], body: &str) -> String {
    let more: String = id
        .map(|id| ("X-Request-Id", id))
        .iter()
        .chain(headers)
        .map(|(name, value)| format!("{name}: {value}\r\n"))
        .collect();
    format!(
        "POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n{more}Connection: close\r\n\r\n{body}",
        body.len()
    )
}

/// Sends `POST /v1/completions` with `id` (none: the gateway makes one) over a raw connection
/// and reads until `until` appears in what came back (the connection is returned open).
pub async fn send_raw(gw: SocketAddr, id: Option<&str>, body: &str, until: &str) -> OpenStream {
    send_with(gw, id, &[], body, until).await
}

/// [`send_raw`] with more request `headers`.
pub async fn send_with(
    gw: SocketAddr,
    id: Option<&str>,
    headers: &[(&str, &str)],
    body: &str,
    until: &str,
) -> OpenStream {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::TcpStream::connect(gw)
        .await
        .expect("the gateway accepts");
    stream
        .write_all(completion_request(id, headers, body).as_bytes())
        .await
        .expect("sending");
    let mut received = Vec::new();
    br_testkit::within(LONG, &format!("{until:?} through the gateway"), async {
        let mut buf = [0u8; 4096];
        while !String::from_utf8_lossy(&received).contains(until) {
            let n = stream.read(&mut buf).await.expect("reading");
            assert!(
                n > 0,
                "the gateway closed before {until:?}: {}",
                String::from_utf8_lossy(&received)
            );
            received.extend_from_slice(&buf[..n]);
        }
    })
    .await;
    OpenStream {
        stream,
        received: String::from_utf8_lossy(&received).into_owned(),
    }
}

/// Opens a long streaming completion `id` through the gateway and waits until σ shows it
/// decoding on the rank the gateway says it chose: the request reached that rank's shim with
/// its id. Returns the open stream.
pub async fn open_long_stream(stack: &Stack, gw: SocketAddr, id: &str) -> OpenStream {
    open_stream(stack, gw, Some(id)).await.0
}

/// [`open_long_stream`] without an `X-Request-Id`: the gateway makes one, says it in the
/// answer's `X-Request-Id`, and σ shows the request decoding under it. Returns the stream and
/// the id.
pub async fn open_anonymous_stream(stack: &Stack, gw: SocketAddr) -> (OpenStream, String) {
    open_stream(stack, gw, None).await
}

async fn open_stream(stack: &Stack, gw: SocketAddr, id: Option<&str>) -> (OpenStream, String) {
    open_stream_with(stack, gw, id, &[], &completion(1_000_000)).await
}

/// [`open_stream`] of `body` (a completion long enough to be seen decoding) with `headers`.
async fn open_stream_with(
    stack: &Stack,
    gw: SocketAddr,
    id: Option<&str>,
    headers: &[(&str, &str)],
    body: &str,
) -> (OpenStream, String) {
    let open = send_with(gw, id, headers, body, "data:").await;
    assert!(
        open.received.starts_with("HTTP/1.1 200"),
        "{}",
        open.received
    );
    let answered = header(&open.received, "x-request-id").unwrap_or_default();
    if let Some(id) = id {
        assert_eq!(answered, id, "{}", open.received);
    }
    assert!(!answered.is_empty(), "{}", open.received);
    let id = answered.as_str();
    let worker = open.worker().expect("X-BalanceRoute-Worker in the answer");
    eventually_some(
        LONG,
        &format!("{id} decoding in σ on worker {worker}"),
        || async {
            let r = stack.request(id).await?;
            (r.worker_id == worker
                && r.state == v1::RequestPhase::Active as i32
                && r.generated_tokens > 0)
                .then_some(())
        },
    )
    .await;
    (open, answered)
}

/// Waits until σ no longer holds `id`.
pub async fn wait_released(stack: &Stack, id: &str) {
    eventually_some(LONG, &format!("σ lets {id} go"), || async {
        let s = stack.sigma().await?;
        (!s.requests.iter().any(|r| r.request_id == id)).then_some(())
    })
    .await;
}

/// Whole streaming completions through the gateway, one after another: each is answered as
/// server-sent events ending in `[DONE]`, and ran on the engine rank the gateway says Assign
/// chose (the engine's per-rank counters grow by one there and nowhere else). Returns the
/// ranks chosen.
pub async fn complete_through(stack: &Stack, gw: SocketAddr, prefix: &str, n: u32) -> Vec<u32> {
    let mut chosen = Vec::new();
    for i in 0..n {
        let id = format!("{prefix}-{i}");
        let before = stack.engine.requests_per_rank().await;
        // To the chunked body's last chunk: the client takes the whole answer before it goes
        // (one that closed after `[DONE]` but before the body's end would have left early).
        let done = send_raw(
            gw,
            Some(&id),
            &completion(4),
            "data: [DONE]\n\n\r\n0\r\n\r\n",
        )
        .await;
        assert!(
            done.received.starts_with("HTTP/1.1 200"),
            "{}",
            done.received
        );
        assert!(
            header(&done.received, "content-type")
                .is_some_and(|t| t.starts_with("text/event-stream")),
            "{}",
            done.received
        );
        let worker = done.worker().expect("X-BalanceRoute-Worker in the answer");
        let after = stack.engine.requests_per_rank().await;
        let grew: Vec<(usize, u64)> = after
            .iter()
            .zip(&before)
            .enumerate()
            .filter(|(_, (a, b))| a != b)
            .map(|(g, (a, b))| (g, a - b))
            .collect();
        assert_eq!(
            grew,
            vec![(worker as usize, 1)],
            "{id}: Assign chose rank {worker}; the engine ran {before:?} -> {after:?}"
        );
        chosen.push(worker);
    }
    chosen
}

/// A completion through the gateway with br-all down: the gateway answers at once with the
/// typed error (503, `X-BalanceRoute-Error: DECISION_UNREACHABLE`, a `{"code", "message"}`
/// body), never a rank picked at random; the engine ran nothing.
pub async fn refused_while_decision_is_down(stack: &Stack, gw: SocketAddr) {
    let before = stack.engine.requests_per_rank().await;
    let received = whole(send_raw(gw, Some("while-down"), &completion(4), "\r\n\r\n").await).await;
    assert!(received.starts_with("HTTP/1.1 503"), "{received}");
    assert_eq!(
        header(&received, "x-balanceroute-error").as_deref(),
        Some("DECISION_UNREACHABLE"),
        "{received}"
    );
    let v = error_body(&received);
    assert_eq!(v["code"], "DECISION_UNREACHABLE", "{received}");
    assert!(
        v["message"]
            .as_str()
            .is_some_and(|m| m.contains("unreachable")),
        "{received}"
    );
    assert_eq!(stack.engine.requests_per_rank().await, before);
}

/// How many Cancels br-all's HTTP port has answered (`POST /v1/cancel`).
pub async fn cancels_answered(stack: &Stack) -> f64 {
    stack
        .metric(
            "balanceroute_decision_http_requests_total",
            &[r#"route="/v1/cancel""#],
        )
        .await
}

/// A client that leaves mid-stream: σ lets the request go (the gateway closed the shim's
/// connection) and the gateway sends Cancel.
pub async fn leaves_mid_stream(stack: &Stack, gw: SocketAddr, id: &str) {
    let before = cancels_answered(stack).await;
    let open = open_long_stream(stack, gw, id).await;
    drop(open);
    wait_released(stack, id).await;
    br_testkit::eventually(
        LONG,
        &format!("the gateway sends Cancel for {id}, whose client left"),
        || async { cancels_answered(stack).await > before },
    )
    .await;
}

/// With one place per rank (`Stack::start(1)`) and the gateway's Assign deadline longer than
/// [`LONG`]: two open streams fill every rank, a third client's Assign waits in decision's
/// pool, the client leaves, and the gateway cancels that Assign: the pool empties while the
/// ranks are still full, no reservation is left, and a Cancel was answered. The two streams
/// are then closed and released.
pub async fn leaves_while_assign_waits(stack: &Stack, gateway: &Gateway, prefix: &str) {
    use tokio::io::AsyncWriteExt as _;
    let gw = gateway.addr;
    let first = open_long_stream(stack, gw, &format!("{prefix}-fill-a")).await;
    let second = open_long_stream(stack, gw, &format!("{prefix}-fill-b")).await;
    let in_group = format!("group=\"{GROUP}\"");
    let in_group = [in_group.as_str()];
    let pool = || stack.metric("balanceroute_decision_pool_size", &in_group);
    let before = cancels_answered(stack).await;
    let id = format!("{prefix}-waits");
    let waiting = {
        let mut s = tokio::net::TcpStream::connect(gw).await.unwrap();
        s.write_all(completion_request(Some(&id), &[], &completion(4)).as_bytes())
            .await
            .unwrap();
        s
    };
    br_testkit::eventually(LONG, &format!("{id} waits in decision's pool"), || async {
        pool().await == 1.0
    })
    .await;
    drop(waiting);
    // The last pool size and Cancel count read, and the gateway's log, for a failure message.
    let seen = std::sync::Mutex::new((1.0, before));
    br_testkit::eventually_or(
        LONG,
        &format!("the gateway cancels the Assign of {id}, whose client left"),
        || async {
            let now = (pool().await, cancels_answered(stack).await);
            *seen.lock().unwrap() = now;
            now.0 == 0.0 && now.1 > before
        },
        || {
            let (pool, cancels) = *seen.lock().unwrap();
            format!(
                "pool size {pool}, Cancels answered {cancels} (before the client left: \
                 {before}); the gateway logged:\n{}",
                gateway.logs()
            )
        },
    )
    .await;
    assert!(
        stack.request(&id).await.is_none(),
        "no reservation for a client that left"
    );
    drop((first, second));
    wait_released(stack, &format!("{prefix}-fill-a")).await;
    wait_released(stack, &format!("{prefix}-fill-b")).await;
}

/// What σ holds of a request's output-length hints: its `max_tokens`, expected output tokens
/// and class id, as Assign took them.
pub type Hints = (Option<u32>, Option<u32>, Option<u64>);

/// Opens the long streaming completion `id` (`body`, with `headers`) through the gateway,
/// reads the hints σ holds for it while it decodes, then leaves and waits until σ lets it go.
pub async fn hints_in_sigma(
    stack: &Stack,
    gw: SocketAddr,
    id: &str,
    headers: &[(&str, &str)],
    body: &serde_json::Value,
) -> Hints {
    let (open, _) = open_stream_with(stack, gw, Some(id), headers, &body.to_string()).await;
    let r = stack
        .request(id)
        .await
        .unwrap_or_else(|| panic!("{id} in σ"));
    drop(open);
    wait_released(stack, id).await;
    (r.max_tokens, r.expected_output_tokens, r.request_class_id)
}

/// The hints reach decision: σ holds each request with the `max_tokens`, expected output
/// tokens and class the gateway read from its body and headers (a header over the body), and
/// a request without any holds none.
pub async fn hints_reach_decision(stack: &Stack, gw: SocketAddr, prefix: &str) {
    let class = |key: &str| Some(br_proto::valid::class_id(key));
    let long = serde_json::json!({
        "model": "br-emu", "prompt": "x", "max_tokens": 1_000_000, "stream": true,
    });
    let headers = [
        (EXPECTED_OUTPUT_HEADER, "300"),
        (CLASS_HEADER, "chat/tools"),
    ];
    let id = format!("{prefix}-hint-headers");
    assert_eq!(
        hints_in_sigma(stack, gw, &id, &headers, &long).await,
        (Some(1_000_000), Some(300), class("chat/tools")),
        "{id}: the body's max_tokens, the headers' expected output tokens and class"
    );

    // The chat API's max_completion_tokens over max_tokens; Dynamo's nvext.agent_hints.osl.
    let from_body = serde_json::json!({
        "model": "br-emu", "prompt": "x", "stream": true,
        "max_completion_tokens": 900_000, "max_tokens": 1_000_000,
        "nvext": {"agent_hints": {"osl": 200}},
    });
    let id = format!("{prefix}-hint-body");
    assert_eq!(
        hints_in_sigma(stack, gw, &id, &[], &from_body).await,
        (Some(900_000), Some(200), None),
        "{id}: max_completion_tokens and nvext.agent_hints.osl from the body"
    );
    let id = format!("{prefix}-hint-header-wins");
    assert_eq!(
        hints_in_sigma(
            stack,
            gw,
            &id,
            &[(EXPECTED_OUTPUT_HEADER, " 77 ")],
            &from_body
        )
        .await,
        (Some(900_000), Some(77), None),
        "{id}: the header's expected output tokens over the body's"
    );

    let id = format!("{prefix}-hint-none");
    assert_eq!(
        hints_in_sigma(stack, gw, &id, &[(CLASS_HEADER, "")], &long).await,
        (Some(1_000_000), None, None),
        "{id}: no expected output tokens, and an empty class is none"
    );
}

/// The JSON error body (`{"code","message"}`) of a whole answer, as the gateways send it; a
/// chunked body's size lines are skipped.
fn error_body(answer: &str) -> serde_json::Value {
    let json = answer
        .split("\r\n\r\n")
        .nth(1)
        .and_then(|b| b.lines().find(|l| l.starts_with('{')))
        .unwrap_or_else(|| panic!("a JSON body: {answer}"));
    serde_json::from_str(json).unwrap_or_else(|e| panic!("JSON: {e}: {answer}"))
}

/// Reads the rest of an answer to the end of the connection (every request here asks for
/// `Connection: close`): the gateway must close it once the answer is out.
async fn whole(answer: OpenStream) -> String {
    use tokio::io::AsyncReadExt as _;
    let mut stream = answer.stream;
    let mut received = answer.received.into_bytes();
    let read = tokio::time::timeout(LONG, stream.read_to_end(&mut received)).await;
    let text = String::from_utf8_lossy(&received).into_owned();
    match read {
        Ok(r) => {
            r.unwrap_or_else(|e| panic!("reading: {e}: {text}"));
        }
        Err(_) => panic!(
            "the gateway did not close the connection within {LONG:?} of the answer's start, \
             the client having asked it to: {text}"
        ),
    }
    text
}

/// Whole answers to a client that asked to close (`Connection: close`), read to the end of the
/// connection: the gateway closes it once the answer is out, both for an answer of known length
/// (`Content-Length`, the whole body before the end) and for a streamed one (chunked, the last
/// chunk before the end).
pub async fn closes_after_whole_answers(stack: &Stack, gw: SocketAddr, prefix: &str) {
    let id = format!("{prefix}-closes-known-length");
    let body =
        serde_json::json!({"model": "br-emu", "prompt": "x", "max_tokens": 4, "stream": false});
    let answer = whole(send_raw(gw, Some(&id), &body.to_string(), "\r\n\r\n").await).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{id}: {answer}");
    let (head, rest) = answer.split_once("\r\n\r\n").expect("a response head");
    let length: usize = header(head, "content-length")
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{id}: an answer of known length: {answer}"));
    assert_eq!(
        rest.len(),
        length,
        "{id}: the whole body, then the end: {answer}"
    );
    wait_released(stack, &id).await;

    let id = format!("{prefix}-closes-streamed");
    let answer = whole(send_raw(gw, Some(&id), &completion(4), "\r\n\r\n").await).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{id}: {answer}");
    assert!(
        answer.ends_with("data: [DONE]\n\n\r\n0\r\n\r\n"),
        "{id}: the last chunk, then the end: {answer}"
    );
    wait_released(stack, &id).await;
}

/// Bodies with no hint in them are routed all the same: one that is not JSON reaches a rank
/// (the engine's own 400, with `X-BalanceRoute-Worker` and no `X-BalanceRoute-Error`), one
/// without `max_tokens` is answered whole by the rank.
pub async fn routed_without_body_hints(stack: &Stack, gw: SocketAddr, prefix: &str) {
    let id = format!("{prefix}-not-json");
    let answer = whole(send_raw(gw, Some(&id), "max_tokens=5", "\r\n\r\n").await).await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(
        header(&answer, "x-balanceroute-worker").is_some(),
        "{id}: a rank answered: {answer}"
    );
    assert_eq!(header(&answer, "x-balanceroute-error"), None, "{answer}");
    wait_released(stack, &id).await;

    let id = format!("{prefix}-no-max-tokens");
    let body = serde_json::json!({"model": "br-emu", "prompt": "x", "stream": true});
    let done = send_raw(
        gw,
        Some(&id),
        &body.to_string(),
        "data: [DONE]\n\n\r\n0\r\n\r\n",
    )
    .await;
    assert!(
        done.received.starts_with("HTTP/1.1 200"),
        "{}",
        done.received
    );
    assert!(done.worker().is_some(), "{}", done.received);
    wait_released(stack, &id).await;
}

/// Request headers beside the request id, as (name, value).
type Headers<'a> = &'a [(&'a str, &'a str)];

/// Hints decision cannot take: the client gets decision's own answer, 400 with
/// `X-BalanceRoute-Error: INVALID_ARGUMENT` and the `{"code", "message"}` body; the engine
/// runs nothing and σ holds nothing.
pub async fn bad_hints_refused(stack: &Stack, gw: SocketAddr, prefix: &str) {
    let long_class = "c".repeat(65);
    let out_of_range =
        serde_json::json!({"model": "br-emu", "prompt": "x", "max_tokens": 20_000_000}).to_string();
    let cases: [(&str, Headers, String); 6] = [
        (
            "not-a-count",
            &[(EXPECTED_OUTPUT_HEADER, "lots")],
            completion(4),
        ),
        ("zero", &[(EXPECTED_OUTPUT_HEADER, "0")], completion(4)),
        (
            "over-max-tokens",
            &[(EXPECTED_OUTPUT_HEADER, "5")],
            completion(4),
        ),
        (
            "class-too-long",
            &[(CLASS_HEADER, &long_class)],
            completion(4),
        ),
        (
            "class-with-space",
            &[(CLASS_HEADER, "chat tools")],
            completion(4),
        ),
        ("max-tokens-out-of-range", &[], out_of_range),
    ];
    let before = stack.engine.requests_per_rank().await;
    for (name, headers, body) in cases {
        let id = format!("{prefix}-bad-{name}");
        let answer = whole(send_with(gw, Some(&id), headers, &body, "\r\n\r\n").await).await;
        assert!(answer.starts_with("HTTP/1.1 400"), "{id}: {answer}");
        assert_eq!(
            header(&answer, "x-balanceroute-error").as_deref(),
            Some("INVALID_ARGUMENT"),
            "{id}: {answer}"
        );
        let v = error_body(&answer);
        assert_eq!(v["code"], "INVALID_ARGUMENT", "{id}: {answer}");
        assert!(stack.request(&id).await.is_none(), "{id}: nothing in σ");
    }
    assert_eq!(stack.engine.requests_per_rank().await, before);
}

//! `br-emu engine`: G data-parallel decode ranks in lockstep behind an OpenAI-compatible API.
//!
//! - [`core`]: the lockstep model (slots, FIFO local queues, one token per running request per
//!   step, step time `a·max_g L_g + c·max_g n_g + b`, and with colocated prefill chunked
//!   prompts and `+ p·max_g P_g`), pure and clock-free;
//! - [`driver`]: the task that owns it and sleeps each step's time, scaled by `--time-scale`;
//! - [`http`]: the API (one port per rank, one port honouring `X-data-parallel-rank`).

pub mod core;
pub mod driver;
pub mod http;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use self::core::{Colocated, StepModel};
pub use driver::EngineHandle;
pub use http::{ApiConfig, EngineAddrs, Stats};

/// Everything `br-emu engine` needs.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// G: ranks.
    pub ranks: usize,
    /// B: slots per rank (max_num_seqs).
    pub slots: usize,
    /// The step time, `a·max L + p·max P + c·max n + b` (p only with `colocated`).
    pub model: StepModel,
    /// The ranks also prefill, this many prompt tokens per rank per step (`None`: a decode
    /// tier, prompts arrive as KV).
    pub colocated: Option<Colocated>,
    /// Wall time = model time × this (0 = as fast as possible).
    pub time_scale: f64,
    pub model_name: String,
    pub created: Option<u64>,
    pub default_max_tokens: u32,
    pub host: IpAddr,
    /// Rank g listens on base_port + g; 0 lets the OS pick every port.
    pub base_port: u16,
    /// The `X-data-parallel-rank` port; defaults to base_port + G (or an OS-picked port).
    pub dp_port: Option<u16>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            ranks: 8,
            slots: 16,
            model: StepModel {
                a_ms_per_token: 2e-4,
                b_ms: 30.0,
                c_ms_per_request: 0.0,
                p_ms_per_prefill_token: 0.0,
            },
            colocated: None,
            time_scale: 0.1,
            model_name: "br-emu".into(),
            created: None,
            default_max_tokens: 16,
            host: IpAddr::from([127, 0, 0, 1]),
            base_port: 0,
            dp_port: None,
        }
    }
}

/// A running engine.
#[derive(Debug)]
pub struct EngineServer {
    pub addrs: EngineAddrs,
    pub handle: EngineHandle,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    shutdown: CancellationToken,
}

impl EngineServer {
    /// Binds every port and starts the engine task. Serves until `shutdown` is cancelled.
    pub async fn start(cfg: EngineConfig, shutdown: CancellationToken) -> std::io::Result<Self> {
        let api = Arc::new(ApiConfig {
            model: cfg.model_name.clone(),
            created: cfg.created,
            default_max_tokens: cfg.default_max_tokens,
            ranks: cfg.ranks,
            slots: cfg.slots,
            a_ms_per_token: cfg.model.a_ms_per_token,
            b_ms: cfg.model.b_ms,
            c_ms_per_request: cfg.model.c_ms_per_request,
            p_ms_per_prefill_token: cfg.model.p_ms_per_prefill_token,
            prefill_chunk: cfg.colocated.map(|co| co.chunk),
            time_scale: cfg.time_scale,
        });
        let port = |g: usize| -> std::io::Result<u16> {
            if cfg.base_port == 0 {
                return Ok(0);
            }
            u16::try_from(usize::from(cfg.base_port) + g)
                .map_err(|_| std::io::Error::other("--base-port + G exceeds 65535"))
        };
        let mut listeners = Vec::with_capacity(cfg.ranks + 1);
        for g in 0..cfg.ranks {
            listeners.push(TcpListener::bind(SocketAddr::new(cfg.host, port(g)?)).await?);
        }
        let dp_port = match cfg.dp_port {
            Some(p) => p,
            None => port(cfg.ranks)?,
        };
        let dp_listener = TcpListener::bind(SocketAddr::new(cfg.host, dp_port)).await?;

        let (handle, engine_task) = driver::spawn(
            cfg.ranks,
            cfg.slots,
            cfg.model,
            cfg.colocated,
            cfg.time_scale,
            shutdown.clone(),
        );
        let mut tasks = vec![engine_task];
        let ids = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let rr = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let per_rank: Arc<Vec<_>> = Arc::new(
            (0..cfg.ranks)
                .map(|_| std::sync::atomic::AtomicU64::new(0))
                .collect(),
        );
        let mut rank_addrs = Vec::with_capacity(cfg.ranks);
        let all = listeners
            .into_iter()
            .enumerate()
            .map(|(g, l)| (Some(g), l))
            .chain(std::iter::once((None, dp_listener)));
        let mut dp_addr = None;
        for (rank, listener) in all {
            let addr = listener.local_addr()?;
            match rank {
                Some(_) => rank_addrs.push(addr),
                None => dp_addr = Some(addr),
            }
            let app = http::router_shared(
                handle.clone(),
                api.clone(),
                rank,
                rr.clone(),
                ids.clone(),
                per_rank.clone(),
            );
            let stop = shutdown.clone();
            tasks.push(tokio::spawn(async move {
                if let Err(e) = axum::serve(listener, app)
                    .with_graceful_shutdown(stop.cancelled_owned())
                    .await
                {
                    tracing::error!(error = %e, "engine HTTP server failed");
                }
            }));
        }
        let dp = dp_addr.ok_or_else(|| std::io::Error::other("no DP listener"))?;
        Ok(EngineServer {
            addrs: EngineAddrs {
                ranks: rank_addrs,
                dp,
            },
            handle,
            tasks,
            shutdown,
        })
    }

    /// Stops serving and waits for every task.
    pub async fn shutdown(self) {
        self.shutdown.cancel();
        for t in self.tasks {
            let _ = t.await;
        }
    }

    /// Waits until the servers stop (after `shutdown` is cancelled elsewhere).
    pub async fn wait(self) {
        for t in self.tasks {
            let _ = t.await;
        }
    }
}

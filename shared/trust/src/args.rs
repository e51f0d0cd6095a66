//! The TLS flags every binary takes (`#[command(flatten)] tls: TlsArgs`; like every flag they
//! are also `BALANCEROUTE_*` variables and `--config` TOML keys), and the safe default they
//! guard: without TLS a process serves only on loopback addresses.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::identity::DEFAULT_TRUST_DOMAIN;
use crate::tls::{TlsError, TlsFiles, TlsMaterial};

/// `--tls-cert`, `--tls-key`, `--tls-ca`, `--trust-domain`, `--allow-insecure-remote`.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct TlsArgs {
    /// PEM certificate (and intermediates) this process presents, as a server and as a client.
    /// Reloaded when the file changes. With --tls-key and --tls-ca, every gRPC and admin
    /// endpoint requires mutual TLS.
    #[arg(long, env = "BALANCEROUTE_TLS_CERT", requires_all = ["tls_key", "tls_ca"])]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "BALANCEROUTE_TLS_KEY", requires_all = ["tls_cert", "tls_ca"])]
    pub tls_key: Option<PathBuf>,
    /// PEM CA bundle: servers require client certificates signed by it; clients verify servers
    /// with it.
    #[arg(long, env = "BALANCEROUTE_TLS_CA", requires_all = ["tls_cert", "tls_key"])]
    pub tls_ca: Option<PathBuf>,
    /// The SPIFFE trust domain of every identity (`spiffe://<trust-domain>/br/<role>`).
    #[arg(long, env = "BALANCEROUTE_TRUST_DOMAIN", default_value = DEFAULT_TRUST_DOMAIN)]
    pub trust_domain: String,
    /// Serve plaintext on a non-loopback address (refused by default; logged at every start).
    #[arg(long, env = "BALANCEROUTE_ALLOW_INSECURE_REMOTE")]
    pub allow_insecure_remote: bool,
    /// How often certificate files are checked for rotation.
    #[arg(long, env = "BALANCEROUTE_TLS_RELOAD_INTERVAL", default_value = "5s", value_parser = humantime::parse_duration)]
    pub tls_reload_interval: Duration,
}

impl Default for TlsArgs {
    fn default() -> Self {
        TlsArgs {
            tls_cert: None,
            tls_key: None,
            tls_ca: None,
            trust_domain: DEFAULT_TRUST_DOMAIN.to_owned(),
            allow_insecure_remote: false,
            tls_reload_interval: Duration::from_secs(5),
        }
    }
}

/// A bind that the flags do not allow.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{addr} is not a loopback address and TLS is off: give --tls-cert, --tls-key and --tls-ca \
     (or --allow-insecure-remote to serve plaintext to the network)"
)]
pub struct InsecureBind {
    pub addr: SocketAddr,
}

impl TlsArgs {
    /// The files, when all three are given (clap's `requires_all` guarantees all or none).
    pub fn files(&self) -> Option<TlsFiles> {
        match (&self.tls_cert, &self.tls_key, &self.tls_ca) {
            (Some(cert), Some(key), Some(ca)) => Some(TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                ca: ca.clone(),
            }),
            _ => None,
        }
    }

    pub fn enabled(&self) -> bool {
        self.files().is_some()
    }

    /// Loads the material (if TLS is on). The caller starts `watch` with its shutdown token.
    pub fn load(&self) -> Result<Option<Arc<TlsMaterial>>, TlsError> {
        self.files()
            .map(|files| TlsMaterial::load(files, &self.trust_domain))
            .transpose()
    }

    /// Refuses a plaintext bind beyond loopback unless `--allow-insecure-remote`; warns when
    /// that flag lets one through.
    pub fn check_bind(&self, addr: SocketAddr) -> Result<(), InsecureBind> {
        if self.enabled() || addr.ip().is_loopback() {
            return Ok(());
        }
        if self.allow_insecure_remote {
            tracing::warn!(%addr, "serving PLAINTEXT on a non-loopback address (--allow-insecure-remote): anyone who can reach it can call every method");
            return Ok(());
        }
        Err(InsecureBind { addr })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        tls: TlsArgs,
    }

    #[test]
    fn plaintext_binds_only_loopback_unless_allowed() {
        let off = TlsArgs::default();
        assert!(off.check_bind("127.0.0.1:1".parse().unwrap()).is_ok());
        assert!(off.check_bind("[::1]:1".parse().unwrap()).is_ok());
        let remote: SocketAddr = "0.0.0.0:1".parse().unwrap();
        assert_eq!(off.check_bind(remote), Err(InsecureBind { addr: remote }));
        let allowed = TlsArgs {
            allow_insecure_remote: true,
            ..TlsArgs::default()
        };
        assert!(allowed.check_bind(remote).is_ok());
        let tls = TlsArgs {
            tls_cert: Some("c".into()),
            tls_key: Some("k".into()),
            tls_ca: Some("a".into()),
            ..TlsArgs::default()
        };
        assert!(tls.check_bind(remote).is_ok());
    }

    #[test]
    fn the_three_files_come_together() {
        assert!(Cli::try_parse_from(["x", "--tls-cert", "c"]).is_err());
        assert!(Cli::try_parse_from(["x", "--tls-cert", "c", "--tls-key", "k"]).is_err());
        let all = ["x", "--tls-cert", "c", "--tls-key", "k", "--tls-ca", "a"];
        assert!(Cli::try_parse_from(all).unwrap().tls.enabled());
        let none = Cli::try_parse_from(["x"]).unwrap();
        assert_eq!(none.tls, TlsArgs::default());
    }
}

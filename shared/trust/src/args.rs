//! The TLS flags every binary takes (`#[command(flatten)] tls: TlsArgs`; like every flag they
//! are also `BALANCEROUTE_*` variables and `--config` TOML keys), and the safe default they
//! guard: without TLS a process serves only on loopback addresses; and `--spiffe-role-map`,
//! which gives Kubernetes service-account ids (csi-driver-spiffe's) their roles.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::identity::{DEFAULT_TRUST_DOMAIN, IdentityReader};
use crate::rolemap::{RoleMap, RoleMapEntry, RoleMapError};
use crate::tls::{TlsError, TlsFiles, TlsMaterial};

/// `--tls-cert`, `--tls-key`, `--tls-ca`, `--trust-domain`, `--spiffe-role-map`,
/// `--allow-insecure-remote`, `--tls-reload-interval`.
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
    /// Roles for Kubernetes service-account ids (`spiffe://<trust-domain>/ns/<namespace>/sa/<name>`,
    /// what cert-manager's csi-driver-spiffe issues): `<namespace>/<service account>=<role>`,
    /// repeated or comma-separated (a TOML list). Role: ingest, decision, snapshot, gateway,
    /// admin, `worker/<group>/<id>` (an account only that rank runs as),
    /// `worker/<group>/<first>-<last>` (an account only the pod whose shim serves those ranks
    /// runs as) or `worker/<group>/*` (an account the group's ranks share: the worker id is
    /// then NOT proven, see deploy/README.md; logged at WARN at every start). Unmapped
    /// accounts have no identity; `br/<role>` ids need no entry. Give every binary the same
    /// map: clients check servers' roles with it too.
    #[arg(
        long,
        env = "BALANCEROUTE_SPIFFE_ROLE_MAP",
        value_delimiter = ',',
        value_name = "NS/SA=ROLE"
    )]
    pub spiffe_role_map: Vec<RoleMapEntry>,
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
            spiffe_role_map: Vec::new(),
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

    /// How this process reads identities: the trust domain and the role map (a service
    /// account named twice is an error).
    pub fn reader(&self) -> Result<IdentityReader, RoleMapError> {
        let map = RoleMap::new(self.spiffe_role_map.iter().cloned())?;
        Ok(IdentityReader::new(&self.trust_domain).with_role_map(map))
    }

    /// Loads the material (if TLS is on), and warns about every role-map entry whose worker
    /// id is unproven. The caller starts `watch` with its shutdown token.
    pub fn load(&self) -> Result<Option<Arc<TlsMaterial>>, TlsError> {
        let reader = self.reader()?;
        let Some(files) = self.files() else {
            if !reader.role_map().is_empty() {
                tracing::warn!(
                    "--spiffe-role-map is given but TLS is off: no peer is identified, the map is unused"
                );
            }
            return Ok(None);
        };
        for entry in reader.role_map().unproven_workers() {
            tracing::warn!(
                %entry,
                "--spiffe-role-map: pods running as {}/{} may report as ANY worker of their group: the worker id is not proven by the certificate (see deploy/README.md)",
                entry.namespace,
                entry.service_account
            );
        }
        TlsMaterial::load(files, reader).map(Some)
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

    #[test]
    fn the_role_map_is_repeated_or_comma_separated_and_checked_whole() {
        let cli = Cli::try_parse_from([
            "x",
            "--spiffe-role-map",
            "br/ingest=ingest,br/gw=gateway",
            "--spiffe-role-map=br-g0/decode=worker/g0/*",
        ])
        .unwrap();
        let entries: Vec<String> = cli
            .tls
            .spiffe_role_map
            .iter()
            .map(|e| e.to_string())
            .collect();
        assert_eq!(
            entries,
            [
                "br/ingest=ingest",
                "br/gw=gateway",
                "br-g0/decode=worker/g0/*"
            ]
        );
        let reader = cli.tls.reader().unwrap();
        assert_eq!(reader.role_map().unproven_workers().count(), 1);
        // a bad entry is a flag error (exit 2), naming what is wrong
        let e = Cli::try_parse_from(["x", "--spiffe-role-map", "br/decode=worker"]).unwrap_err();
        assert!(e.to_string().contains("worker/<group>/*"), "{e}");
        // one account, two roles: refused when the map is read (before anything is served)
        let twice =
            Cli::try_parse_from(["x", "--spiffe-role-map", "br/a=ingest,br/a=admin"]).unwrap();
        assert!(twice.tls.reader().is_err());
        assert!(matches!(twice.tls.load(), Err(TlsError::RoleMap(_))));
    }
}

//! `br-certs OUT_DIR GROUP WORKERS`: a development CA and certificates for every role, for
//! workers 0..WORKERS of GROUP, and for shims serving several of its ranks (`--worker-range`)
//! (what `scripts/dev-certs.sh` runs).

use std::path::PathBuf;

use anyhow::Context as _;
use br_trust::{Role, WorkerIds};
use clap::Parser;

/// Writes ca.pem, <role>.pem/<role>-key.pem for ingest, snapshot, decision, gateway, admin and
/// all, and worker-<group>-<id>.pem/-key.pem for each worker. Existing files are replaced (each
/// atomically), so running it again rotates every certificate under running processes.
///
/// Example: br-certs target/certs g0 8
///
/// A shim serving several ranks (br-shim --worker-ids 0-3) needs one certificate naming all of
/// them: br-certs target/certs g0 8 --worker-range 0-3 --worker-range 4-7
#[derive(Debug, Parser)]
#[command(name = "br-certs", version)]
struct Args {
    /// Directory to write into (created if missing).
    out_dir: PathBuf,
    /// The workers' group.
    group: String,
    /// How many workers (ids 0..WORKERS).
    workers: u32,
    /// SPIFFE trust domain.
    #[arg(long, default_value = br_trust::DEFAULT_TRUST_DOMAIN)]
    trust_domain: String,
    /// Reuse the CA in OUT_DIR (ca.pem + ca-key.pem) instead of making a new one, so only the
    /// leaf certificates rotate.
    #[arg(long)]
    keep_ca: bool,
    /// Also a certificate for a Kubernetes service account, NAMESPACE/NAME, with the id
    /// csi-driver-spiffe gives it (`spiffe://<td>/ns/<namespace>/sa/<name>`), written as
    /// sa-<namespace>-<name>.pem/-key.pem; the services give it a role with
    /// --spiffe-role-map. Repeatable.
    #[arg(long, value_name = "NAMESPACE/NAME")]
    service_account: Vec<String>,
    /// Also a certificate for a shim serving the ranks FIRST..=LAST of GROUP (`br-shim
    /// --worker-ids FIRST-LAST`), with the one id `spiffe://<td>/br/worker/<group>/FIRST-LAST`:
    /// ingest admits its Hello for each of those ranks and refuses any other. Written as
    /// worker-<group>-FIRST-LAST.pem/-key.pem. Repeatable.
    #[arg(long, value_name = "FIRST-LAST")]
    worker_range: Vec<String>,
}

/// Reads a `--worker-range`: a range of at least two ranks (one rank has its own certificate
/// already).
fn worker_range(spec: &str) -> anyhow::Result<WorkerIds> {
    let ids: WorkerIds = spec
        .parse()
        .map_err(|e| anyhow::anyhow!("--worker-range {spec:?}: {e}"))?;
    if ids.is_one() {
        anyhow::bail!(
            "--worker-range {spec:?} names one rank: its certificate is worker-<group>-{spec}.pem, written for every rank below WORKERS"
        );
    }
    Ok(ids)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // every argument is checked before anything is written
    br_proto::valid::GroupId::new(&args.group).context("GROUP")?;
    let ranges = args
        .worker_range
        .iter()
        .map(|s| worker_range(s))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let dir = &args.out_dir;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let ca = if args.keep_ca {
        let cert = std::fs::read_to_string(dir.join("ca.pem")).context("reading ca.pem")?;
        let key = std::fs::read_to_string(dir.join("ca-key.pem")).context("reading ca-key.pem")?;
        br_certs::Ca::from_pem(&cert, &key)?
    } else {
        let ca = br_certs::Ca::new("BalanceRoute development CA")?;
        br_certs::write_file(&dir.join("ca.pem"), ca.cert_pem().as_bytes(), 0o644)?;
        br_certs::write_file(&dir.join("ca-key.pem"), ca.key_pem().as_bytes(), 0o600)?;
        ca
    };
    for role in [
        Role::Ingest,
        Role::Snapshot,
        Role::Decision,
        Role::Gateway,
        Role::Admin,
        Role::All,
    ] {
        let issued = ca.issue_role(&args.trust_domain, role)?;
        br_certs::write(dir, &br_certs::role_files(role), &issued)?;
    }
    for id in 0..args.workers {
        let issued = ca.issue_worker(&args.trust_domain, &args.group, id)?;
        br_certs::write(dir, &br_certs::worker_files(&args.group, id), &issued)?;
    }
    for &ids in &ranges {
        let issued = ca.issue_workers(&args.trust_domain, &args.group, ids)?;
        br_certs::write(dir, &br_certs::workers_files(&args.group, ids), &issued)?;
    }
    for account in &args.service_account {
        // the same check the services apply to their map's entries
        let entry: br_trust::RoleMapEntry = format!("{account}=admin")
            .parse()
            .map_err(|e| anyhow::anyhow!("--service-account {account:?}: {e}"))?;
        let (ns, sa) = (&entry.namespace, &entry.service_account);
        let issued = ca.issue_service_account(&args.trust_domain, ns, sa)?;
        br_certs::write(dir, &br_certs::service_account_files(ns, sa), &issued)?;
    }
    println!(
        "wrote a CA, 6 role certificates, {} worker certificates, {} multi-rank worker certificates and {} service-account certificates to {}",
        args.workers,
        ranges.len(),
        args.service_account.len(),
        dir.display()
    );
    Ok(())
}

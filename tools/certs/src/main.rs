//! `br-certs OUT_DIR GROUP WORKERS`: a development CA and certificates for every role and for
//! workers 0..WORKERS of GROUP (what `scripts/dev-certs.sh` runs).

use std::path::PathBuf;

use anyhow::Context as _;
use br_trust::Role;
use clap::Parser;

/// Writes ca.pem, <role>.pem/<role>-key.pem for ingest, snapshot, decision, gateway and admin,
/// and worker-<group>-<id>.pem/-key.pem for each worker. Existing files are replaced (each
/// atomically), so running it again rotates every certificate under running processes.
///
/// Example: br-certs target/certs g0 8
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
    #[arg(long, default_value = br_trust::identity::DEFAULT_TRUST_DOMAIN)]
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
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
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
    br_proto::valid::GroupId::new(&args.group).context("GROUP")?;
    for id in 0..args.workers {
        let issued = ca.issue_worker(&args.trust_domain, &args.group, id)?;
        br_certs::write(dir, &br_certs::worker_files(&args.group, id), &issued)?;
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
        "wrote a CA, 5 role certificates, {} worker certificates and {} service-account certificates to {}",
        args.workers,
        args.service_account.len(),
        dir.display()
    );
    Ok(())
}

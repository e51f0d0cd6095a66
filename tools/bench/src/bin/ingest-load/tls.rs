//! The certificates of a TLS run: each stream's worker identity, the fake snapshot service's,
//! the started ingest's and the admin scrape's, from a `scripts/dev-certs.sh` directory.
//!
//! Separate from the run: which file is whose reads on its own.

use super::*;

/// The certificates of a TLS run.
pub(super) struct Tls {
    pub(super) dir: PathBuf,
    pub(super) ca: PathBuf,
    pub(super) trust_domain: String,
    /// What the fake snapshot service presents.
    pub(super) snapshot: Arc<br_trust::TlsMaterial>,
    /// What the counter scrape of ingest's admin port presents.
    pub(super) admin: Arc<br_trust::TlsMaterial>,
}

impl Tls {
    pub(super) fn load(args: &Args) -> anyhow::Result<Option<Tls>> {
        let Some(dir) = args.tls_worker_dir.clone() else {
            anyhow::ensure!(
                !args.tls.enabled(),
                "--tls-cert/--tls-key/--tls-ca need --tls-worker-dir (the workers' certificates)"
            );
            return Ok(None);
        };
        let (cert, key, ca) = match args.tls.files() {
            Some(f) => (f.cert, f.key, f.ca),
            None => (
                dir.join("snapshot.pem"),
                dir.join("snapshot-key.pem"),
                dir.join("ca.pem"),
            ),
        };
        let trust_domain = args.tls.trust_domain.clone();
        let snapshot = Self::material(cert, key, &ca, &trust_domain)?;
        let admin = Self::material(
            dir.join("admin.pem"),
            dir.join("admin-key.pem"),
            &ca,
            &trust_domain,
        )?;
        Ok(Some(Tls {
            dir,
            ca,
            trust_domain,
            snapshot,
            admin,
        }))
    }

    fn material(
        cert: PathBuf,
        key: PathBuf,
        ca: &std::path::Path,
        trust_domain: &str,
    ) -> anyhow::Result<Arc<br_trust::TlsMaterial>> {
        let what = format!("loading {} / {}", cert.display(), key.display());
        br_trust::TlsMaterial::load(
            br_trust::TlsFiles {
                cert,
                key,
                ca: ca.to_owned(),
            },
            trust_domain,
        )
        .context(what)
    }

    /// Stream `worker`'s certificate.
    pub(super) fn worker(
        &self,
        group: &str,
        worker: u32,
    ) -> anyhow::Result<Arc<br_trust::TlsMaterial>> {
        Self::material(
            self.dir.join(format!("worker-{group}-{worker}.pem")),
            self.dir.join(format!("worker-{group}-{worker}-key.pem")),
            &self.ca,
            &self.trust_domain,
        )
    }
}

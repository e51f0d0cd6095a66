//! Development certificates for BalanceRoute: one CA, one certificate per role, one per
//! worker and one per shim serving several ranks, each carrying its SPIFFE id as a URI SAN (what SPIRE or cert-manager's
//! csi-driver-spiffe would issue in production). Also used by tests to make certificates from
//! other CAs, expired ones, and rotations.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::Path;
use std::time::Duration;

use br_trust::{Identity, Role, WorkerIds};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

pub use rcgen::Error;

/// A certificate authority that issues identities.
pub struct Ca {
    pem: String,
    key_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ca").finish_non_exhaustive()
    }
}

/// A certificate and its key, PEM.
#[derive(Debug, Clone)]
pub struct Issued {
    pub cert_pem: String,
    pub key_pem: String,
}

/// When an issued certificate is valid.
#[derive(Debug, Clone, Copy)]
pub enum Validity {
    /// From an hour ago for this long.
    For(Duration),
    /// Expired an hour ago (it was valid for the day before).
    Expired,
}

impl Ca {
    /// A new self-signed CA named `name`.
    pub fn new(name: &str) -> Result<Ca, Error> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::days(1);
        params.not_after = now + time::Duration::days(3650);
        let key = KeyPair::generate()?;
        let cert = params.self_signed(&key)?;
        Ok(Ca {
            pem: cert.pem(),
            key_pem: key.serialize_pem(),
            issuer: Issuer::new(params, key),
        })
    }

    /// An existing CA (its certificate and key, PEM), to issue more certificates under it.
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Ca, Error> {
        let key = KeyPair::from_pem(key_pem)?;
        Ok(Ca {
            pem: cert_pem.to_owned(),
            key_pem: key_pem.to_owned(),
            issuer: Issuer::from_ca_cert_pem(cert_pem, key)?,
        })
    }

    pub fn cert_pem(&self) -> &str {
        &self.pem
    }

    pub fn key_pem(&self) -> &str {
        &self.key_pem
    }

    /// A certificate for `spiffe_id` (usable as server and client), with `localhost`,
    /// 127.0.0.1 and ::1 as DNS/IP SANs too so non-SPIFFE clients can verify it on loopback.
    pub fn issue(&self, spiffe_id: &str, validity: Validity) -> Result<Issued, Error> {
        let mut params = CertificateParams::new(vec!["localhost".to_owned()])?;
        params
            .distinguished_name
            .push(DnType::CommonName, spiffe_id);
        params
            .subject_alt_names
            .push(SanType::URI(spiffe_id.try_into()?));
        params
            .subject_alt_names
            .push(SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)));
        params
            .subject_alt_names
            .push(SanType::IpAddress(IpAddr::V6(Ipv6Addr::LOCALHOST)));
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let now = time::OffsetDateTime::now_utc();
        let (from, to) = match validity {
            Validity::For(d) => (
                now - time::Duration::hours(1),
                now + time::Duration::try_from(d).unwrap_or(time::Duration::days(365)),
            ),
            Validity::Expired => (
                now - time::Duration::days(2),
                now - time::Duration::hours(1),
            ),
        };
        params.not_before = from;
        params.not_after = to;
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }

    /// A role's certificate in `trust_domain`.
    pub fn issue_role(&self, trust_domain: &str, role: Role) -> Result<Issued, Error> {
        let id = Identity::uri_for_role(trust_domain, role);
        self.issue(&id, Validity::For(DEFAULT_VALIDITY))
    }

    /// A Kubernetes service account's certificate in `trust_domain`, as cert-manager's
    /// csi-driver-spiffe issues it: the only URI SAN is
    /// `spiffe://<trust-domain>/ns/<namespace>/sa/<service account>` (its role comes from
    /// `--spiffe-role-map`).
    pub fn issue_service_account(
        &self,
        trust_domain: &str,
        namespace: &str,
        service_account: &str,
    ) -> Result<Issued, Error> {
        let uri = br_trust::service_account_id(trust_domain, namespace, service_account);
        self.issue(&uri, Validity::For(DEFAULT_VALIDITY))
    }

    /// A worker's certificate in `trust_domain`.
    pub fn issue_worker(&self, trust_domain: &str, group: &str, id: u32) -> Result<Issued, Error> {
        let uri = Identity::uri_for_worker(trust_domain, group, id);
        self.issue(&uri, Validity::For(DEFAULT_VALIDITY))
    }

    /// The certificate of a shim serving the ranks `workers` of `group` (`br-shim --worker-ids
    /// <first>-<last>`): one SPIFFE id, `.../br/worker/<group>/<first>-<last>`, with which
    /// ingest admits a Hello for each of those ranks and for no other.
    pub fn issue_workers(
        &self,
        trust_domain: &str,
        group: &str,
        workers: WorkerIds,
    ) -> Result<Issued, Error> {
        let uri = Identity::uri_for_workers(trust_domain, group, workers);
        self.issue(&uri, Validity::For(DEFAULT_VALIDITY))
    }
}

/// How long development certificates are valid.
pub const DEFAULT_VALIDITY: Duration = Duration::from_secs(365 * 24 * 3600);

/// The file names `scripts/dev-certs.sh` writes for a role: `<role>.pem`, `<role>-key.pem`.
pub fn role_files(role: Role) -> (String, String) {
    (format!("{role}.pem"), format!("{role}-key.pem"))
}

/// The file names for a worker: `worker-<group>-<id>.pem`, `worker-<group>-<id>-key.pem`.
pub fn worker_files(group: &str, id: u32) -> (String, String) {
    (
        format!("worker-{group}-{id}.pem"),
        format!("worker-{group}-{id}-key.pem"),
    )
}

/// The file names for a shim serving several ranks: `worker-<group>-<first>-<last>.pem` and
/// `…-key.pem` (for one rank, [`worker_files`]'s).
pub fn workers_files(group: &str, workers: WorkerIds) -> (String, String) {
    (
        format!("worker-{group}-{workers}.pem"),
        format!("worker-{group}-{workers}-key.pem"),
    )
}

/// The file names for a service account: `sa-<namespace>-<service account>.pem` and
/// `…-key.pem`.
pub fn service_account_files(namespace: &str, service_account: &str) -> (String, String) {
    (
        format!("sa-{namespace}-{service_account}.pem"),
        format!("sa-{namespace}-{service_account}-key.pem"),
    )
}

/// Writes `issued` into `dir` under `names`, the key readable by its owner only.
pub fn write(dir: &Path, names: &(String, String), issued: &Issued) -> std::io::Result<()> {
    write_file(&dir.join(&names.0), issued.cert_pem.as_bytes(), 0o644)?;
    write_file(&dir.join(&names.1), issued.key_pem.as_bytes(), 0o600)
}

/// Writes atomically (temp file + rename), so a process reloading it never reads half a file.
pub fn write_file(path: &Path, contents: &[u8], mode: u32) -> std::io::Result<()> {
    use std::io::Write as _;
    #[cfg(unix)]
    use std::os::unix::fs::OpenOptionsExt as _;
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp"));
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    #[cfg(unix)]
    opts.mode(mode);
    #[cfg(not(unix))]
    let _ = mode;
    let mut f = opts.open(&tmp)?;
    f.write_all(contents)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}

//! Who a peer is: the SPIFFE-shaped identity in its certificate's URI SAN.
//!
//! `spiffe://<trust-domain>/br/<role>` for the services, gateways and operators, and
//! `spiffe://<trust-domain>/br/worker/<group>/<worker_id>` for a decode worker's shim, so that
//! certificates issued by SPIRE or cert-manager work as they are. A shim that serves several
//! ranks of one engine server (`br-shim --worker-ids 0-7`) presents one certificate for all of
//! them: `.../br/worker/<group>/<first>-<last>`, a contiguous range (a SPIFFE path segment
//! allows digits and `-` but not `,`, and a SPIFFE certificate carries exactly one URI SAN, so
//! a range in one id is how one certificate names several ranks). Kubernetes service-account ids
//! (`spiffe://<trust-domain>/ns/<namespace>/sa/<name>`, what csi-driver-spiffe issues) get a
//! role only through `--spiffe-role-map` ([`IdentityReader`], [`crate::rolemap`]). A
//! certificate with no URI SAN of our trust domain, or with more than one, has no identity (a
//! certificate that could be read two ways is refused rather than guessed at).

use std::fmt;

use br_proto::valid::GroupId;

use crate::rolemap::{Grant, RoleMap};

/// The default trust domain (`--trust-domain`).
pub const DEFAULT_TRUST_DOMAIN: &str = "balanceroute.local";

// The role and the worker ids have their own modules, shared with the role map that grants
// them; here is where the crate's users find them.
pub use crate::role::Role;
pub use crate::worker_ids::{WorkerIds, WorkerIdsError};

/// A worker's place: the group and the worker ids its certificate lets it report for.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct WorkerSlot {
    pub group: String,
    /// `None`: any worker of the group. Only a service-account id mapped by a
    /// `worker/<group>/*` entry of `--spiffe-role-map` reads so (the id is unproven); a
    /// `br/worker/<group>/<ids>` certificate always names its workers.
    pub workers: Option<WorkerIds>,
}

impl WorkerSlot {
    /// Whether a Hello for `worker_id` of `group` is this slot's to say.
    pub fn admits(&self, group: &str, worker_id: u32) -> bool {
        self.group == group && self.workers.is_none_or(|ids| ids.contains(worker_id))
    }
}

impl fmt::Display for WorkerSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.workers {
            Some(ids) if ids.is_one() => write!(f, "group {:?} worker {ids}", self.group),
            Some(ids) => write!(f, "group {:?} workers {ids}", self.group),
            None => write!(f, "any worker of group {:?}", self.group),
        }
    }
}

/// An authenticated peer.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Identity {
    pub role: Role,
    /// Set exactly when `role` is [`Role::Worker`].
    pub worker: Option<WorkerSlot>,
    /// The URI SAN it was read from (for logs and denials).
    pub spiffe_id: String,
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.spiffe_id)
    }
}

/// Why a certificate gives no identity.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    #[error("the certificate cannot be parsed: {0}")]
    BadCertificate(String),
    #[error("the certificate has no spiffe://{0}/br/... URI SAN")]
    NoSpiffeId(String),
    #[error(
        "the certificate has {0} spiffe:// URI SANs of the trust domain; exactly one is allowed"
    )]
    Ambiguous(usize),
    #[error("{uri:?} is not a BalanceRoute identity: {why}")]
    Malformed { uri: String, why: String },
    /// A Kubernetes service-account id that `--spiffe-role-map` does not name.
    #[error(
        "{uri:?} is a Kubernetes service-account id with no role: --spiffe-role-map has no entry {namespace}/{service_account}"
    )]
    NotMapped {
        uri: String,
        namespace: String,
        service_account: String,
    },
}

impl Identity {
    /// The SPIFFE id for a role (not a worker).
    pub fn uri_for_role(trust_domain: &str, role: Role) -> String {
        format!("spiffe://{trust_domain}/br/{}", role.as_str())
    }

    /// The SPIFFE id for a worker.
    pub fn uri_for_worker(trust_domain: &str, group: &str, worker_id: u32) -> String {
        format!("spiffe://{trust_domain}/br/worker/{group}/{worker_id}")
    }

    /// The SPIFFE id for the shim of several workers (or of one: then the same as
    /// [`Identity::uri_for_worker`]).
    pub fn uri_for_workers(trust_domain: &str, group: &str, workers: WorkerIds) -> String {
        format!("spiffe://{trust_domain}/br/worker/{group}/{workers}")
    }

    /// Reads one URI; `Ok(None)` when it is not of `trust_domain` at all (another SAN the
    /// certificate may carry), an error when it is ours but malformed.
    pub fn from_uri(uri: &str, trust_domain: &str) -> Result<Option<Identity>, IdentityError> {
        let prefix = format!("spiffe://{trust_domain}/");
        let Some(path) = uri.strip_prefix(&prefix) else {
            return Ok(None);
        };
        let malformed = |why: &str| IdentityError::Malformed {
            uri: uri.to_owned(),
            why: why.to_owned(),
        };
        let parts: Vec<&str> = path.split('/').collect();
        let (role, worker) = match parts.as_slice() {
            ["br", "worker", group, ids] => {
                let group = GroupId::new(group).map_err(|e| malformed(&e.to_string()))?;
                let workers: WorkerIds = ids.parse().map_err(|e| malformed(&format!("{e}")))?;
                let slot = WorkerSlot {
                    group: group.as_str().to_owned(),
                    workers: Some(workers),
                };
                (Role::Worker, Some(slot))
            }
            ["br", "worker", ..] => {
                return Err(malformed(
                    "a worker is br/worker/<group>/<id> or br/worker/<group>/<first>-<last>",
                ));
            }
            ["br", role] => match Role::parse(role) {
                Some(r) => (r, None),
                None => return Err(malformed("unknown role")),
            },
            _ => return Err(malformed("the path is not br/<role>")),
        };
        Ok(Some(Identity {
            role,
            worker,
            spiffe_id: uri.to_owned(),
        }))
    }

    /// Reads a DER certificate's URI SANs (`br/...` ids only; [`IdentityReader`] reads
    /// mapped service-account ids too).
    pub fn from_cert_der(der: &[u8], trust_domain: &str) -> Result<Identity, IdentityError> {
        IdentityReader::new(trust_domain).read_cert_der(der)
    }
}

/// Reads identities of one trust domain: `br/...` ids as they are, and Kubernetes
/// service-account ids through a [`RoleMap`] (empty by default: none of them has a role).
/// Every server and client of a process reads peers with the same reader.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdentityReader {
    trust_domain: String,
    role_map: RoleMap,
}

impl From<&str> for IdentityReader {
    fn from(trust_domain: &str) -> Self {
        IdentityReader::new(trust_domain)
    }
}

impl From<&String> for IdentityReader {
    fn from(trust_domain: &String) -> Self {
        IdentityReader::new(trust_domain)
    }
}

impl IdentityReader {
    /// `br/...` ids of `trust_domain` only.
    pub fn new(trust_domain: &str) -> IdentityReader {
        IdentityReader {
            trust_domain: trust_domain.to_owned(),
            role_map: RoleMap::default(),
        }
    }

    /// Also gives mapped service-account ids their role.
    pub fn with_role_map(mut self, role_map: RoleMap) -> IdentityReader {
        self.role_map = role_map;
        self
    }

    pub fn trust_domain(&self) -> &str {
        &self.trust_domain
    }

    pub fn role_map(&self) -> &RoleMap {
        &self.role_map
    }

    /// Reads one URI; `Ok(None)` when it is not of our trust domain (another SAN the
    /// certificate may carry), an error when it is ours but gives no identity.
    pub fn read_uri(&self, uri: &str) -> Result<Option<Identity>, IdentityError> {
        let prefix = format!("spiffe://{}/", self.trust_domain);
        let Some(path) = uri.strip_prefix(&prefix) else {
            return Ok(None);
        };
        let parts: Vec<&str> = path.split('/').collect();
        let ["ns", namespace, "sa", service_account] = parts.as_slice() else {
            return Identity::from_uri(uri, &self.trust_domain);
        };
        let Some(grant) = self.role_map.get(namespace, service_account) else {
            return Err(IdentityError::NotMapped {
                uri: uri.to_owned(),
                namespace: (*namespace).to_owned(),
                service_account: (*service_account).to_owned(),
            });
        };
        let (role, worker) = match grant {
            Grant::Role(r) => (*r, None),
            Grant::Worker { group, workers } => (
                Role::Worker,
                Some(WorkerSlot {
                    group: group.clone(),
                    workers: *workers,
                }),
            ),
        };
        Ok(Some(Identity {
            role,
            worker,
            spiffe_id: uri.to_owned(),
        }))
    }

    /// Reads a DER certificate's URI SANs: exactly one must give an identity of ours.
    pub fn read_cert_der(&self, der: &[u8]) -> Result<Identity, IdentityError> {
        use x509_parser::prelude::*;
        let (_, cert) = X509Certificate::from_der(der)
            .map_err(|e| IdentityError::BadCertificate(e.to_string()))?;
        let mut found = Vec::new();
        let san = cert
            .subject_alternative_name()
            .map_err(|e| IdentityError::BadCertificate(e.to_string()))?;
        if let Some(san) = san {
            for name in &san.value.general_names {
                if let GeneralName::URI(uri) = name
                    && let Some(id) = self.read_uri(uri)?
                {
                    found.push(id);
                }
            }
        }
        match found.len() {
            0 => Err(IdentityError::NoSpiffeId(self.trust_domain.clone())),
            1 => Ok(found.remove(0)),
            n => Err(IdentityError::Ambiguous(n)),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const TD: &str = "balanceroute.local";

    #[test]
    fn roles_and_workers_round_trip() {
        for role in Role::ALL {
            if role == Role::Worker {
                continue;
            }
            let uri = Identity::uri_for_role(TD, role);
            let id = Identity::from_uri(&uri, TD).unwrap().unwrap();
            assert_eq!((id.role, id.worker), (role, None));
        }
        let uri = Identity::uri_for_worker(TD, "g0", 7);
        let id = Identity::from_uri(&uri, TD).unwrap().unwrap();
        assert_eq!(id.role, Role::Worker);
        let slot = WorkerSlot {
            group: "g0".into(),
            workers: Some(WorkerIds::one(7).unwrap()),
        };
        assert_eq!(id.worker, Some(slot));
    }

    #[test]
    fn a_worker_range_names_each_of_its_ranks_and_no_other() {
        let ids = WorkerIds::range(0, 1).unwrap();
        let uri = Identity::uri_for_workers(TD, "g0", ids);
        assert_eq!(uri, "spiffe://balanceroute.local/br/worker/g0/0-1");
        let id = Identity::from_uri(&uri, TD).unwrap().unwrap();
        assert_eq!(id.role, Role::Worker);
        let slot = id.worker.unwrap();
        assert!(slot.admits("g0", 0) && slot.admits("g0", 1));
        assert!(!slot.admits("g0", 2) && !slot.admits("g1", 0));
        assert_eq!(slot.to_string(), "group \"g0\" workers 0-1");
        // one worker reads the same whichever constructor wrote it
        let one = WorkerIds::one(5).unwrap();
        assert_eq!(
            Identity::uri_for_workers(TD, "g0", one),
            Identity::uri_for_worker(TD, "g0", 5)
        );
        assert_eq!("5".parse::<WorkerIds>().unwrap(), one);
        assert_eq!("3-1023".parse::<WorkerIds>().unwrap().to_string(), "3-1023");

        for (bad, why) in [
            ("1-1", "FIRST below LAST"),
            ("2-1", "FIRST below LAST"),
            ("0-1024", "above 1023"),
            ("0-99999999999", "above 1023"),
            ("0-", "not a worker id"),
            ("-1", "not a worker id"),
            ("0--1", "not a worker id"),
            ("0-1-2", "not a worker id"),
            ("0,1", "not a worker id"),
            ("+0-1", "not a worker id"),
            (" 0-1", "not a worker id"),
        ] {
            let e = bad.parse::<WorkerIds>().unwrap_err();
            assert!(e.to_string().contains(why), "{bad}: {e}");
            let uri = format!("spiffe://balanceroute.local/br/worker/g0/{bad}");
            let e = Identity::from_uri(&uri, TD).unwrap_err();
            assert!(matches!(e, IdentityError::Malformed { .. }), "{bad}: {e}");
        }
    }

    fn mapped() -> IdentityReader {
        let entries = [
            "br/br-ingest=ingest",
            "br/gw=gateway",
            "br-g0/decode=worker/g0/*",
            "br-g0/decode-3=worker/g0/3",
        ];
        let map = RoleMap::new(entries.map(|e| e.parse().unwrap())).unwrap();
        IdentityReader::new(TD).with_role_map(map)
    }

    #[test]
    fn service_account_ids_get_the_role_the_map_gives_them_and_no_other() {
        let r = mapped();
        let sa = |ns: &str, sa: &str| crate::rolemap::service_account_id(TD, ns, sa);
        let id = r.read_uri(&sa("br", "br-ingest")).unwrap().unwrap();
        assert_eq!((id.role, &id.worker), (Role::Ingest, &None));
        assert_eq!(id.spiffe_id, sa("br", "br-ingest"));
        let gw = r.read_uri(&sa("br", "gw")).unwrap().unwrap();
        assert_eq!(gw.role, Role::Gateway);

        let any = r.read_uri(&sa("br-g0", "decode")).unwrap().unwrap();
        assert_eq!(any.role, Role::Worker);
        let slot = any.worker.unwrap();
        assert_eq!(slot.workers, None);
        assert!(slot.admits("g0", 0) && slot.admits("g0", 7));
        assert!(!slot.admits("g1", 0), "the group is still proven");
        assert_eq!(slot.to_string(), "any worker of group \"g0\"");

        let exact = r.read_uri(&sa("br-g0", "decode-3")).unwrap().unwrap();
        let slot = exact.worker.unwrap();
        assert!(slot.admits("g0", 3));
        assert!(!slot.admits("g0", 2) && !slot.admits("g1", 3));

        // fail closed: an account the map does not name, the same name in another
        // namespace, another trust domain, and a longer path
        for unmapped in [sa("br", "other"), sa("elsewhere", "br-ingest")] {
            let e = r.read_uri(&unmapped).unwrap_err();
            assert!(
                matches!(e, IdentityError::NotMapped { .. }),
                "{unmapped}: {e}"
            );
            assert!(e.to_string().contains("--spiffe-role-map"), "{e}");
        }
        let other_td = "spiffe://evil.example/ns/br/sa/br-ingest";
        assert_eq!(r.read_uri(other_td).unwrap(), None);
        for bad in [
            "spiffe://balanceroute.local/ns/br/sa/br-ingest/x",
            "spiffe://balanceroute.local/ns/br/sa",
            "spiffe://balanceroute.local/ns/br/br-ingest",
        ] {
            assert!(r.read_uri(bad).is_err(), "{bad}");
        }
        // without a map, no service account has a role
        let plain = IdentityReader::new(TD);
        assert!(plain.read_uri(&sa("br", "br-ingest")).is_err());
    }

    #[test]
    fn br_ids_read_the_same_with_or_without_a_map() {
        let r = mapped();
        for role in Role::ALL {
            if role == Role::Worker {
                continue;
            }
            let uri = Identity::uri_for_role(TD, role);
            let plain = Identity::from_uri(&uri, TD).unwrap();
            assert_eq!(r.read_uri(&uri).unwrap(), plain);
        }
        let uri = Identity::uri_for_worker(TD, "g0", 5);
        assert_eq!(
            r.read_uri(&uri).unwrap(),
            Identity::from_uri(&uri, TD).unwrap()
        );
    }

    #[test]
    fn other_trust_domains_are_not_ours_and_malformed_ones_are_refused() {
        let other = "spiffe://evil.example/br/decision";
        assert_eq!(Identity::from_uri(other, TD).unwrap(), None);
        // a prefix trick: balanceroute.local.evil is another trust domain
        let trick = "spiffe://balanceroute.local.evil/br/decision";
        assert_eq!(Identity::from_uri(trick, TD).unwrap(), None);
        for bad in [
            "spiffe://balanceroute.local/br/root",
            "spiffe://balanceroute.local/br/worker/g0",
            "spiffe://balanceroute.local/br/worker/g0/-1",
            "spiffe://balanceroute.local/br/worker/g0/+1",
            "spiffe://balanceroute.local/br/worker/g0/1024",
            "spiffe://balanceroute.local/br/worker/g0/99999999999",
            "spiffe://balanceroute.local/br/worker//1",
            "spiffe://balanceroute.local/br/worker/g0/1/extra",
            "spiffe://balanceroute.local/br/decision/extra",
            "spiffe://balanceroute.local/decision",
            "spiffe://balanceroute.local/",
        ] {
            assert!(Identity::from_uri(bad, TD).is_err(), "{bad}");
        }
    }
}

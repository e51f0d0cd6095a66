//! Roles for SPIFFE ids that name a Kubernetes service account rather than a BalanceRoute role
//! (`--spiffe-role-map`).
//!
//! cert-manager's csi-driver-spiffe issues every pod
//! `spiffe://<trust-domain>/ns/<namespace>/sa/<service account>` (SPIRE's Kubernetes templates
//! often do the same): the certificate proves which service account the pod runs as, and
//! nothing else. The map says which role each service account
//! has, one entry per account, `<namespace>/<service account>=<grant>`:
//! * `ingest`, `decision`, `snapshot`, `gateway`, `admin`: that role;
//! * `worker/<group>/<id>`: exactly that decode worker. As strong as a `br/worker/...` id only
//!   when no other pod runs as that service account (one account per rank);
//! * `worker/<group>/<first>-<last>`: exactly those workers, for a pod whose shim serves
//!   several ranks of one engine server (`br-shim --worker-ids <first>-<last>`);
//! * `worker/<group>/*`: any worker of that group, the weaker opt-in for a StatefulSet whose
//!   ranks share one account. The certificate then proves the group but not the worker id: any
//!   pod holding that account can say Hello as any rank of the group (ingest still refuses a
//!   second live stream for a rank, and every other group). Logged at WARN at every start.
//!
//! A bare `worker` (every group) is refused when the map is read: no certificate should let a
//! pod report for workers of groups it is not part of. The map fails closed: a service-account
//! id with no entry has no identity, and `br/<role>` ids never consult it (they keep working
//! unchanged next to mapped ones).

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use br_proto::valid::GroupId;

use crate::role::Role;
use crate::worker_ids::WorkerIds;

/// The SPIFFE id csi-driver-spiffe gives a pod of `namespace` running as `service_account`.
pub fn service_account_id(trust_domain: &str, namespace: &str, service_account: &str) -> String {
    format!("spiffe://{trust_domain}/ns/{namespace}/sa/{service_account}")
}

/// What one service account may act as.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Grant {
    /// A role other than worker.
    Role(Role),
    /// Decode workers of `group`: the worker (or range of workers) `workers` names, or any
    /// worker of the group when `None` (the id is then unproven).
    Worker {
        group: String,
        workers: Option<WorkerIds>,
    },
}

impl fmt::Display for Grant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Grant::Role(r) => write!(f, "{r}"),
            Grant::Worker {
                group,
                workers: Some(ids),
            } => write!(f, "worker/{group}/{ids}"),
            Grant::Worker {
                group,
                workers: None,
            } => write!(f, "worker/{group}/*"),
        }
    }
}

/// One `<namespace>/<service account>=<grant>` of `--spiffe-role-map`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RoleMapEntry {
    pub namespace: String,
    pub service_account: String,
    pub grant: Grant,
}

impl fmt::Display for RoleMapEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{}={}",
            self.namespace, self.service_account, self.grant
        )
    }
}

/// A Kubernetes object name as it may appear in the id: lower-case letters, digits, `-` and
/// `.` (a namespace is a DNS label, a service account a DNS subdomain), at most 253 bytes.
fn k8s_name(what: &str, s: &str) -> Result<String, String> {
    let ok = !s.is_empty()
        && s.len() <= 253
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && !s.starts_with(['-', '.'])
        && !s.ends_with(['-', '.']);
    if ok {
        Ok(s.to_owned())
    } else {
        Err(format!(
            "{what} {s:?} is not a Kubernetes name (lower-case letters, digits, '-' and '.')"
        ))
    }
}

fn parse_grant(s: &str) -> Result<Grant, String> {
    let parts: Vec<&str> = s.split('/').collect();
    match parts.as_slice() {
        ["worker", group, id] if *group != "*" => {
            let group = GroupId::new(group)
                .map_err(|e| format!("worker group {group:?}: {e}"))?
                .as_str()
                .to_owned();
            let workers = if *id == "*" {
                None
            } else {
                let ids: WorkerIds = id
                    .parse()
                    .map_err(|e| format!("worker {id:?}: {e}, or * (any worker of the group)"))?;
                Some(ids)
            };
            Ok(Grant::Worker { group, workers })
        }
        ["worker", ..] => Err(
            "a worker is worker/<group>/<id> (one service account per rank), \
             worker/<group>/<first>-<last> (a pod whose shim serves those ranks) or \
             worker/<group>/* (a service account shared by the group's ranks: the worker id is \
             then unproven); a service account is never a worker of every group"
                .to_owned(),
        ),
        [role] => match Role::ALL.into_iter().find(|r| r.as_str() == *role) {
            Some(r) => Ok(Grant::Role(r)),
            None => Err(format!(
                "unknown role {role:?} (ingest, decision, snapshot, gateway, admin, all, worker/<group>/<id>, worker/<group>/<first>-<last>, worker/<group>/*)"
            )),
        },
        _ => Err(format!("{s:?} is not a role")),
    }
}

impl FromStr for RoleMapEntry {
    type Err = String;

    /// `<namespace>/<service account>=<grant>` (see the module docs).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        let (account, grant) = s
            .split_once('=')
            .ok_or_else(|| format!("{s:?} is not <namespace>/<service account>=<role>"))?;
        let (namespace, service_account) = account
            .trim()
            .split_once('/')
            .ok_or_else(|| format!("{account:?} is not <namespace>/<service account>"))?;
        Ok(RoleMapEntry {
            namespace: k8s_name("namespace", namespace)?,
            service_account: k8s_name("service account", service_account)?,
            grant: parse_grant(grant.trim())?,
        })
    }
}

/// Why a map cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RoleMapError {
    #[error(
        "{namespace}/{service_account} is given twice ({first} and {second}); a service account has one role"
    )]
    /// The grants are boxed: a worker grant's id range made the error, which every start-up
    /// path carries in its `Result`, larger than a small error should be.
    Duplicate {
        namespace: String,
        service_account: String,
        first: Box<Grant>,
        second: Box<Grant>,
    },
}

/// Service account -> grant, read from `--spiffe-role-map`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RoleMap {
    by_account: BTreeMap<(String, String), Grant>,
}

impl RoleMap {
    /// The map of `entries`; a service account named twice is an error (even with the same
    /// grant: a copy-paste slip in a list of roles should be seen, not merged).
    pub fn new(entries: impl IntoIterator<Item = RoleMapEntry>) -> Result<RoleMap, RoleMapError> {
        let mut by_account = BTreeMap::new();
        for e in entries {
            let key = (e.namespace, e.service_account);
            if let Some(first) = by_account.get(&key) {
                return Err(RoleMapError::Duplicate {
                    namespace: key.0,
                    service_account: key.1,
                    first: Box::new(Grant::clone(first)),
                    second: Box::new(e.grant),
                });
            }
            by_account.insert(key, e.grant);
        }
        Ok(RoleMap { by_account })
    }

    pub fn is_empty(&self) -> bool {
        self.by_account.is_empty()
    }

    /// The grant of a service account, if the map names it.
    pub fn get(&self, namespace: &str, service_account: &str) -> Option<&Grant> {
        self.by_account
            .get(&(namespace.to_owned(), service_account.to_owned()))
    }

    /// The entries whose worker id is unproven (`worker/<group>/*`): each is logged at WARN at
    /// every start.
    pub fn unproven_workers(&self) -> impl Iterator<Item = RoleMapEntry> + '_ {
        self.by_account.iter().filter_map(|((ns, sa), g)| match g {
            Grant::Worker { workers: None, .. } => Some(RoleMapEntry {
                namespace: ns.clone(),
                service_account: sa.clone(),
                grant: g.clone(),
            }),
            _ => None,
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn entry(s: &str) -> RoleMapEntry {
        s.parse().unwrap()
    }

    #[test]
    fn entries_parse_into_roles_and_workers() {
        let e = entry("balanceroute/br-ingest=ingest");
        assert_eq!(
            (e.namespace.as_str(), e.service_account.as_str(), &e.grant),
            ("balanceroute", "br-ingest", &Grant::Role(Role::Ingest))
        );
        for role in [
            Role::Ingest,
            Role::Decision,
            Role::Snapshot,
            Role::Gateway,
            Role::Admin,
        ] {
            let e = entry(&format!("ns/sa={role}"));
            assert_eq!(e.grant, Grant::Role(role));
            assert_eq!(e.to_string(), format!("ns/sa={role}"));
        }
        let exact = entry(" br-g8/decode-3 = worker/g8/3 ");
        let want = Grant::Worker {
            group: "g8".into(),
            workers: Some(WorkerIds::one(3).unwrap()),
        };
        assert_eq!(exact.grant, want);
        let range = entry("br-g8/decode-0=worker/g8/0-3");
        let want = Grant::Worker {
            group: "g8".into(),
            workers: Some(WorkerIds::range(0, 3).unwrap()),
        };
        assert_eq!(range.grant, want);
        assert_eq!(range.to_string(), "br-g8/decode-0=worker/g8/0-3");
        let any = entry("br-g8/decode=worker/g8/*");
        let want = Grant::Worker {
            group: "g8".into(),
            workers: None,
        };
        assert_eq!(any.grant, want);
        assert_eq!(any.to_string(), "br-g8/decode=worker/g8/*");
    }

    #[test]
    fn a_service_account_is_never_a_worker_of_every_group_and_bad_entries_are_refused() {
        for bad in [
            "ns/sa=worker",
            "ns/sa=worker/g8",
            "ns/sa=worker/*/*",
            "ns/sa=worker/g8/-1",
            "ns/sa=worker/g8/+1",
            "ns/sa=worker/g8/1024",
            "ns/sa=worker/g8/99999999999",
            "ns/sa=worker/g8/1/2",
            "ns/sa=worker/g8/3-3",
            "ns/sa=worker/g8/3-1",
            "ns/sa=worker/g8/0-1024",
            "ns/sa=worker/g8/0,1",
            "ns/sa=root",
            "ns/sa=",
            "ns/sa",
            "sa=ingest",
            "/sa=ingest",
            "ns/=ingest",
            "NS/sa=ingest",
            "ns/s a=ingest",
            "ns/-sa=ingest",
            "ns/sa/x=ingest",
        ] {
            assert!(bad.parse::<RoleMapEntry>().is_err(), "{bad}");
        }
        let e = "ns/sa=worker".parse::<RoleMapEntry>().unwrap_err();
        assert!(e.contains("worker/<group>/*"), "{e}");
    }

    #[test]
    fn a_service_account_has_one_role() {
        let dup = RoleMap::new([entry("ns/sa=ingest"), entry("ns/sa=admin")]);
        assert!(matches!(dup, Err(RoleMapError::Duplicate { .. })));
        let same = RoleMap::new([entry("ns/sa=ingest"), entry("ns/sa=ingest")]);
        assert!(same.is_err(), "a repeated entry is a slip to be seen");
        let map = RoleMap::new([
            entry("ns/a=ingest"),
            entry("other/a=gateway"),
            entry("ns/w=worker/g0/*"),
            entry("ns/w1=worker/g0/1"),
        ])
        .unwrap();
        assert_eq!(map.get("ns", "a"), Some(&Grant::Role(Role::Ingest)));
        assert_eq!(map.get("other", "a"), Some(&Grant::Role(Role::Gateway)));
        assert_eq!(map.get("ns", "b"), None);
        let unproven: Vec<String> = map.unproven_workers().map(|e| e.to_string()).collect();
        assert_eq!(unproven, vec!["ns/w=worker/g0/*".to_owned()]);
    }
}

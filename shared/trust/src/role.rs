//! The roles a peer's certificate can name: what it may do is decided by its role alone.

use std::fmt;

/// What a peer may do is decided by its role alone (and, for a worker, its group and id).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// A decode worker's shim: streams its own telemetry.
    Worker,
    /// br-ingest: applies validated telemetry to σ.
    Ingest,
    /// br-decision: reserves and releases capacity, watches σ.
    Decision,
    /// br-snapshot: owns σ (it calls no one, but has a certificate to serve with).
    Snapshot,
    /// An HTTP gateway: asks `Assign` and `Cancel`.
    Gateway,
    /// An operator's tools: read σ, cordon and drain.
    Admin,
    /// br-all, ingest, snapshot and decision in one process: as a server it stands for each
    /// of the three (see [`Role::serves_as`]); as a client it may call nothing (it calls its
    /// parts in-process), so the method table lists it nowhere.
    All,
}

impl Role {
    /// Every role, in a fixed order (tests iterate over it).
    pub const ALL: [Role; 7] = [
        Role::Worker,
        Role::Ingest,
        Role::Decision,
        Role::Snapshot,
        Role::Gateway,
        Role::Admin,
        Role::All,
    ];

    /// The path segment after `/br/` (and the file name `scripts/dev-certs.sh` uses).
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Worker => "worker",
            Role::Ingest => "ingest",
            Role::Decision => "decision",
            Role::Snapshot => "snapshot",
            Role::Gateway => "gateway",
            Role::Admin => "admin",
            Role::All => "all",
        }
    }

    /// Whether a server of this role may answer a client that expects `want`: its own role,
    /// or br-all in the place of any of the services it runs (a shim expecting ingest, a
    /// gateway expecting decision, brctl expecting snapshot all reach br-all's one port).
    pub fn serves_as(self, want: Role) -> bool {
        self == want
            || (self == Role::All && matches!(want, Role::Ingest | Role::Decision | Role::Snapshot))
    }

    pub(crate) fn parse(s: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|r| r.as_str() == s)
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

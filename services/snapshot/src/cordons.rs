//! Cordons that outlive σ: the operator's `SetCordon` decisions, by group and worker id, kept
//! by the writer beside σ and, with `--cordon-file`, on disk.
//!
//! σ is soft state: a restarted snapshot service rebuilds it from the shims' Hellos and full
//! states. A cordon is not telemetry, though; no shim reports it, so σ alone forgets it on a
//! restart (and when an idle group is reclaimed), and a cordoned rank got traffic again. The
//! writer therefore holds the cordons itself and re-applies one in the same version as the
//! Hello that brings its worker (back) into σ, so no watcher ever sees the worker routable.
//! With `--cordon-file` every change is written (temporary file, fsync, rename) before
//! SetCordon answers, and read at start; without it cordons live as long as the process.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;
use std::path::{Path, PathBuf};

/// The file's format version (`{"version": 1, "groups": {"g0": [1, 3]}}`).
const FORMAT: u32 = 1;

#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct OnDisk {
    version: u32,
    groups: BTreeMap<String, BTreeSet<u32>>,
}

/// Why the cordon file could not be read at start.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("--cordon-file {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("--cordon-file {path}: not a cordon file: {why}")]
    Format { path: String, why: String },
}

/// The cordoned workers of every group (see the module docs).
#[derive(Debug, Default)]
pub struct Cordons {
    path: Option<PathBuf>,
    groups: BTreeMap<String, BTreeSet<u32>>,
}

impl Cordons {
    /// Cordons kept in memory only.
    pub fn in_memory() -> Cordons {
        Cordons::default()
    }

    /// The cordons in `path` (none if the file does not exist yet), kept there from now on.
    pub fn load(path: &Path) -> Result<Cordons, LoadError> {
        let shown = path.display().to_string();
        let groups = match std::fs::read(path) {
            Ok(bytes) => {
                let d: OnDisk = serde_json::from_slice(&bytes).map_err(|e| LoadError::Format {
                    path: shown.clone(),
                    why: e.to_string(),
                })?;
                if d.version != FORMAT {
                    return Err(LoadError::Format {
                        path: shown,
                        why: format!("format version {} (this binary reads {FORMAT})", d.version),
                    });
                }
                d.groups
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(source) => {
                return Err(LoadError::Io {
                    path: shown,
                    source,
                });
            }
        };
        Ok(Cordons {
            path: Some(path.to_owned()),
            groups,
        })
    }

    /// The cordoned workers of `group` (empty for most groups).
    pub fn of(&self, group: &str) -> Option<&BTreeSet<u32>> {
        self.groups.get(group)
    }

    /// Whether `worker` of `group` is cordoned.
    pub fn contains(&self, group: &str, worker: u32) -> bool {
        self.of(group).is_some_and(|s| s.contains(&worker))
    }

    /// How many workers are cordoned, over every group.
    pub fn len(&self) -> usize {
        self.groups.values().map(BTreeSet::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// Records a cordon (or its removal) and, with a file, writes it before returning; on a
    /// write error nothing changes (the caller refuses the SetCordon). Returns whether the
    /// set changed.
    pub fn set(&mut self, group: &str, worker: u32, cordoned: bool) -> std::io::Result<bool> {
        if self.contains(group, worker) == cordoned {
            return Ok(false);
        }
        let mut next = self.groups.clone();
        if cordoned {
            next.entry(group.to_owned()).or_default().insert(worker);
        } else if let Some(s) = next.get_mut(group) {
            s.remove(&worker);
            if s.is_empty() {
                next.remove(group);
            }
        }
        if let Some(path) = &self.path {
            save(path, &next)?;
        }
        self.groups = next;
        Ok(true)
    }
}

/// Writes the cordons atomically: a temporary file beside `path`, synced, renamed over it,
/// and the directory synced, so a crash leaves the old file or the new one, never half.
fn save(path: &Path, groups: &BTreeMap<String, BTreeSet<u32>>) -> std::io::Result<()> {
    let d = OnDisk {
        version: FORMAT,
        groups: groups.clone(),
    };
    let bytes = serde_json::to_vec_pretty(&d).map_err(std::io::Error::other)?;
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
        _ => PathBuf::from("."),
    };
    let mut name = path.file_name().unwrap_or_default().to_owned();
    name.push(".tmp");
    let tmp = dir.join(name);
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&bytes)?;
        f.write_all(b"\n")?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    std::fs::File::open(&dir)?.sync_all()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn cordons_survive_a_reload_and_uncordons_clear_them() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cordons.json");
        let mut c = Cordons::load(&path).unwrap();
        assert!(c.is_empty(), "no file yet: nothing cordoned");
        assert!(c.set("g0", 3, true).unwrap());
        assert!(!c.set("g0", 3, true).unwrap(), "already cordoned");
        assert!(c.set("g1", 0, true).unwrap());

        let mut again = Cordons::load(&path).unwrap();
        assert!(again.contains("g0", 3) && again.contains("g1", 0));
        assert_eq!(again.len(), 2);
        assert!(again.set("g0", 3, false).unwrap());
        let last = Cordons::load(&path).unwrap();
        assert!(!last.contains("g0", 3));
        assert_eq!(last.of("g0"), None, "an emptied group is dropped");
        assert!(last.contains("g1", 0));
    }

    #[test]
    fn a_bad_file_is_refused_at_start() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cordons.json");
        std::fs::write(&path, b"{\"version\": 9, \"groups\": {}}").unwrap();
        assert!(matches!(
            Cordons::load(&path),
            Err(LoadError::Format { .. })
        ));
        std::fs::write(&path, b"not json").unwrap();
        assert!(matches!(
            Cordons::load(&path),
            Err(LoadError::Format { .. })
        ));
    }

    #[test]
    fn a_failed_write_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        // a path whose directory does not exist: every write fails
        let path = dir.path().join("missing").join("cordons.json");
        let mut c = Cordons::load(&path).unwrap();
        assert!(c.set("g0", 1, true).is_err());
        assert!(!c.contains("g0", 1));
    }
}

//! The `br-certs` binary: what it writes for a shim serving several ranks, and what it refuses.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::{Command, Output};

use br_trust::{Role, TlsFiles, TlsMaterial, WorkerIds, WorkerSlot};

const TD: &str = "balanceroute.local";

fn br_certs(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_br-certs"))
        .args(args)
        .output()
        .expect("run br-certs")
}

/// The identity of the certificate `name` in `dir`, as a service reads it.
fn identity(dir: &Path, name: &str) -> br_trust::Identity {
    let files = TlsFiles {
        cert: dir.join(format!("{name}.pem")),
        key: dir.join(format!("{name}-key.pem")),
        ca: dir.join("ca.pem"),
    };
    TlsMaterial::load(files, TD)
        .unwrap()
        .own_identity()
        .unwrap()
}

#[test]
fn a_worker_range_is_one_certificate_naming_each_rank() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().to_str().unwrap();
    let out = br_certs(&[
        out_dir,
        "g0",
        "2",
        "--worker-range",
        "0-3",
        "--worker-range",
        "4-7",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(
        stdout.contains("2 multi-rank worker certificates"),
        "{stdout}"
    );
    for (name, first, last) in [("worker-g0-0-3", 0, 3), ("worker-g0-4-7", 4, 7)] {
        let id = identity(dir.path(), name);
        assert_eq!(id.role, Role::Worker);
        assert_eq!(
            id.spiffe_id,
            format!("spiffe://{TD}/br/worker/g0/{first}-{last}")
        );
        let want = WorkerSlot {
            group: "g0".into(),
            workers: Some(WorkerIds::range(first, last).unwrap()),
        };
        assert_eq!(id.worker, Some(want));
    }
    // the per-rank certificates are as before
    let one = identity(dir.path(), "worker-g0-1");
    assert_eq!(one.spiffe_id, format!("spiffe://{TD}/br/worker/g0/1"));
}

#[test]
fn a_bad_range_is_refused_before_anything_is_written() {
    for (range, why) in [
        ("3-3", "FIRST below LAST"),
        ("3", "names one rank"),
        ("3-1", "FIRST below LAST"),
        ("0-1024", "above 1023"),
        ("0,1", "not a worker id"),
        ("a-b", "not a worker id"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let out_dir = dir.path().join("certs");
        let out = br_certs(&[
            out_dir.to_str().unwrap(),
            "g0",
            "2",
            "--worker-range",
            range,
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{range}: {out:?}");
        assert!(stderr.contains("--worker-range"), "{range}: {stderr}");
        assert!(stderr.contains(why), "{range}: {stderr}");
        assert!(!out_dir.exists(), "{range}: nothing is written");
    }
}

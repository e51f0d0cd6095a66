//! Generates the prost messages and tonic clients/servers for `proto/balanceroute/v1` without a
//! system `protoc`: protox parses the files into a `FileDescriptorSet`, which is handed to
//! tonic-prost-build and also written out (encoded) for tonic-reflection.

use std::path::PathBuf;

use prost::Message as _;

const PROTOS: &[&str] = &[
    "balanceroute/v1/types.proto",
    "balanceroute/v1/decision.proto",
    "balanceroute/v1/telemetry.proto",
    "balanceroute/v1/snapshot.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let manifest_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let proto_root = manifest_dir.join("../../proto");
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);

    println!("cargo:rerun-if-changed={}", proto_root.display());
    for p in PROTOS {
        println!("cargo:rerun-if-changed={}", proto_root.join(p).display());
    }

    let fds = protox::compile(PROTOS, [&proto_root])?;
    std::fs::write(
        out_dir.join("balanceroute_descriptor.bin"),
        fds.encode_to_vec(),
    )?;

    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .emit_rerun_if_changed(false)
        .compile_fds(fds)?;
    Ok(())
}

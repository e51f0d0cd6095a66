//! `br-snapshot`: see the library docs and `br-snapshot --help`.

#[tokio::main]
async fn main() -> std::process::ExitCode {
    br_runtime::skeleton::main("br-snapshot", br_snapshot::start).await
}

//! br-ingest: see the library docs and `br-ingest --help`.

#[tokio::main]
async fn main() -> std::process::ExitCode {
    br_runtime::skeleton::main("br-ingest", br_ingest::start).await
}

//! `br-shim`: see the library docs and `br-shim --help`.

#[tokio::main]
async fn main() -> std::process::ExitCode {
    br_runtime::skeleton::main("br-shim", br_shim::start).await
}

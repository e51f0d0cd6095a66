//! `br-all`: see the library docs and `br-all --help`.

#[tokio::main]
async fn main() -> std::process::ExitCode {
    br_runtime::skeleton::main("br-all", br_all::start).await
}

//! `br-decision`: see the library docs and `br-decision --help`.

#[tokio::main]
async fn main() -> std::process::ExitCode {
    br_runtime::skeleton::main("br-decision", br_decision::start).await
}

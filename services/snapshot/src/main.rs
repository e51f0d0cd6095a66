//! `br-snapshot`: see the library docs and `br-snapshot --help`.

// glibc's malloc kept what watchers that went away had held (150 MiB still resident after
// 512 of them closed, docs/design/0017-slow-watchers.md); mimalloc returns freed pages to the
// system.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    br_runtime::skeleton::main("br-snapshot", br_snapshot::start).await
}

//! `br-snapshot`: see the library docs and `br-snapshot --help`.

// jemalloc with br-memory's settings: memory freed after a load goes back to the system within
// seconds, from jemalloc's own thread (see br_memory).
#[global_allocator]
static ALLOCATOR: br_memory::Allocator = br_memory::Allocator;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    br_runtime::skeleton::main("br-snapshot", br_snapshot::start).await
}

//! The `brctl` binary: parses the command line and runs it (see the library's docs).

use clap::Parser as _;

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let cli = brctl::Cli::parse();
    let mut out = std::io::stdout();
    match brctl::run(cli, &mut out).await {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("brctl: {e:#}");
            std::process::exit(1);
        }
    }
}

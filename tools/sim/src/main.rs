//! `br-sim`: see the library docs and `br-sim --help`.

use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = br_sim::cli::Cli::parse();
    match br_sim::execute(cli.into_command()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("br-sim: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

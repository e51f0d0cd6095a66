//! What each command does (the binary is a thin wrapper around [`execute`]).

use anyhow::Context as _;

use crate::calibrate;
use crate::cli::{CalibrateArgs, Command, RunArgs, SweepArgs};
use crate::trace::summarize;

/// Runs one command.
pub fn execute(cmd: Command) -> anyhow::Result<()> {
    match cmd {
        Command::Run(args) => run(&args),
        Command::Sweep(args) => sweep(&args),
        Command::Calibrate(args) => calibrate_cmd(&args),
    }
}

fn run(args: &RunArgs) -> anyhow::Result<()> {
    let w = args.workload()?;
    let s = summarize(&w.requests);
    println!(
        "workload {}: {} requests, mean prompt {:.0}, mean output {:.0}",
        w.name, s.requests, s.mean_prompt, s.mean_output
    );
    anyhow::bail!("the simulation engine needs br-core, which has not landed yet")
}

fn sweep(args: &SweepArgs) -> anyhow::Result<()> {
    let _ = args.run.workload()?;
    anyhow::bail!("the simulation engine needs br-core, which has not landed yet")
}

fn calibrate_cmd(args: &CalibrateArgs) -> anyhow::Result<()> {
    let fit = calibrate::calibrate_file(&args.samples, args.strict)?;
    print!("{}", fit.render());
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&fit)?;
        std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

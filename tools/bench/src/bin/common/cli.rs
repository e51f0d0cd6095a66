//! The drivers' command lines as their tests see them: parsed as clap would with no
//! environment (clap reads the `BALANCEROUTE_*` variables at parse time, and a shell that
//! sourced deploy/split.env must not change what the defaults are).

use clap::{CommandFactory, FromArgMatches};

/// `T` parsed from `argv` with every flag's variable ignored.
pub fn bare<T: CommandFactory + FromArgMatches>(argv: &[&str]) -> T {
    let cmd = T::command().mut_args(|a| a.env(None::<&'static str>));
    let matches = cmd
        .try_get_matches_from(argv)
        .unwrap_or_else(|e| panic!("{argv:?}: {e}"));
    T::from_arg_matches(&matches).unwrap_or_else(|e| panic!("{argv:?}: {e}"))
}

/// The environment variable of `T`'s flag `id`.
pub fn env_of<T: CommandFactory>(id: &str) -> Option<String> {
    T::command()
        .get_arguments()
        .find(|a| a.get_id() == id)
        .unwrap_or_else(|| panic!("no flag {id}"))
        .get_env()
        .map(|v| v.to_string_lossy().into_owned())
}

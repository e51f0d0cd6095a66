//! Writes the fuzzing seeds (valid messages of every kind, each prefixed with its target's
//! selector byte, as `fuzz/fuzz_targets/decode.rs` reads them) into the directory given.
//! `cargo run -p br-proto --example fuzz_seeds -- fuzz/corpus/decode` (scripts/fuzz.sh does it).

use br_proto::fuzz::Target;

fn main() -> std::io::Result<()> {
    let dir = std::env::args_os()
        .nth(1)
        .map(std::path::PathBuf::from)
        .ok_or_else(|| std::io::Error::other("usage: fuzz_seeds DIR"))?;
    std::fs::create_dir_all(&dir)?;
    for (selector, target) in Target::ALL.into_iter().enumerate() {
        for (n, seed) in target.seeds().into_iter().enumerate() {
            let mut bytes = vec![u8::try_from(selector).map_err(std::io::Error::other)?];
            bytes.extend(seed);
            std::fs::write(dir.join(format!("seed-{}-{n}", target.name())), bytes)?;
        }
    }
    Ok(())
}

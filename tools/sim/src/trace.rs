//! Request traces: one [`TraceRequest`] per request, and loaders for the public formats.
//!
//! Supported inputs (see `data/traces/README.md`; excerpts in `tests/data/`):
//!
//! | format | detected by | arrival | prompt hash |
//! |---|---|---|---|
//! | Azure LLM inference CSV | `.csv` with header `TIMESTAMP,ContextTokens,GeneratedTokens` | ms since the first row | none |
//! | Mooncake JSONL | `.jsonl` / `.json`, or a first line starting with `{` | `timestamp` (ms) | hash of the `hash_ids` list |
//! | length-only CSV (sarathi) | `.csv` with `num_prefill_tokens,num_decode_tokens` columns | none | none |
//! | generic CSV | `.csv` with `prompt_tokens,output_tokens` (optional `arrival_ms`, `prompt_hash`, `expected_output_tokens`, `request_class`) | optional | optional |
//!
//! Only the generic CSV carries clients' hints: its optional `expected_output_tokens` column is
//! the expected output length each request was sent with (empty: none), which is how a live
//! run's arrivals (`br-emu load --arrivals-csv`) give the twin the hints the decision saw.
//! Likewise its optional `request_class` column: each request's class key (empty: none), the
//! gateway's label the Assign contract takes, which the twin carries as its id ([`Class`]).
//!
//! Bad rows are typed errors ([`TraceError::BadRow`]) naming the file and the 1-based line; the
//! loaders never panic on input. Requests with zero output tokens cannot be decoded and are
//! dropped (and counted in [`LoadStats::dropped_zero_output`]).

use std::fmt;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// One request of a trace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceRequest {
    /// Arrival time in ms relative to the trace start; `None` for length-only traces.
    pub arrival_ms: Option<f64>,
    /// Prompt (prefill) tokens s_i.
    pub prompt_tokens: u32,
    /// Output tokens o_i (decode steps the request stays active).
    pub output_tokens: u32,
    /// Hash identifying the prompt; equal prompts share it (ExactMatch predictors key on it).
    pub prompt_hash: Option<u64>,
    /// The client's expected output length, a hint: a generic CSV's `expected_output_tokens`
    /// (a live run's arrivals), none in the other formats or a synthetic workload;
    /// `--hint-error` / `--hint-mode` derive one from `output_tokens`.
    pub expected_output: Option<u32>,
    /// The request's class: a generic CSV's `request_class` (a live run's arrivals), none in
    /// the other formats or a synthetic workload; `--classes` makes them from `output_tokens`.
    #[serde(default)]
    pub class: Option<Class>,
}

impl TraceRequest {
    /// The request's class id, as `RequestInfo::class` and σ carry it.
    pub fn class_id(&self) -> Option<u64> {
        self.class.as_ref().map(Class::id)
    }
}

/// A request's class: its key, the label a gateway sends as `AssignRequest.request_class`
/// (1..=64 bytes of printable ASCII without spaces, as the contract requires), and the id
/// every crate computes from it (`br_core::class_id`). The key is kept beside the id so a
/// replay through the live services (`br-emu load`) can send what the twin simulated. Cheap
/// to clone.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Class {
    key: Arc<str>,
    id: u64,
}

impl Class {
    /// Longest key, in bytes (the Assign contract's limit).
    pub const MAX_KEY_BYTES: usize = 64;

    /// Validates `key` as the contract does: 1..=64 bytes, each 0x21..=0x7E.
    pub fn new(key: &str) -> Result<Class, String> {
        if key.is_empty() || key.len() > Self::MAX_KEY_BYTES {
            return Err(format!(
                "`{key}` is {} bytes long, a class key takes 1..={}",
                key.len(),
                Self::MAX_KEY_BYTES
            ));
        }
        if let Some(c) = key.chars().find(|c| !c.is_ascii_graphic()) {
            return Err(format!(
                "`{key}` contains {c:?}, a class key takes only printable ASCII without spaces \
                 (0x21..=0x7E)"
            ));
        }
        Ok(Class {
            key: Arc::from(key),
            id: br_core::class_id(key),
        })
    }

    /// The key, as a gateway sends it.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Its id, `br_core::class_id(key)`.
    pub fn id(&self) -> u64 {
        self.id
    }
}

impl TryFrom<String> for Class {
    type Error = String;
    fn try_from(key: String) -> Result<Class, String> {
        Class::new(&key)
    }
}

impl From<Class> for String {
    fn from(c: Class) -> String {
        c.key.to_string()
    }
}

/// The on-disk formats the loader understands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceFormat {
    /// Azure LLM inference trace CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`).
    AzureCsv,
    /// Mooncake JSONL (`timestamp`, `input_length`, `output_length`, `hash_ids`).
    MooncakeJsonl,
    /// Length-only CSV (`num_prefill_tokens`, `num_decode_tokens`, ...), e.g. sarathi-serve's.
    LengthCsv,
    /// Our own CSV: `prompt_tokens,output_tokens[,arrival_ms][,prompt_hash][,expected_output_tokens][,request_class]`.
    GenericCsv,
}

impl fmt::Display for TraceFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TraceFormat::AzureCsv => "azure-csv",
            TraceFormat::MooncakeJsonl => "mooncake-jsonl",
            TraceFormat::LengthCsv => "length-csv",
            TraceFormat::GenericCsv => "generic-csv",
        })
    }
}

/// Errors from loading a trace.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file could not be opened or read.
    #[error("{path}: {error}")]
    Io {
        /// File being read.
        path: PathBuf,
        /// Underlying error.
        // Not `source`: the message already says it, and `{:#}` would print it twice.
        error: std::io::Error,
    },
    /// The format could not be recognised.
    #[error("{path}: unrecognised trace format: {reason}")]
    UnknownFormat {
        /// File being read.
        path: PathBuf,
        /// What was seen.
        reason: String,
    },
    /// A required column is missing from a CSV header.
    #[error("{path}: missing column `{column}` in header")]
    MissingColumn {
        /// File being read.
        path: PathBuf,
        /// Column name.
        column: &'static str,
    },
    /// A row could not be parsed.
    #[error("{path}:{line}: {msg}")]
    BadRow {
        /// File being read.
        path: PathBuf,
        /// 1-based line number in the file.
        line: u64,
        /// What is wrong with it.
        msg: String,
    },
}

/// Filters applied while loading, in order: drop zero outputs, `min_output`, then `limit`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Filter {
    /// Keep only requests with `output_tokens >= min_output`.
    pub min_output: Option<u32>,
    /// Keep at most this many requests (the first ones after filtering).
    pub limit: Option<usize>,
}

impl Filter {
    /// Applies the filter to an in-memory list (used for synthetic traces).
    pub fn apply(&self, reqs: Vec<TraceRequest>) -> (Vec<TraceRequest>, LoadStats) {
        let mut stats = LoadStats::default();
        let mut out = Vec::with_capacity(reqs.len());
        for r in reqs {
            stats.rows += 1;
            self.push(&mut out, &mut stats, r);
        }
        (out, stats)
    }

    /// Returns true once `limit` requests are kept.
    fn full(&self, kept: usize) -> bool {
        self.limit.is_some_and(|l| kept >= l)
    }

    fn push(&self, out: &mut Vec<TraceRequest>, stats: &mut LoadStats, r: TraceRequest) {
        if r.output_tokens == 0 {
            stats.dropped_zero_output += 1;
        } else if self.min_output.is_some_and(|m| r.output_tokens < m) {
            stats.dropped_filter += 1;
        } else if !self.full(out.len()) {
            out.push(r);
        }
    }
}

/// What the loader saw.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct LoadStats {
    /// Data rows read (before filtering; reading stops once `limit` is reached).
    pub rows: u64,
    /// Rows dropped because they have no output tokens.
    pub dropped_zero_output: u64,
    /// Rows dropped by `min_output`.
    pub dropped_filter: u64,
}

/// A loaded trace.
#[derive(Debug, Clone)]
pub struct Trace {
    /// Detected format.
    pub format: TraceFormat,
    /// Requests in file order.
    pub requests: Vec<TraceRequest>,
    /// Counters.
    pub stats: LoadStats,
}

/// Loads a trace file, detecting its format from the extension and header.
pub fn load(path: &Path, filter: &Filter) -> Result<Trace, TraceError> {
    let io = |error| TraceError::Io {
        path: path.to_path_buf(),
        error,
    };
    let file = File::open(path).map_err(io)?;
    let mut reader = BufReader::new(file);
    let format = detect(path, &mut reader)?;
    let mut requests = Vec::new();
    let mut stats = LoadStats::default();
    match format {
        TraceFormat::MooncakeJsonl => load_jsonl(path, reader, filter, &mut requests, &mut stats)?,
        _ => load_csv(path, reader, filter, &mut requests, &mut stats)?,
    }
    Ok(Trace {
        format,
        requests,
        stats,
    })
}

/// Detects the format from the extension and the first line (without consuming it).
fn detect(path: &Path, reader: &mut BufReader<File>) -> Result<TraceFormat, TraceError> {
    let buf = reader.fill_buf().map_err(|error| TraceError::Io {
        path: path.to_path_buf(),
        error,
    })?;
    let first_line = String::from_utf8_lossy(buf.split(|&b| b == b'\n').next().unwrap_or(&[]))
        .trim()
        .trim_start_matches('\u{feff}')
        .to_string();
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .unwrap_or("")
        .to_ascii_lowercase();
    let unknown = |reason: String| TraceError::UnknownFormat {
        path: path.to_path_buf(),
        reason,
    };
    if first_line.is_empty() {
        return Err(unknown("empty file".into()));
    }
    if ext == "jsonl" || ext == "json" || first_line.starts_with('{') {
        return Ok(TraceFormat::MooncakeJsonl);
    }
    let cols: Vec<String> = first_line
        .split(',')
        .map(|c| c.trim().to_ascii_lowercase())
        .collect();
    let has = |c: &str| cols.iter().any(|x| x == c);
    if has("timestamp") && has("contexttokens") && has("generatedtokens") {
        Ok(TraceFormat::AzureCsv)
    } else if has("num_prefill_tokens") && has("num_decode_tokens") {
        Ok(TraceFormat::LengthCsv)
    } else if has("prompt_tokens") && has("output_tokens") {
        Ok(TraceFormat::GenericCsv)
    } else {
        Err(unknown(format!(
            "header `{first_line}` is none of Azure (TIMESTAMP,ContextTokens,GeneratedTokens), \
             length-only (num_prefill_tokens,num_decode_tokens), generic (prompt_tokens,output_tokens) \
             or Mooncake JSONL"
        )))
    }
}

fn load_csv(
    path: &Path,
    reader: BufReader<File>,
    filter: &Filter,
    out: &mut Vec<TraceRequest>,
    stats: &mut LoadStats,
) -> Result<(), TraceError> {
    let mut rdr = csv::ReaderBuilder::new()
        .has_headers(true)
        .trim(csv::Trim::All)
        .flexible(true)
        .from_reader(reader);
    let bad = |line: u64, msg: String| TraceError::BadRow {
        path: path.to_path_buf(),
        line,
        msg,
    };
    let headers = rdr
        .headers()
        .map_err(|e| bad(1, e.to_string()))?
        .iter()
        .map(|h| h.trim_start_matches('\u{feff}').to_ascii_lowercase())
        .collect::<Vec<_>>();
    let col = |name: &'static str| -> Result<usize, TraceError> {
        headers
            .iter()
            .position(|h| h == name)
            .ok_or(TraceError::MissingColumn {
                path: path.to_path_buf(),
                column: name,
            })
    };
    let opt_col = |name: &'static str| headers.iter().position(|h| h == name);
    // Column indexes per format: (arrival, prompt, output, hash, hint, class).
    let (ts, prompt, output, hash, hint, class, azure) =
        if headers.iter().any(|h| h == "contexttokens") {
            (
                Some(col("timestamp")?),
                col("contexttokens")?,
                col("generatedtokens")?,
                None,
                None,
                None,
                true,
            )
        } else if headers.iter().any(|h| h == "num_prefill_tokens") {
            (
                None,
                col("num_prefill_tokens")?,
                col("num_decode_tokens")?,
                None,
                None,
                None,
                false,
            )
        } else {
            (
                opt_col("arrival_ms"),
                col("prompt_tokens")?,
                col("output_tokens")?,
                opt_col("prompt_hash"),
                opt_col(EXPECTED_OUTPUT_COLUMN),
                opt_col(CLASS_COLUMN),
                false,
            )
        };
    let mut first_ts: Option<f64> = None;
    let mut record = csv::StringRecord::new();
    loop {
        if filter.full(out.len()) {
            break;
        }
        let more = rdr.read_record(&mut record).map_err(|e| {
            let line = e.position().map_or(0, |p| p.line());
            bad(line, e.to_string())
        })?;
        if !more {
            break;
        }
        let line = record.position().map_or(0, |p| p.line());
        if record.iter().all(|f| f.is_empty()) {
            continue;
        }
        let field = |i: usize, name: &str| {
            record
                .get(i)
                .ok_or_else(|| bad(line, format!("missing field `{name}`")))
        };
        let prompt_tokens = parse_tokens(field(prompt, "prompt tokens")?)
            .map_err(|m| bad(line, format!("prompt tokens: {m}")))?;
        let output_tokens = parse_tokens(field(output, "output tokens")?)
            .map_err(|m| bad(line, format!("output tokens: {m}")))?;
        let arrival_ms = match ts {
            None => None,
            Some(i) => {
                let raw = field(i, "timestamp")?;
                let t = if azure {
                    parse_azure_timestamp(raw).map_err(|m| bad(line, m))?
                } else {
                    parse_finite(raw).map_err(|m| bad(line, format!("arrival_ms: {m}")))?
                };
                if azure {
                    let t0 = *first_ts.get_or_insert(t);
                    Some(t - t0)
                } else {
                    Some(t)
                }
            }
        };
        let prompt_hash = match hash.and_then(|i| record.get(i)) {
            None | Some("") => None,
            Some(raw) => Some(
                raw.parse::<u64>()
                    .map_err(|e| bad(line, format!("prompt_hash `{raw}`: {e}")))?,
            ),
        };
        let expected_output = match hint.and_then(|i| record.get(i)) {
            None | Some("") => None,
            Some(raw) => Some(
                parse_hint(raw).map_err(|m| bad(line, format!("{EXPECTED_OUTPUT_COLUMN}: {m}")))?,
            ),
        };
        let class = match class.and_then(|i| record.get(i)) {
            None | Some("") => None,
            Some(raw) => {
                Some(Class::new(raw).map_err(|m| bad(line, format!("{CLASS_COLUMN}: {m}")))?)
            }
        };
        stats.rows += 1;
        filter.push(
            out,
            stats,
            TraceRequest {
                arrival_ms,
                prompt_tokens,
                output_tokens,
                prompt_hash,
                expected_output,
                class,
            },
        );
    }
    Ok(())
}

/// The generic CSV's column of clients' expected output lengths: the Assign contract's field
/// name, since it holds what the decision service was sent.
pub const EXPECTED_OUTPUT_COLUMN: &str = "expected_output_tokens";

/// The generic CSV's column of class keys: the Assign contract's field name, since it holds
/// what the decision service was sent.
pub const CLASS_COLUMN: &str = "request_class";

#[derive(Deserialize)]
struct MooncakeRow {
    timestamp: Option<f64>,
    input_length: u32,
    output_length: u32,
    #[serde(default)]
    hash_ids: Option<Vec<u64>>,
}

fn load_jsonl(
    path: &Path,
    reader: BufReader<File>,
    filter: &Filter,
    out: &mut Vec<TraceRequest>,
    stats: &mut LoadStats,
) -> Result<(), TraceError> {
    for (idx, line) in reader.lines().enumerate() {
        if filter.full(out.len()) {
            break;
        }
        let lineno = idx as u64 + 1;
        let line = line.map_err(|error| TraceError::Io {
            path: path.to_path_buf(),
            error,
        })?;
        let text = line.trim();
        if text.is_empty() {
            continue;
        }
        let row: MooncakeRow = serde_json::from_str(text).map_err(|e| TraceError::BadRow {
            path: path.to_path_buf(),
            line: lineno,
            msg: e.to_string(),
        })?;
        if let Some(t) = row.timestamp
            && !t.is_finite()
        {
            return Err(TraceError::BadRow {
                path: path.to_path_buf(),
                line: lineno,
                msg: format!("timestamp {t} is not finite"),
            });
        }
        stats.rows += 1;
        filter.push(
            out,
            stats,
            TraceRequest {
                arrival_ms: row.timestamp,
                prompt_tokens: row.input_length,
                output_tokens: row.output_length,
                prompt_hash: row.hash_ids.as_deref().map(hash_ids),
                expected_output: None,
                class: None,
            },
        );
    }
    Ok(())
}

/// Hashes a list of block hash ids into one prompt hash (FNV-1a over the little-endian ids,
/// then a splitmix finaliser). Deterministic across runs and platforms: equal lists, i.e.
/// equal prompts, share a hash.
pub fn hash_ids(ids: &[u64]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for id in ids {
        for b in id.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    mix64(h ^ ids.len() as u64)
}

/// splitmix64 finaliser.
pub(crate) fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Parses a token count: a non-negative integer (an integral float like `74.0` is accepted).
fn parse_tokens(raw: &str) -> Result<u32, String> {
    if let Ok(v) = raw.parse::<u32>() {
        return Ok(v);
    }
    match raw.parse::<f64>() {
        Ok(f) if f.is_finite() && f >= 0.0 && f.fract() == 0.0 && f <= f64::from(u32::MAX) => {
            Ok(f as u32)
        }
        _ => Err(format!("`{raw}` is not a non-negative integer")),
    }
}

/// Parses an expected output length: a token count of at least 1, as the Assign contract
/// accepts (a hint of nothing is sent as no hint, an empty field here).
fn parse_hint(raw: &str) -> Result<u32, String> {
    match parse_tokens(raw)? {
        0 => Err(format!(
            "`{raw}` is not at least 1 (an empty field is no hint)"
        )),
        v => Ok(v),
    }
}

fn parse_finite(raw: &str) -> Result<f64, String> {
    match raw.parse::<f64>() {
        Ok(f) if f.is_finite() => Ok(f),
        _ => Err(format!("`{raw}` is not a finite number")),
    }
}

/// Parses `YYYY-MM-DD HH:MM:SS[.fraction]` (also `T` as separator, an optional trailing `Z`;
/// always UTC) into ms since 1970-01-01, with the `time` crate's parser.
pub fn parse_azure_timestamp(raw: &str) -> Result<f64, String> {
    const FORMAT: &[time::format_description::BorrowedFormatItem<'_>] = time::macros::format_description!(
        "[year]-[month]-[day][first [ ][T]][hour]:[minute]:[second][optional [.[subsecond]]]"
    );
    let trimmed = raw.trim();
    let trimmed = trimmed.strip_suffix('Z').unwrap_or(trimmed);
    let at = time::PrimitiveDateTime::parse(trimmed, FORMAT)
        .map_err(|_| format!("timestamp `{raw}` is not `YYYY-MM-DD HH:MM:SS[.fff]`"))?
        .assume_utc();
    Ok(at.unix_timestamp() as f64 * 1000.0 + f64::from(at.nanosecond()) / 1e6)
}

/// Summary statistics of a list of requests (for printing and tests).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct TraceSummary {
    /// Number of requests.
    pub requests: usize,
    /// Mean prompt tokens.
    pub mean_prompt: f64,
    /// Mean output tokens.
    pub mean_output: f64,
    /// Smallest / largest prompt.
    pub min_prompt: u32,
    /// Largest prompt.
    pub max_prompt: u32,
    /// Smallest output.
    pub min_output: u32,
    /// Largest output.
    pub max_output: u32,
    /// Share of requests whose prompt hash occurred earlier in the trace.
    pub repeat_share: f64,
    /// Span of arrival times in ms (0 without timestamps).
    pub span_ms: f64,
}

/// Computes a [`TraceSummary`].
pub fn summarize(reqs: &[TraceRequest]) -> TraceSummary {
    if reqs.is_empty() {
        return TraceSummary::default();
    }
    let n = reqs.len() as f64;
    let mut seen = std::collections::HashSet::new();
    let mut repeats = 0usize;
    let (mut tmin, mut tmax) = (f64::INFINITY, f64::NEG_INFINITY);
    for r in reqs {
        if let Some(h) = r.prompt_hash
            && !seen.insert(h)
        {
            repeats += 1;
        }
        if let Some(t) = r.arrival_ms {
            tmin = tmin.min(t);
            tmax = tmax.max(t);
        }
    }
    TraceSummary {
        requests: reqs.len(),
        mean_prompt: reqs.iter().map(|r| f64::from(r.prompt_tokens)).sum::<f64>() / n,
        mean_output: reqs.iter().map(|r| f64::from(r.output_tokens)).sum::<f64>() / n,
        min_prompt: reqs.iter().map(|r| r.prompt_tokens).min().unwrap_or(0),
        max_prompt: reqs.iter().map(|r| r.prompt_tokens).max().unwrap_or(0),
        min_output: reqs.iter().map(|r| r.output_tokens).min().unwrap_or(0),
        max_output: reqs.iter().map(|r| r.output_tokens).max().unwrap_or(0),
        repeat_share: repeats as f64 / n,
        span_ms: if tmax >= tmin { tmax - tmin } else { 0.0 },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn write(name: &str, body: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join(name);
        let mut f = File::create(&p).expect("create");
        f.write_all(body.as_bytes()).expect("write");
        (dir, p)
    }

    #[test]
    fn azure_timestamp_parses_to_ms() {
        let a = parse_azure_timestamp("2023-11-16 18:15:46.6805900").expect("parse");
        let b = parse_azure_timestamp("2023-11-16 18:15:50.9951690").expect("parse");
        assert!((b - a - 4314.579).abs() < 1e-3, "{}", b - a);
        // day rollover and epoch anchor
        assert_eq!(
            parse_azure_timestamp("1970-01-02 00:00:00").ok(),
            Some(86_400_000.0)
        );
        let c = parse_azure_timestamp("2023-11-16 23:59:59.5").expect("parse");
        let d = parse_azure_timestamp("2023-11-17 00:00:00.5").expect("parse");
        assert!((d - c - 1000.0).abs() < 1e-6);
        // ISO 8601's `T` and `Z` are the same instant
        assert_eq!(
            parse_azure_timestamp("2023-11-16T23:59:59.5Z").ok(),
            Some(c)
        );
        for bad in [
            "",
            "2023-11-16",
            "2023-13-01 00:00:00",
            "x 1:2:3",
            "2023-11-16 18:15:4a",
            "2023-11-16 18:15:46.",
            "2023-11-16 24:00:00",
        ] {
            assert!(parse_azure_timestamp(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn azure_csv_relative_times_and_filters() {
        let (_d, p) = write(
            "a.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n\
             2023-11-16 18:15:46.6805900,374,44\n\
             2023-11-16 18:15:50.9951690,396,109\n\
             2023-11-16 18:15:51.0000000,10,0\n\
             2023-11-16 18:15:52.0000000,20,2000\n",
        );
        let t = load(&p, &Filter::default()).expect("load");
        assert_eq!(t.format, TraceFormat::AzureCsv);
        assert_eq!(t.requests.len(), 3);
        assert_eq!(t.stats.dropped_zero_output, 1);
        assert_eq!(t.requests[0].arrival_ms, Some(0.0));
        assert!((t.requests[1].arrival_ms.expect("ts") - 4314.579).abs() < 1e-3);
        let f = Filter {
            min_output: Some(100),
            limit: Some(1),
        };
        let t = load(&p, &f).expect("load");
        assert_eq!(t.requests.len(), 1);
        assert_eq!(t.requests[0].output_tokens, 109);
    }

    #[test]
    fn bad_rows_name_file_and_line() {
        let (_d, p) = write(
            "bad.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\n2023-11-16 18:15:47,abc,3\n",
        );
        let err = load(&p, &Filter::default()).expect_err("bad row");
        match &err {
            TraceError::BadRow { line, .. } => assert_eq!(*line, 3),
            other => panic!("unexpected {other:?}"),
        }
        assert!(err.to_string().contains("bad.csv:3"), "{err}");

        let (_d, p) = write(
            "bad.jsonl",
            "{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 3, \"hash_ids\": [1]}\n\n{\"timestamp\": 1, \"input_length\": -5}\n",
        );
        match load(&p, &Filter::default()) {
            Err(TraceError::BadRow { line, .. }) => assert_eq!(line, 3),
            other => panic!("unexpected {other:?}"),
        }

        let (_d, p) = write("x.csv", "foo,bar\n1,2\n");
        assert!(matches!(
            load(&p, &Filter::default()),
            Err(TraceError::UnknownFormat { .. })
        ));
        let (_d, p) = write("e.csv", "");
        assert!(matches!(
            load(&p, &Filter::default()),
            Err(TraceError::UnknownFormat { .. })
        ));
        assert!(matches!(
            load(Path::new("/nonexistent/trace.csv"), &Filter::default()),
            Err(TraceError::Io { .. })
        ));
        let (_d, p) = write("short.csv", "num_prefill_tokens,num_decode_tokens\n5\n");
        assert!(matches!(
            load(&p, &Filter::default()),
            Err(TraceError::BadRow { line: 2, .. })
        ));
    }

    #[test]
    fn mooncake_hash_ids_share_hash_when_equal() {
        let (_d, p) = write(
            "m.jsonl",
            "{\"timestamp\": 0, \"input_length\": 1000, \"output_length\": 10, \"hash_ids\": [0, 1]}\n\
             {\"timestamp\": 5, \"input_length\": 1000, \"output_length\": 12, \"hash_ids\": [0, 1]}\n\
             {\"timestamp\": 9, \"input_length\": 1500, \"output_length\": 12, \"hash_ids\": [0, 1, 2]}\n",
        );
        let t = load(&p, &Filter::default()).expect("load");
        assert_eq!(t.format, TraceFormat::MooncakeJsonl);
        let h: Vec<_> = t.requests.iter().map(|r| r.prompt_hash).collect();
        assert_eq!(h[0], h[1]);
        assert_ne!(h[0], h[2]);
        assert_eq!(t.requests[2].arrival_ms, Some(9.0));
        assert_ne!(hash_ids(&[1, 0]), hash_ids(&[0, 1]));
        assert_ne!(hash_ids(&[]), hash_ids(&[0]));
    }

    #[test]
    fn length_and_generic_csv() {
        let (_d, p) = write(
            "s.csv",
            "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n74,918,992,0.08\n290.0,905,1195,0.32\n",
        );
        let t = load(&p, &Filter::default()).expect("load");
        assert_eq!(t.format, TraceFormat::LengthCsv);
        assert_eq!(t.requests[1].prompt_tokens, 290);
        assert!(t.requests.iter().all(|r| r.arrival_ms.is_none()));
        let (_d, p) = write(
            "g.csv",
            "arrival_ms,prompt_tokens,output_tokens,prompt_hash\n0,10,20,7\n1.5,11,21,\n",
        );
        let t = load(&p, &Filter::default()).expect("load");
        assert_eq!(t.format, TraceFormat::GenericCsv);
        assert_eq!(t.requests[0].prompt_hash, Some(7));
        assert_eq!(t.requests[1].prompt_hash, None);
        assert_eq!(t.requests[1].arrival_ms, Some(1.5));
        // a file from before the hints column: no request has a hint
        assert!(t.requests.iter().all(|r| r.expected_output.is_none()));
    }

    #[test]
    fn generic_csv_carries_the_hints_each_request_was_sent_with() {
        let (_d, p) = write(
            "h.csv",
            "arrival_ms,prompt_tokens,output_tokens,prompt_hash,expected_output_tokens\n\
             0,10,20,7,18\n\
             1.5,11,21,,\n\
             2,12,22,,22.0\n",
        );
        let t = load(&p, &Filter::default()).expect("load");
        let hints: Vec<Option<u32>> = t.requests.iter().map(|r| r.expected_output).collect();
        assert_eq!(hints, vec![Some(18), None, Some(22)]);
        // the other columns are read as before
        assert_eq!(t.requests[0].prompt_hash, Some(7));
        assert_eq!(t.requests[2].output_tokens, 22);
    }

    #[test]
    fn generic_csv_carries_each_request_s_class_key_and_its_id() {
        let (_d, p) = write(
            "c.csv",
            "arrival_ms,prompt_tokens,output_tokens,request_class\n\
             0,10,20,chat/tools\n\
             1,11,21,\n\
             2,12,22,\"a,\"\"b\"\n\
             3,13,23,c7\n",
        );
        let t = load(&p, &Filter::default()).expect("load");
        let keys: Vec<Option<&str>> = t
            .requests
            .iter()
            .map(|r| r.class.as_ref().map(Class::key))
            .collect();
        assert_eq!(
            keys,
            vec![Some("chat/tools"), None, Some("a,\"b"), Some("c7")]
        );
        assert_eq!(
            t.requests[0].class_id(),
            Some(br_core::class_id("chat/tools"))
        );
        assert_eq!(t.requests[3].class_id(), Some(br_core::class_id("c7")));
        assert_eq!(t.requests[1].class_id(), None);
        // A file without the column has no classes (the loaders before it existed).
        let (_d, p) = write("n.csv", "prompt_tokens,output_tokens\n10,20\n");
        let t = load(&p, &Filter::default()).expect("load");
        assert!(t.requests.iter().all(|r| r.class.is_none()));
        // and a key survives serde as its key
        let json = serde_json::to_string(&Class::new("c7").expect("key")).expect("json");
        assert_eq!(json, "\"c7\"");
        let back: Class = serde_json::from_str(&json).expect("back");
        assert_eq!(back.id(), br_core::class_id("c7"));
        assert!(serde_json::from_str::<Class>("\"a b\"").is_err());
    }

    #[test]
    fn a_bad_class_key_is_a_bad_row_naming_its_line_and_column() {
        let long = "k".repeat(65);
        for bad in ["a b", "tab\there", "é", long.as_str()] {
            let (_d, p) = write(
                "c.csv",
                &format!(
                    "arrival_ms,prompt_tokens,output_tokens,request_class\n0,10,20,ok\n1,10,20,\"{bad}\"\n"
                ),
            );
            let err = load(&p, &Filter::default()).expect_err(bad);
            match &err {
                TraceError::BadRow { line, msg, .. } => {
                    assert_eq!(*line, 3, "{bad}");
                    assert!(msg.contains("request_class"), "{msg}");
                }
                other => panic!("{bad}: unexpected {other:?}"),
            }
            assert!(err.to_string().contains("c.csv:3"), "{err}");
        }
        // the longest key the contract takes is accepted
        assert!(Class::new(&"k".repeat(64)).is_ok());
        assert!(Class::new("").is_err());
    }

    #[test]
    fn a_malformed_hint_is_a_bad_row_naming_its_line_and_column() {
        for bad in ["x", "-3", "1.5", "0", "NaN", "5000000000"] {
            let (_d, p) = write(
                "h.csv",
                &format!(
                    "arrival_ms,prompt_tokens,output_tokens,expected_output_tokens\n0,10,20,18\n1,10,20,{bad}\n"
                ),
            );
            let err = load(&p, &Filter::default()).expect_err(bad);
            match &err {
                TraceError::BadRow { line, msg, .. } => {
                    assert_eq!(*line, 3, "{bad}");
                    assert!(msg.contains("expected_output_tokens"), "{msg}");
                    assert!(msg.contains(bad), "{msg}");
                }
                other => panic!("{bad}: unexpected {other:?}"),
            }
            assert!(err.to_string().contains("h.csv:3"), "{err}");
        }
    }
}

//! Engine topologies: which DP rank a request runs on, when one engine server serves several.
//!
//! - One API server per rank (vLLM's default with external load balancing): nothing to do;
//!   the shim's `--upstream` is the rank.
//! - One API server for all ranks (vLLM `--data-parallel-size N`): the server picks a rank
//!   itself unless the request names one, and the shim must know which rank ran it (that is
//!   the worker its telemetry reports). `--dp-rank-header X-data-parallel-rank` makes the shim
//!   set that header to its rank on every request it forwards.
//! - SGLang with its DP controller: the rank is a body field; `--dp-rank-field routed_dp_rank`
//!   sets `"routed_dp_rank": <rank>` at the top level of every generation request's JSON body
//!   (`data_parallel_rank` in SGLang releases before the rename).
//! - One shim process for several ranks of one server (`--worker-ids 0-7`): one telemetry
//!   stream per rank, and the rank of a request is the path prefix `/rank/<n>/` (stripped
//!   before forwarding). Each rank announces `<endpoint>/rank/<n>` in its Hello, so the
//!   endpoint `Assign` answers with is a complete base URL (an OpenAI client's `base_url` is
//!   `<endpoint>/v1`) and a gateway needs no code to map a worker id to a header. A header
//!   would need exactly that code in every gateway; a path works with any HTTP proxy.
//!
//! A value the client set for the header or field is replaced: the rank is the shim's, since
//! that is where its telemetry says the request runs.

use std::collections::BTreeMap;

use axum::http::{HeaderMap, HeaderName, HeaderValue};
use bytes::Bytes;
use serde_json::value::RawValue;

/// The path prefix that names a rank: `/rank/<n>/...`.
pub const RANK_PREFIX: &str = "/rank/";

/// The most ranks one shim may serve (one telemetry stream each).
pub const MAX_RANKS_PER_SHIM: usize = 256;

/// How the shim tells the engine which rank a request is for.
#[derive(Debug, Clone, Default)]
pub struct Pin {
    pub rank: u32,
    /// `--dp-rank-header`: set on every forwarded request.
    pub header: Option<HeaderName>,
    /// `--dp-rank-field`: set at the top level of generation bodies.
    pub field: Option<String>,
}

impl Pin {
    /// Whether it pins anything.
    pub fn is_some(&self) -> bool {
        self.header.is_some() || self.field.is_some()
    }

    /// Sets the rank header (replacing any the client sent).
    pub fn apply_header(&self, headers: &mut HeaderMap) {
        if let Some(h) = &self.header {
            headers.insert(h.clone(), HeaderValue::from(self.rank));
        }
    }

    /// The body with the rank field set at its top level (replacing any the client sent);
    /// the other members stay the text they came as. A body that is not a JSON object goes on
    /// as it was (the engine rejects it as it would without the shim).
    pub fn apply_field(&self, raw: Bytes) -> Bytes {
        let Some(field) = &self.field else {
            return raw;
        };
        let Ok(mut top) = serde_json::from_slice::<BTreeMap<String, &RawValue>>(&raw) else {
            return raw;
        };
        let Ok(rank) = serde_json::value::to_raw_value(&self.rank) else {
            return raw;
        };
        top.insert(field.clone(), &rank);
        let mut out = Vec::with_capacity(raw.len() + field.len() + 16);
        match serde_json::to_writer(&mut out, &top) {
            Ok(()) => Bytes::from(out),
            Err(_) => raw,
        }
    }
}

/// Parses `--worker-ids`: ids and ranges, comma-separated (`0-7`, `0,2,4-6`), each at most
/// `max`; sorted, without repeats.
pub fn parse_worker_ids(spec: &str, max: u32) -> Result<Vec<u32>, String> {
    let mut ids = std::collections::BTreeSet::new();
    for part in spec.split(',').map(str::trim) {
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (a.trim(), b.trim()),
            None => (part, part),
        };
        let num = |s: &str| {
            s.parse::<u32>()
                .map_err(|_| format!("--worker-ids {spec:?}: {part:?} is not an id or a range"))
        };
        let (lo, hi) = (num(lo)?, num(hi)?);
        if lo > hi {
            return Err(format!(
                "--worker-ids {spec:?}: the range {part:?} is empty"
            ));
        }
        if hi > max {
            return Err(format!(
                "--worker-ids {spec:?}: {hi} is above the highest worker id {max} (the contract's limit)"
            ));
        }
        ids.extend(lo..=hi);
        if ids.len() > MAX_RANKS_PER_SHIM {
            return Err(format!(
                "--worker-ids {spec:?} names more than {MAX_RANKS_PER_SHIM} ranks"
            ));
        }
    }
    Ok(ids.into_iter().collect())
}

/// The endpoint rank `id` announces when one shim serves several.
pub fn rank_endpoint(base: &str, id: u32) -> String {
    format!("{}{RANK_PREFIX}{id}", base.trim_end_matches('/'))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn worker_ids_are_ids_and_ranges() {
        assert_eq!(parse_worker_ids("0-3", 1023).unwrap(), vec![0, 1, 2, 3]);
        assert_eq!(
            parse_worker_ids("5, 0,2-3,3", 1023).unwrap(),
            vec![0, 2, 3, 5]
        );
        assert_eq!(parse_worker_ids("7", 1023).unwrap(), vec![7]);
        for bad in ["", "a", "3-1", "0-1024", "1,", "-1", "0-300"] {
            assert!(parse_worker_ids(bad, 1023).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_field_is_set_and_every_other_member_kept_as_written() {
        let pin = Pin {
            rank: 5,
            header: None,
            field: Some("routed_dp_rank".into()),
        };
        let raw = Bytes::from_static(
            br#"{"prompt": "caf\u00e9",  "routed_dp_rank": 1, "n": 1e2, "stream": true}"#,
        );
        let out = pin.apply_field(raw);
        let text = std::str::from_utf8(&out).unwrap();
        assert!(text.contains(r#""routed_dp_rank":5"#), "{text}");
        assert!(text.contains(r#""prompt":"caf\u00e9""#), "{text}");
        assert!(text.contains(r#""n":1e2"#), "{text}");
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["routed_dp_rank"], 5);
        // not an object: as it was
        for body in [&b"[1]"[..], b"{\"a\":", b""] {
            assert_eq!(&pin.apply_field(Bytes::copy_from_slice(body))[..], body);
        }
    }

    #[test]
    fn the_header_replaces_the_clients() {
        let pin = Pin {
            rank: 2,
            header: Some(HeaderName::from_static("x-data-parallel-rank")),
            field: None,
        };
        let mut h = HeaderMap::new();
        h.insert("x-data-parallel-rank", HeaderValue::from_static("7"));
        pin.apply_header(&mut h);
        assert_eq!(h.get_all("x-data-parallel-rank").iter().count(), 1);
        assert_eq!(h["x-data-parallel-rank"], "2");
    }

    #[test]
    fn a_rank_endpoint_is_a_base_url() {
        assert_eq!(
            rank_endpoint("http://10.0.0.5:8100/", 3),
            "http://10.0.0.5:8100/rank/3"
        );
    }
}

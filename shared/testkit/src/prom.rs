//! A reader for the Prometheus text exposition format (what `/metrics` serves): every sample
//! with its name, labels and value, and each family's `# TYPE`; plus the metric contract in
//! `deploy/metrics-contract.txt`, so a service's tests check names, types and labels rather
//! than substrings.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

/// One sample line: `name{labels} value`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

impl fmt::Display for Sample {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)?;
        if !self.labels.is_empty() {
            let ls: Vec<String> = self
                .labels
                .iter()
                .map(|(k, v)| format!("{k}={v:?}"))
                .collect();
            write!(f, "{{{}}}", ls.join(","))?;
        }
        write!(f, " {}", self.value)
    }
}

/// A parsed `/metrics` page.
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    pub samples: Vec<Sample>,
    /// Family name -> type, from the `# TYPE` lines.
    pub types: BTreeMap<String, String>,
}

impl Metrics {
    /// Parses the text format; an error names the line.
    pub fn parse(text: &str) -> Result<Metrics, String> {
        let mut m = Metrics::default();
        for (i, line) in text.lines().enumerate() {
            let n = i + 1;
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            if let Some(rest) = line.strip_prefix('#') {
                let mut words = rest.split_whitespace();
                if words.next() == Some("TYPE") {
                    let (Some(name), Some(typ)) = (words.next(), words.next()) else {
                        return Err(format!("line {n}: bad TYPE line {line:?}"));
                    };
                    m.types.insert(name.to_owned(), typ.to_owned());
                }
                continue;
            }
            m.samples
                .push(parse_sample(line).map_err(|e| format!("line {n}: {e}: {line:?}"))?);
        }
        Ok(m)
    }

    /// Every sample named exactly `name`.
    pub fn samples<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a Sample> + 'a {
        self.samples.iter().filter(move |s| s.name == name)
    }

    /// The value of the sample `name` whose labels are exactly `labels`, if there is one.
    pub fn get(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let want: BTreeMap<String, String> = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        self.samples(name)
            .find(|s| s.labels == want)
            .map(|s| s.value)
    }

    /// Like [`Metrics::get`], but the sample must be there.
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.get(name, labels).unwrap_or_else(|| {
            panic!(
                "no sample {name} with labels {labels:?}; {name} has: {:?}",
                self.samples(name)
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
            )
        })
    }

    /// The sum over every label set of `name` (0 if there is no such sample).
    pub fn sum(&self, name: &str) -> f64 {
        self.samples(name).map(|s| s.value).sum()
    }

    /// The label names the samples of `name` carry (the union over its samples).
    pub fn label_names(&self, name: &str) -> BTreeSet<String> {
        self.samples(name)
            .flat_map(|s| s.labels.keys().cloned())
            .collect()
    }

    /// The family's type from its `# TYPE` line.
    pub fn type_of(&self, name: &str) -> Option<&str> {
        self.types.get(name).map(String::as_str)
    }

    /// Checks that every metric the contract lists under `# <service>` is exported (a `# TYPE`
    /// line and at least one sample) with the contract's type, and that each exported sample of a listed family carries the same label
    /// names as the family's other samples. Returns the contract's names for that service (so a
    /// test can check the section is not accidentally empty).
    pub fn assert_contract(&self, service: &str) -> Vec<String> {
        let contract = contract(service);
        assert!(
            !contract.is_empty(),
            "no '# {service}' section in the contract"
        );
        let mut problems = Vec::new();
        for (name, typ) in &contract {
            match (self.type_of(name), typ.as_deref()) {
                (None, _) => problems.push(format!("{name} is not exported (no # TYPE line)")),
                (Some(got), Some(want)) if got != want => {
                    problems.push(format!("{name} is a {got}, the contract says {want}"));
                }
                _ => {}
            }
            let series = if typ.as_deref() == Some("histogram") {
                format!("{name}_count")
            } else {
                name.clone()
            };
            if self.type_of(name).is_some() && self.samples(&series).next().is_none() {
                problems.push(format!("{name} has a # TYPE line but no samples"));
            }
            let sets: BTreeSet<Vec<&String>> = self
                .samples(&series)
                .map(|s| s.labels.keys().collect())
                .collect();
            if sets.len() > 1 {
                problems.push(format!("{series} mixes label sets {sets:?}"));
            }
        }
        assert!(
            problems.is_empty(),
            "metric contract of {service}: {problems:#?}"
        );
        contract.into_iter().map(|(n, _)| n).collect()
    }
}

/// The metric contract's entries for `service`: (name, type if given).
pub fn contract(service: &str) -> Vec<(String, Option<String>)> {
    const TEXT: &str = include_str!("../../../deploy/metrics-contract.txt");
    let mut section = None;
    let mut out = Vec::new();
    for line in TEXT.lines() {
        let line = line.trim();
        if let Some(h) = line.strip_prefix('#') {
            let h = h.trim();
            // A section header is one lowercase word; longer comments are prose.
            if !h.is_empty() && h.chars().all(|c| c.is_ascii_lowercase()) {
                section = Some(h.to_owned());
            }
            continue;
        }
        if line.is_empty() || section.as_deref() != Some(service) {
            continue;
        }
        let mut words = line.split_whitespace();
        let name = words.next().expect("a name").to_owned();
        out.push((name, words.next().map(str::to_owned)));
    }
    out
}

fn parse_sample(line: &str) -> Result<Sample, String> {
    let name_end = line
        .find(|c: char| c == '{' || c.is_whitespace())
        .ok_or("no value")?;
    let name = &line[..name_end];
    if name.is_empty() {
        return Err("no metric name".into());
    }
    let mut rest = &line[name_end..];
    let mut labels = BTreeMap::new();
    if let Some(r) = rest.strip_prefix('{') {
        let mut chars = r.char_indices().peekable();
        loop {
            // label name
            while chars
                .next_if(|(_, c)| *c == ',' || c.is_whitespace())
                .is_some()
            {}
            if let Some((i, '}')) = chars.peek().copied() {
                rest = &r[i + 1..];
                break;
            }
            let mut key = String::new();
            while let Some((_, c)) = chars.next_if(|(_, c)| *c != '=') {
                key.push(c);
            }
            if chars.next().map(|(_, c)| c) != Some('=')
                || chars.next().map(|(_, c)| c) != Some('"')
            {
                return Err(format!("label {key:?} without a quoted value"));
            }
            let mut value = String::new();
            loop {
                match chars.next() {
                    Some((_, '"')) => break,
                    Some((_, '\\')) => match chars.next() {
                        Some((_, 'n')) => value.push('\n'),
                        Some((_, c)) => value.push(c),
                        None => return Err("unterminated escape".into()),
                    },
                    Some((_, c)) => value.push(c),
                    None => return Err("unterminated label value".into()),
                }
            }
            labels.insert(key.trim().to_owned(), value);
        }
    }
    let mut words = rest.split_whitespace();
    let v = words.next().ok_or("no value")?;
    let value = match v {
        "+Inf" | "Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        _ => v.parse().map_err(|_| format!("bad value {v:?}"))?,
    };
    // An optional timestamp may follow; nothing else.
    if words.nth(1).is_some() {
        return Err("trailing text".into());
    }
    Ok(Sample {
        name: name.to_owned(),
        labels,
        value,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: &str = "\
# HELP balanceroute_x_total Things.
# TYPE balanceroute_x_total counter
balanceroute_x_total{code=\"ok\",group=\"g\"} 3
balanceroute_x_total{code=\"dead\\\"line\",group=\"g\"} 1
# TYPE balanceroute_x_ready gauge
balanceroute_x_ready 1
# TYPE balanceroute_x_seconds histogram
balanceroute_x_seconds_bucket{le=\"0.5\"} 2
balanceroute_x_seconds_bucket{le=\"+Inf\"} 4 1700000000000
balanceroute_x_seconds_sum 1.5e0
balanceroute_x_seconds_count 4
";

    #[test]
    fn names_labels_values_and_types() {
        let m = Metrics::parse(PAGE).unwrap();
        assert_eq!(m.samples.len(), 7);
        assert_eq!(
            m.get("balanceroute_x_total", &[("group", "g"), ("code", "ok")]),
            Some(3.0)
        );
        assert_eq!(
            m.get(
                "balanceroute_x_total",
                &[("group", "g"), ("code", "dead\"line")]
            ),
            Some(1.0),
            "escaped quotes in label values"
        );
        assert_eq!(
            m.get("balanceroute_x_total", &[("group", "g")]),
            None,
            "labels match exactly"
        );
        assert_eq!(m.sum("balanceroute_x_total"), 4.0);
        assert_eq!(m.sum("balanceroute_x_absent"), 0.0);
        assert_eq!(m.value("balanceroute_x_ready", &[]), 1.0);
        assert_eq!(
            m.value("balanceroute_x_seconds_bucket", &[("le", "+Inf")]),
            4.0,
            "a timestamp after the value"
        );
        assert_eq!(m.value("balanceroute_x_seconds_sum", &[]), 1.5);
        assert_eq!(m.type_of("balanceroute_x_seconds"), Some("histogram"));
        assert_eq!(
            m.label_names("balanceroute_x_total")
                .into_iter()
                .collect::<Vec<_>>(),
            ["code", "group"]
        );
    }

    #[test]
    fn bad_lines_are_errors_naming_the_line() {
        for bad in ["x{a=1} 2", "x{a=\"1\" 2", "x notanumber", "x", "x 1 2 3"] {
            let err = Metrics::parse(&format!("# TYPE x gauge\n{bad}\n")).unwrap_err();
            assert!(err.starts_with("line 2:"), "{bad}: {err}");
        }
    }

    #[test]
    fn the_contract_has_every_service() {
        for (service, at_least) in [
            ("snapshot", 11),
            ("ingest", 9),
            ("decision", 13),
            ("shim", 5),
        ] {
            let c = contract(service);
            assert!(c.len() >= at_least, "{service}: {c:?}");
            assert!(
                c.iter()
                    .all(|(n, _)| n.starts_with(&format!("balanceroute_{service}_")))
            );
        }
        assert!(contract("nobody").is_empty());
    }

    #[test]
    #[should_panic(expected = "balanceroute_shim_requests_total is not exported")]
    fn a_missing_contract_metric_fails() {
        Metrics::parse("# TYPE balanceroute_shim_active_requests gauge\n")
            .unwrap()
            .assert_contract("shim");
    }

    #[test]
    #[should_panic(expected = "is a gauge, the contract says counter")]
    fn a_wrong_type_fails() {
        Metrics::parse("# TYPE balanceroute_shim_requests_total gauge\n")
            .unwrap()
            .assert_contract("shim");
    }
}

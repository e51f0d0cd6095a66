//! Policy specs on the command line: `name[:key=value]...`, e.g. `br0`, `brh-oracle`,
//! `br0:s_greedy=64:stage1_worker=most-free-slots`, `brh:beta=43:gamma=0.86`.
//!
//! `name` is any name `br-core` accepts (`PolicyKind::from_str`). Each `key=value` sets one
//! field of `PolicyConfig`'s `dispatcher`, `horizon` or `brc` section (or `seed`), by the field's serde
//! name (`-` and `_` are interchangeable in keys). Values are JSON-ish: numbers, `true`/`false`,
//! `none`/`null` (for optional fields such as `s_greedy` and `beta`), anything else a string
//! (the kebab-case enum values of the dispatcher's open choices).

use br_core::{PolicyConfig, PolicyKind};
use serde_json::Value;

/// A parsed policy spec.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicySpec {
    /// The label shown in tables and JSON (the spec as written).
    pub label: String,
    /// The configuration to build the policy from.
    pub config: PolicyConfig,
}

impl PolicySpec {
    /// Whether this is a BalanceRoute policy (not one of today's baselines).
    pub fn is_balance_route(&self) -> bool {
        matches!(
            self.config.kind,
            PolicyKind::Br0 | PolicyKind::Br0Bypass | PolicyKind::BrH(_) | PolicyKind::Brc
        )
    }
}

/// Parses `name[:key=value]...` with the run's seed.
pub fn parse_spec(spec: &str, seed: u64) -> Result<PolicySpec, String> {
    let spec = spec.trim();
    let mut parts = spec.split(':');
    let name = parts.next().unwrap_or_default();
    let kind: PolicyKind = name.parse().map_err(|e| format!("{e}"))?;
    let mut config = PolicyConfig::new(kind);
    config.seed = seed;
    let mut shallow_given = false;
    for kv in parts {
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| format!("policy `{spec}`: expected key=value, got `{kv}`"))?;
        set_param(&mut config, k, v).map_err(|e| format!("policy `{spec}`: {e}"))?;
        shallow_given |= k.trim().replace('-', "_") == "shallow_wait_steps";
    }
    config
        .validate()
        .map_err(|e| format!("policy `{spec}`: {e}"))?;
    if shallow_given {
        config
            .brc
            .validate_given_shallow()
            .map_err(|e| format!("policy `{spec}`: {e}"))?;
    }
    Ok(PolicySpec {
        label: spec.to_string(),
        config,
    })
}

/// Sets one parameter by its serde field name.
pub fn set_param(config: &mut PolicyConfig, key: &str, raw: &str) -> Result<(), String> {
    let key = key.trim().replace('-', "_");
    let value = parse_value(raw.trim());
    let mut v = serde_json::to_value(&*config).map_err(|e| e.to_string())?;
    let mut placed = false;
    let mut known: Vec<String> = vec!["seed".into()];
    for section in ["dispatcher", "horizon", "brc"] {
        if let Some(obj) = v.get_mut(section).and_then(Value::as_object_mut) {
            known.extend(obj.keys().cloned());
            if !placed && obj.contains_key(&key) {
                obj.insert(key.clone(), value.clone());
                placed = true;
            }
        }
    }
    if !placed
        && key == "seed"
        && let Some(obj) = v.as_object_mut()
    {
        obj.insert(key.clone(), value.clone());
        placed = true;
    }
    if !placed {
        return Err(format!(
            "unknown parameter `{key}`; known: {}",
            known.join(", ")
        ));
    }
    *config = serde_json::from_value(v).map_err(|e| format!("{key}={raw}: {e}"))?;
    config.validate().map_err(|e| e.to_string())
}

fn parse_value(raw: &str) -> Value {
    match raw.to_ascii_lowercase().as_str() {
        "none" | "null" => return Value::Null,
        "true" => return Value::Bool(true),
        "false" => return Value::Bool(false),
        _ => {}
    }
    if let Ok(i) = raw.parse::<i64>() {
        return Value::from(i);
    }
    if let Ok(f) = raw.parse::<f64>()
        && f.is_finite()
    {
        return Value::from(f);
    }
    Value::String(raw.to_string())
}

/// Parses `NAME=v1,v2,...` of `sweep --param`.
pub fn parse_sweep_param(raw: &str) -> Result<(String, Vec<String>), String> {
    let (k, vs) = raw
        .split_once('=')
        .ok_or_else(|| format!("--param: expected NAME=v1,v2,..., got `{raw}`"))?;
    let values: Vec<String> = vs
        .split(',')
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .map(String::from)
        .collect();
    if k.trim().is_empty() || values.is_empty() {
        return Err(format!("--param: expected NAME=v1,v2,..., got `{raw}`"));
    }
    Ok((k.trim().to_string(), values))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_params() {
        let s = parse_spec("br0", 7).expect("br0");
        assert_eq!(s.config.kind, PolicyKind::Br0);
        assert_eq!(s.config.seed, 7);
        assert!(s.is_balance_route());
        assert!(!parse_spec("jsq", 0).expect("jsq").is_balance_route());
        let s = parse_spec("br0:s_greedy=64:r-max=2", 0).expect("params");
        assert_eq!(s.config.dispatcher.s_greedy, Some(64));
        assert_eq!(s.config.dispatcher.r_max, 2);
        assert_eq!(s.label, "br0:s_greedy=64:r-max=2");
        let s = parse_spec("brh:beta=43:gamma=0.86:horizon=40:beta=none", 0).expect("brh");
        assert_eq!(s.config.horizon.beta, None);
        assert_eq!(s.config.horizon.gamma, 0.86);
        assert_eq!(s.config.horizon.horizon, 40);
        let s = parse_spec("brc:max_wait_steps=4:wave-fraction=0.5", 0).expect("brc");
        assert_eq!(s.config.kind, PolicyKind::Brc);
        assert!(s.is_balance_route());
        assert_eq!(s.config.brc.max_wait_steps, 4);
        assert_eq!(s.config.brc.wave_fraction, 0.5);
        assert!(s.config.brc.kv_swap);
        let s =
            parse_spec("brc:max_wait_steps=1", 0).expect("a deep budget below the shallow default");
        assert_eq!(s.config.brc.max_wait_steps, 1);
        let s = parse_spec("brc:kv-swap=false", 0).expect("brc without the KV pass");
        assert!(!s.config.brc.kv_swap);
        let s = parse_spec("brc:fill-under=false:fill_slack=2", 0).expect("brc without fill");
        assert!(!s.config.brc.fill_under);
        assert_eq!(s.config.brc.fill_slack, 2.0);
        for bad in [
            "brc:wave_fraction=0",
            "brc:kv_swap=2",
            "brc:kv_swap=maybe",
            "brc:fill_slack=5",
            "brc:fill_under=1",
            "brc:max_wait_steps=-1",
            "brc:max_wait_steps=4:shallow_wait_steps=5",
            "brc:shallow-wait-steps=65",
            "nope",
            "br0:r_max",
            "br0:r_max=0",
            "br0:warp=9",
            "brh:gamma=2",
            "br0:r_max=x",
        ] {
            assert!(parse_spec(bad, 0).is_err(), "{bad}");
        }
    }

    #[test]
    fn sweep_param() {
        let (k, v) = parse_sweep_param("s_greedy=0, 64,none").expect("parse");
        assert_eq!(k, "s_greedy");
        assert_eq!(v, vec!["0", "64", "none"]);
        assert!(parse_sweep_param("s_greedy").is_err());
        assert!(parse_sweep_param("=1").is_err());
        assert!(parse_sweep_param("x=").is_err());
    }
}

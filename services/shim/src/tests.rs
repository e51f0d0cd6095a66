#![allow(clippy::unwrap_used)]

use super::body::plan;
use super::*;

fn plan_of(body: &str) -> (String, bool, Option<bool>) {
    let (out, stream, strip) = plan(&Bytes::copy_from_slice(body.as_bytes()), true);
    (
        String::from_utf8(out.to_vec()).unwrap(),
        stream,
        strip.map(|s| s.all_usage),
    )
}

#[test]
fn injecting_usage_keeps_every_other_value_as_the_client_wrote_it() {
    // whitespace, escapes and number forms a tree would have rewritten
    let messages = r#"[ {"role":"user", "content":"caf\u00e9 \"q\""} , 1.0e3, -0 ]"#;
    let body = format!(r#"{{"messages": {messages}, "stream": true, "n": 1e2}}"#);
    let (out, stream, strip) = plan_of(&body);
    assert!(stream);
    assert_eq!(strip, Some(true), "the client asked for no usage");
    assert!(out.contains(messages), "{out}");
    assert!(out.contains(r#""n":1e2"#), "{out}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["stream_options"]["include_usage"], true);
    assert_eq!(v["stream_options"]["continuous_usage_stats"], true);
}

#[test]
fn the_clients_own_stream_options_are_kept_and_only_the_missing_usage_is_stripped() {
    let (out, _, strip) =
        plan_of(r#"{"stream":true,"stream_options":{"include_usage":true,"x":[1, 2]}}"#);
    assert_eq!(strip, Some(false));
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["stream_options"]["x"], serde_json::json!([1, 2]));
    assert_eq!(v["stream_options"]["continuous_usage_stats"], true);
}

#[test]
fn what_needs_no_change_or_cannot_be_changed_goes_on_byte_for_byte() {
    for (body, stream) in [
        (r#"{"stream":false,"prompt":"a"}"#, false),
        (r#"{"prompt":"a"}"#, false),
        (r#"[1,2]"#, false),
        (r#"{"stream":true,"prompt":"#, false),
        (r#"{"stream":true,"stream_options":"yes"}"#, true),
        (r#"{"stream":true,"stream_options":null}"#, true),
        (
            r#"{"stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":true}}"#,
            true,
        ),
    ] {
        let (out, s, strip) = plan_of(body);
        assert_eq!(out, body);
        assert_eq!(s, stream, "{body}");
        assert_eq!(strip, None, "{body}");
    }
}

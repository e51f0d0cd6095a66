use super::body::{BodySays, estimate, expected_output, max_tokens, parse_body};
use super::wire::{destination_metadata, fresh_request_id, header, http_status};
use super::*;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use serde_json::json;

#[test]
fn endpoints_become_host_port() {
    assert_eq!(
        host_port("http://10.0.0.5:8100").as_deref(),
        Some("10.0.0.5:8100")
    );
    assert_eq!(
        host_port("http://10.0.0.5:8100/v1").as_deref(),
        Some("10.0.0.5:8100")
    );
    assert_eq!(
        host_port("https://10.0.0.5").as_deref(),
        Some("10.0.0.5:443")
    );
    assert_eq!(host_port("http://10.0.0.5").as_deref(), Some("10.0.0.5:80"));
    assert_eq!(host_port("10.0.0.5:9").as_deref(), Some("10.0.0.5:9"));
    assert_eq!(
        host_port("http://[fd00::1]:8100/").as_deref(),
        Some("[fd00::1]:8100")
    );
    assert_eq!(
        host_port("http://[fd00::1]").as_deref(),
        Some("[fd00::1]:80")
    );
    assert_eq!(
        host_port("http://u:p@10.0.0.5:1").as_deref(),
        Some("10.0.0.5:1")
    );
    assert_eq!(host_port(""), None);
    assert_eq!(host_port("http://"), None);
}

#[test]
fn statuses_follow_the_protocol() {
    use tonic::Code;
    assert_eq!(http_status(Code::Unavailable), 503);
    assert_eq!(http_status(Code::DeadlineExceeded), 503);
    assert_eq!(http_status(Code::ResourceExhausted), 429);
    assert_eq!(http_status(Code::InvalidArgument), 400);
    assert_eq!(http_status(Code::NotFound), 404);
    assert_eq!(http_status(Code::Internal), 500);
}

#[test]
fn estimate_counts_text_bytes_over_four_plus_per_message() {
    // 40 bytes -> 10 tokens, plus 4 for the message
    let chat = json!({"messages": [{"role": "user", "content": "a".repeat(40)}]});
    assert_eq!(estimate(&chat), Some(14));
    // parts: only text counts (41 bytes -> 11), two messages
    let parts = json!({"messages": [
        {"role": "system", "content": "abcd"},
        {"role": "user", "content": [
            {"type": "text", "text": "x".repeat(41)},
            {"type": "image_url", "image_url": {"url": "data:..."}}
        ]}
    ]});
    assert_eq!(estimate(&parts), Some(4 + 1 + 4 + 11));
    // completions: a string, strings, token ids (exact)
    assert_eq!(estimate(&json!({"prompt": "12345678"})), Some(2));
    assert_eq!(estimate(&json!({"prompt": ["1234", "12345"]})), Some(1 + 2));
    assert_eq!(estimate(&json!({"prompt": [1, 2, 3, 4, 5]})), Some(5));
    assert_eq!(estimate(&json!({"prompt": [[1, 2], [3]]})), Some(3));
    // an empty prompt still reserves one token; no prompt at all: nothing to go on
    assert_eq!(estimate(&json!({"prompt": ""})), Some(1));
    assert_eq!(estimate(&json!({"model": "m"})), None);
    // multi-byte text counts bytes: 10 CJK characters are 30 bytes -> 8
    assert_eq!(
        estimate(&json!({"prompt": "你好你好你好你好你好"})),
        Some(8)
    );
}

#[test]
fn max_tokens_from_either_name() {
    assert_eq!(max_tokens(&json!({"max_tokens": 64})).unwrap(), Some(64));
    assert_eq!(
        max_tokens(&json!({"max_completion_tokens": 9, "max_tokens": 64})).unwrap(),
        Some(9)
    );
    assert_eq!(max_tokens(&json!({"max_tokens": null})).unwrap(), None);
    assert_eq!(max_tokens(&json!({})).unwrap(), None);
    assert!(max_tokens(&json!({"max_tokens": 0})).is_err());
    assert!(max_tokens(&json!({"max_tokens": -1})).is_err());
    assert!(max_tokens(&json!({"max_tokens": "10"})).is_err());
}

#[test]
fn bodies_that_cannot_be_read_are_bad_input() {
    let e = parse_body(b"not json", true).unwrap_err();
    assert_eq!(e.status(), 400);
    let e = parse_body(br#"{"model": "m"}"#, true).unwrap_err();
    assert_eq!(e.status(), 400);
    // with the header's count, a body without a prompt is fine
    assert_eq!(
        parse_body(br#"{"model": "m", "max_tokens": 5}"#, false).unwrap(),
        BodySays {
            estimated: None,
            max_tokens: Some(5),
            expected_output: None
        }
    );
    let e = parse_body(
        br#"{"prompt": "x", "nvext": {"agent_hints": {"osl": "5"}}}"#,
        true,
    );
    assert_eq!(e.unwrap_err().status(), 400);
}

#[test]
fn expected_output_from_dynamos_agent_hints() {
    let osl = |v: serde_json::Value| expected_output(&json!({"nvext": {"agent_hints": v}}));
    assert_eq!(osl(json!({"osl": 512})).unwrap(), Some(512));
    assert_eq!(osl(json!({"osl": null, "priority": 5})).unwrap(), None);
    assert_eq!(osl(json!({"priority": 5})).unwrap(), None);
    assert_eq!(expected_output(&json!({"max_tokens": 5})).unwrap(), None);
    assert_eq!(expected_output(&json!({"nvext": "x"})).unwrap(), None);
    // the range is Assign's to check: passed on as counts
    assert_eq!(osl(json!({"osl": 0})).unwrap(), Some(0));
    assert_eq!(
        osl(json!({"osl": 5_000_000_000u64})).unwrap(),
        Some(u32::MAX)
    );
    for bad in [
        json!(-1),
        json!(1.5),
        json!("512"),
        json!(true),
        json!([512]),
    ] {
        let e = osl(json!({ "osl": bad })).unwrap_err();
        assert_eq!(e.status(), 400, "{bad}");
        assert!(
            e.message().contains("nvext.agent_hints.osl"),
            "{}",
            e.message()
        );
    }
    assert_eq!(
        parse_body(
            br#"{"prompt": "x", "max_tokens": 9, "nvext": {"agent_hints": {"osl": 7}}}"#,
            false
        )
        .unwrap(),
        BodySays {
            estimated: None,
            max_tokens: Some(9),
            expected_output: Some(7)
        }
    );
}

#[test]
fn the_metadata_is_namespaced_as_the_protocol_says() {
    let md = destination_metadata("10.0.0.5:8100");
    let Some(Kind::StructValue(inner)) = md.fields[DESTINATION_NAMESPACE].kind.clone() else {
        panic!("no envoy.lb struct: {md:?}");
    };
    assert_eq!(
        inner.fields[DESTINATION_ENDPOINT].kind,
        Some(Kind::StringValue("10.0.0.5:8100".into()))
    );
}

#[test]
fn headers_are_read_from_raw_value_or_value() {
    let map = HeaderMap {
        headers: vec![
            HeaderValue {
                key: "x-request-id".into(),
                raw_value: b"abc".to_vec(),
                ..Default::default()
            },
            HeaderValue {
                key: "x-balanceroute-group".into(),
                value: "g".into(),
                ..Default::default()
            },
        ],
    };
    assert_eq!(header(&map, REQUEST_ID_HEADER).as_deref(), Some("abc"));
    assert_eq!(header(&map, GROUP_HEADER).as_deref(), Some("g"));
    assert_eq!(header(&map, PROMPT_TOKENS_HEADER), None);
}

#[test]
fn the_subset_hint_is_read_as_a_list_or_a_string() {
    use envoy_types::pb::google::protobuf::ListValue;
    let md = |v: Kind| Metadata {
        filter_metadata: [(
            SUBSET_NAMESPACE.to_owned(),
            Struct {
                fields: [(SUBSET_KEY.to_owned(), Value { kind: Some(v) })]
                    .into_iter()
                    .collect(),
            },
        )]
        .into_iter()
        .collect(),
        ..Default::default()
    };
    let s = |x: &str| Value {
        kind: Some(Kind::StringValue(x.into())),
    };
    let list = md(Kind::ListValue(ListValue {
        values: vec![s("10.0.0.1:8100"), s("10.0.0.2:8100")],
    }));
    assert_eq!(
        subset_hint(&list),
        Some(vec!["10.0.0.1:8100".to_owned(), "10.0.0.2:8100".to_owned()])
    );
    let string = md(Kind::StringValue("10.0.0.1:8100, 10.0.0.3:8100".into()));
    assert_eq!(
        subset_hint(&string),
        Some(vec!["10.0.0.1:8100".to_owned(), "10.0.0.3:8100".to_owned()])
    );
    assert_eq!(subset_hint(&md(Kind::BoolValue(true))), Some(vec![]));
    assert_eq!(subset_hint(&Metadata::default()), None);
}

#[test]
fn fresh_ids_are_distinct_and_valid_request_ids() {
    let a = fresh_request_id();
    assert_ne!(a, fresh_request_id());
    assert!(a.len() <= 256 && !a.chars().any(char::is_control));
}

#[test]
fn a_request_id_is_held_by_one_stream_at_a_time() {
    let claims = claims::Claims::default();
    let first = claims.claim("g", "r-1").expect("a free id");
    assert!(claims.claim("g", "r-1").is_none(), "held by the first");
    let other_group = claims.claim("h", "r-1").expect("ids are per group");
    let other_id = claims.claim("g", "r-2").expect("another id");
    assert_eq!(claims.len(), 3);
    drop(first);
    let again = claims
        .claim("g", "r-1")
        .expect("free once the first let go");
    drop((again, other_group, other_id));
    assert_eq!(claims.len(), 0);
}

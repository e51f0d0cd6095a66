use super::error::{code_name, http_status};
use super::*;

fn parse(json: &str) -> Result<v1::AssignRequest, String> {
    serde_json::from_str::<AssignJson>(json)
        .map(AssignJson::into_proto)
        .map_err(|e| e.to_string())
}

#[test]
fn assign_json_takes_proto3_json_forms() {
    let r = parse(
        r#"{"group":"g","request_id":"r1","prompt_tokens":100,"prompt_hash":"18446744073709551615","max_tokens":"64"}"#,
    )
    .unwrap();
    assert_eq!(r.group, "g");
    assert_eq!(r.request_id, "r1");
    assert_eq!(r.prompt_tokens, 100);
    assert_eq!(
        r.prompt_hash,
        Some(u64::MAX),
        "a u64 beyond 2^53 as a string"
    );
    assert_eq!(r.max_tokens, Some(64));
    // lowerCamelCase, a number hash, exponent form, nulls for unset
    let r = parse(
        r#"{"group":"g","requestId":"r2","promptTokens":1e2,"promptHash":7,"maxTokens":null}"#,
    )
    .unwrap();
    assert_eq!(
        (r.request_id.as_str(), r.prompt_tokens, r.prompt_hash),
        ("r2", 100, Some(7))
    );
    assert_eq!(r.max_tokens, None);
    // the output-length hints, in both spellings; null is unset
    let r = parse(
        r#"{"group":"g","request_id":"r3","prompt_tokens":1,"expected_output_tokens":"300","request_class":"chat"}"#,
    )
    .unwrap();
    assert_eq!(
        (r.expected_output_tokens, r.request_class.as_deref()),
        (Some(300), Some("chat"))
    );
    let r = parse(r#"{"expectedOutputTokens":3e2,"requestClass":"tenant-7/tools"}"#).unwrap();
    assert_eq!(
        (r.expected_output_tokens, r.request_class.as_deref()),
        (Some(300), Some("tenant-7/tools"))
    );
    let r = parse(r#"{"expected_output_tokens":null,"request_class":null}"#).unwrap();
    assert_eq!((r.expected_output_tokens, r.request_class), (None, None));
    // absent fields are proto3 defaults (validation, not parsing, refuses them)
    let r = parse("{}").unwrap();
    assert_eq!(r, v1::AssignRequest::default());
}

#[test]
fn assign_json_refuses_what_is_not_the_message() {
    for bad in [
        r#"{"group":"g","request_id":"r","prompt_tokens":-1}"#,
        r#"{"group":"g","request_id":"r","prompt_tokens":1.5}"#,
        r#"{"group":"g","request_id":"r","prompt_tokens":4294967296}"#,
        r#"{"group":"g","request_id":"r","prompt_hash":"0x10"}"#,
        r#"{"group":"g","request_id":"r","prompt_hash":"18446744073709551616"}"#,
        r#"{"group":"g","request_id":"r","prompt_tokens":true}"#,
        r#"{"group":"g","request_id":"r","prompt_token":10}"#,
        r#"{"group":"g","request_id":"r","expected_output_tokens":-1}"#,
        r#"{"group":"g","request_id":"r","expected_output_tokens":4294967296}"#,
        r#"{"group":"g","request_id":"r","expected_output_tokens":"many"}"#,
        r#"{"group":"g","request_id":"r","request_class":7}"#,
        r#"{"group":"g","request_id":"r","request_class":["chat"]}"#,
        r#"{"group":"g","request_id":"r","expected_output":10}"#,
        r#"{"group":1}"#,
        r#"[1,2]"#,
        r#"{"group":"g""#,
        "",
    ] {
        assert!(parse(bad).is_err(), "{bad}");
    }
}

#[test]
fn every_code_has_grpc_gateways_status() {
    use tonic::Code::*;
    let want = [
        (Ok, 200),
        (Cancelled, 499),
        (Unknown, 500),
        (InvalidArgument, 400),
        (DeadlineExceeded, 504),
        (NotFound, 404),
        (AlreadyExists, 409),
        (PermissionDenied, 403),
        (ResourceExhausted, 429),
        (FailedPrecondition, 400),
        (Aborted, 409),
        (OutOfRange, 400),
        (Unimplemented, 501),
        (Internal, 500),
        (Unavailable, 503),
        (DataLoss, 500),
        (Unauthenticated, 401),
    ];
    for (code, status) in want {
        assert_eq!(http_status(code).as_u16(), status, "{code:?}");
    }
    assert_eq!(code_name(InvalidArgument), "INVALID_ARGUMENT");
    assert_eq!(code_name(Cancelled), "CANCELLED");
}

#[test]
fn deadlines_from_either_header_the_shorter_wins() {
    let h = |pairs: &[(&'static str, &'static str)]| {
        let mut m = HeaderMap::new();
        for (k, v) in pairs {
            m.insert(*k, v.parse().unwrap());
        }
        deadline_of(&m)
    };
    assert_eq!(h(&[]).unwrap(), None);
    assert_eq!(
        h(&[("grpc-timeout", "250m")]).unwrap(),
        Some(Duration::from_millis(250))
    );
    assert_eq!(
        h(&[("x-request-timeout", "2s")]).unwrap(),
        Some(Duration::from_secs(2))
    );
    assert_eq!(
        h(&[("x-request-timeout", "2s"), ("grpc-timeout", "100m")]).unwrap(),
        Some(Duration::from_millis(100))
    );
    for bad in [("grpc-timeout", "soon"), ("x-request-timeout", "5")] {
        let e = h(&[bad]).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST, "{bad:?}");
    }
}

#[test]
fn grpc_timeout_text_round_trips() {
    for d in [
        Duration::from_nanos(1),
        Duration::from_micros(1500),
        Duration::from_millis(250),
        Duration::from_secs(30),
        Duration::from_secs(200_000),
        Duration::from_secs(400_000_000),
    ] {
        let text = format_grpc_timeout(d);
        let back = parse_grpc_timeout(&text).unwrap();
        assert!(back <= d, "{d:?} -> {text} -> {back:?}");
        // the finest unit that fits: nothing below a second is lost
        assert!(d - back < Duration::from_secs(3600), "{d:?} -> {text}");
    }
    assert_eq!(format_grpc_timeout(Duration::from_millis(250)), "250000u");
    assert_eq!(format_grpc_timeout(Duration::from_secs(30)), "30000000u");
}

use super::*;

fn assign() -> v1::AssignRequest {
    v1::AssignRequest {
        group: "g0".into(),
        request_id: "req-1".into(),
        prompt_tokens: 100,
        prompt_hash: Some(42),
        max_tokens: Some(1024),
        expected_output_tokens: Some(300),
        request_class: Some("chat/tools".into()),
    }
}

fn hello() -> v1::Hello {
    v1::Hello {
        group: "g0".into(),
        worker_id: 3,
        incarnation: 0xdead_beef,
        capacity: 256,
        endpoint: "http://127.0.0.1:8000".into(),
    }
}

fn rp(id: &str, gen_tokens: u32) -> v1::RequestProgress {
    v1::RequestProgress {
        request_id: id.into(),
        prompt_tokens: 10,
        generated_tokens: gen_tokens,
        finished: false,
        unkeyed: false,
    }
}

fn reservation(id: &str) -> v1::Reservation {
    v1::Reservation {
        request_id: id.into(),
        worker_id: 1,
        incarnation: 7,
        prompt_tokens: 5,
        prompt_hash: None,
        max_tokens: None,
        queue_if_full: false,
        expected_output_tokens: None,
        request_class_id: None,
    }
}

fn out_of_range(field: &'static str, value: u64, min: u64, max: u64) -> ValidationError {
    ValidationError::OutOfRange {
        field,
        value,
        min,
        max,
    }
}

#[test]
fn valid_assign_passes_through() {
    let v = ValidAssign::try_from(assign()).expect("valid");
    assert_eq!(v.group.as_str(), "g0");
    assert_eq!(v.request_id.as_str(), "req-1");
    assert_eq!(v.prompt_tokens, 100);
    assert_eq!(v.prompt_hash, Some(42));
    assert_eq!(v.max_tokens, Some(1024));
    assert_eq!(v.expected_output_tokens, Some(300));
    let class = v.request_class.expect("a class");
    assert_eq!(class.as_str(), "chat/tools");
    assert_eq!(class.id(), class_id("chat/tools"));
}

#[test]
fn group_rules() {
    let mut m = assign();
    m.group = String::new();
    assert_eq!(
        ValidAssign::try_from(m).unwrap_err(),
        ValidationError::Empty { field: "group" }
    );
    let mut m = assign();
    m.group = "g".repeat(MAX_GROUP_BYTES);
    assert!(ValidAssign::try_from(m).is_ok(), "128 bytes is allowed");
    let mut m = assign();
    m.group = "g".repeat(MAX_GROUP_BYTES + 1);
    assert_eq!(
        ValidAssign::try_from(m).unwrap_err(),
        ValidationError::TooLong {
            field: "group",
            len: 129,
            max: 128
        }
    );
    let mut m = assign();
    m.group = "g\n0".into();
    assert_eq!(
        ValidAssign::try_from(m).unwrap_err(),
        ValidationError::ControlCharacter { field: "group" }
    );
}

#[test]
fn request_id_rules() {
    let mut m = assign();
    m.request_id = String::new();
    assert_eq!(
        ValidAssign::try_from(m).unwrap_err(),
        ValidationError::Empty {
            field: "request_id"
        }
    );
    let mut m = assign();
    m.request_id = "é".repeat(128); // 256 bytes
    assert!(ValidAssign::try_from(m).is_ok());
    let mut m = assign();
    m.request_id = "x".repeat(MAX_ID_BYTES + 1);
    assert_eq!(
        ValidAssign::try_from(m).unwrap_err(),
        ValidationError::TooLong {
            field: "request_id",
            len: 257,
            max: 256
        }
    );
    let mut m = assign();
    m.request_id = "a\u{7f}b".into();
    assert_eq!(
        ValidAssign::try_from(m).unwrap_err(),
        ValidationError::ControlCharacter {
            field: "request_id"
        }
    );
}

#[test]
fn assign_token_rules() {
    let mut m = assign();
    m.prompt_tokens = 0;
    assert_eq!(
        ValidAssign::try_from(m).unwrap_err(),
        out_of_range("prompt_tokens", 0, 1, 10_000_000)
    );
    let mut m = assign();
    m.prompt_tokens = 10_000_000;
    assert!(ValidAssign::try_from(m).is_ok());
    let mut m = assign();
    m.prompt_tokens = 10_000_001;
    assert_eq!(
        ValidAssign::try_from(m).unwrap_err(),
        out_of_range("prompt_tokens", 10_000_001, 1, 10_000_000)
    );
    let mut m = assign();
    m.max_tokens = Some(0);
    assert_eq!(
        ValidAssign::try_from(m).unwrap_err(),
        out_of_range("max_tokens", 0, 1, 10_000_000)
    );
    let mut m = assign();
    m.max_tokens = Some(10_000_001);
    assert!(ValidAssign::try_from(m).is_err());
    let mut m = assign();
    m.max_tokens = None;
    m.prompt_hash = None;
    let v = ValidAssign::try_from(m).expect("optional fields may be unset");
    assert_eq!((v.max_tokens, v.prompt_hash), (None, None));
}

#[test]
fn assign_expected_output_rules() {
    let with = |expected: Option<u32>, max: Option<u32>| {
        let mut m = assign();
        m.expected_output_tokens = expected;
        m.max_tokens = max;
        ValidAssign::try_from(m)
    };
    assert_eq!(
        with(Some(0), None).unwrap_err(),
        out_of_range("expected_output_tokens", 0, 1, 10_000_000)
    );
    assert_eq!(
        with(Some(10_000_001), None).unwrap_err(),
        out_of_range("expected_output_tokens", 10_000_001, 1, 10_000_000)
    );
    let above = with(Some(65), Some(64)).unwrap_err();
    assert_eq!(
        above,
        ValidationError::Exceeds {
            field: "expected_output_tokens",
            value: 65,
            limit_field: "max_tokens",
            limit: 64,
        }
    );
    assert_eq!(
        above.to_string(),
        "expected_output_tokens is 65, above max_tokens 64"
    );
    assert_eq!(above.reason_label(), "exceeds");
    let status = tonic::Status::from(above);
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    // the bounds themselves are taken
    assert_eq!(
        with(Some(64), Some(64)).unwrap().expected_output_tokens,
        Some(64)
    );
    assert_eq!(
        with(Some(10_000_000), None).unwrap().expected_output_tokens,
        Some(10_000_000)
    );
    assert_eq!(
        with(Some(1), Some(1)).unwrap().expected_output_tokens,
        Some(1)
    );
    assert_eq!(with(None, Some(5)).unwrap().expected_output_tokens, None);
    // a bad max_tokens is reported as itself, not as the hint's bound
    assert_eq!(
        with(Some(5), Some(0)).unwrap_err(),
        out_of_range("max_tokens", 0, 1, 10_000_000)
    );
}

#[test]
fn assign_request_class_rules() {
    let with = |class: &str| {
        let mut m = assign();
        m.request_class = Some(class.into());
        ValidAssign::try_from(m)
    };
    assert_eq!(
        with("").unwrap_err(),
        ValidationError::Empty {
            field: "request_class"
        }
    );
    assert_eq!(
        with(&"c".repeat(65)).unwrap_err(),
        ValidationError::TooLong {
            field: "request_class",
            len: 65,
            max: 64
        }
    );
    assert_eq!(
        with("a\tb").unwrap_err(),
        ValidationError::ControlCharacter {
            field: "request_class"
        }
    );
    for (bad, found) in [
        ("tenant 7", ' '),
        ("thinking-é", 'é'),
        ("x\u{a0}", '\u{a0}'),
    ] {
        let e = with(bad).unwrap_err();
        assert_eq!(
            e,
            ValidationError::Charset {
                field: "request_class",
                found,
                allowed: "printable ASCII without spaces (0x21..=0x7E)",
            },
            "{bad:?}"
        );
        assert_eq!(e.reason_label(), "charset");
        assert_eq!(tonic::Status::from(e).code(), tonic::Code::InvalidArgument);
    }
    assert_eq!(
        with("tenant 7").unwrap_err().to_string(),
        "request_class contains ' ', it takes only printable ASCII without spaces (0x21..=0x7E)"
    );
    // every printable character but the space, 64 bytes long, is a key
    let all: String = ('!'..='~').take(64).collect();
    assert_eq!(with(&all).unwrap().request_class.unwrap().as_str(), all);
    assert!(with("~").is_ok());
}

#[test]
fn class_ids_are_fnv1a_64() {
    // FNV-1a's published test vectors (the empty string is the offset basis).
    assert_eq!(class_id(""), 0xcbf2_9ce4_8422_2325);
    assert_eq!(class_id("a"), 0xaf63_dc4c_8601_ec8c);
    assert_eq!(class_id("foobar"), 0x8594_4171_f739_67e8);
    assert_ne!(class_id("chat"), class_id("chat2"));
}

#[test]
fn a_validated_key_s_id_is_br_core_s() {
    // σ's ids are compared across crates (the decision service, the simulator, the emulator's
    // gateway): a key validated here must name the class br-core computes for it.
    for key in ["chat/tools", "c0", "c255", "~"] {
        let class = RequestClass::new(key).unwrap();
        assert_eq!(class.id(), br_core::class_id(key), "{key}");
    }
    assert_eq!(class_id("foobar"), br_core::class_id("foobar"));
}

#[test]
fn cancel_rules() {
    let ok = v1::CancelRequest {
        group: "g".into(),
        request_id: "r".into(),
    };
    assert!(ValidCancel::try_from(ok.clone()).is_ok());
    let mut m = ok.clone();
    m.request_id.clear();
    assert!(matches!(
        ValidCancel::try_from(m),
        Err(ValidationError::Empty {
            field: "request_id"
        })
    ));
    let mut m = ok;
    m.group.clear();
    assert!(matches!(
        ValidCancel::try_from(m),
        Err(ValidationError::Empty { field: "group" })
    ));
}

#[test]
fn hello_rules() {
    let v = ValidHello::try_from(hello()).expect("valid");
    assert_eq!((v.worker_id, v.capacity), (3, 256));

    let mut m = hello();
    m.incarnation = 0;
    assert_eq!(
        ValidHello::try_from(m).unwrap_err(),
        out_of_range("incarnation", 0, 1, u64::MAX)
    );
    let mut m = hello();
    m.capacity = 0;
    assert_eq!(
        ValidHello::try_from(m).unwrap_err(),
        out_of_range("capacity", 0, 1, 65_536)
    );
    let mut m = hello();
    m.capacity = 65_537;
    assert!(ValidHello::try_from(m).is_err());
    let mut m = hello();
    m.worker_id = 1_024;
    assert_eq!(
        ValidHello::try_from(m).unwrap_err(),
        out_of_range("worker_id", 1_024, 0, 1_023)
    );
    let mut m = hello();
    m.endpoint = String::new();
    assert!(ValidHello::try_from(m).is_ok(), "endpoint may be empty");
    let mut m = hello();
    m.endpoint = "h".repeat(513);
    assert_eq!(
        ValidHello::try_from(m).unwrap_err(),
        ValidationError::TooLong {
            field: "endpoint",
            len: 513,
            max: 512
        }
    );
    let mut m = hello();
    m.group = String::new();
    assert!(ValidHello::try_from(m).is_err());
}

#[test]
fn progress_rules() {
    let ok = v1::Progress {
        seq: 1,
        updates: vec![rp("a", 0), rp("b", 10_000_000)],
        full_state: true,
        traceparent: String::new(),
        tracestate: String::new(),
    };
    let v = ValidProgress::try_from(ok.clone()).expect("valid");
    assert_eq!(v.updates.len(), 2);
    assert!(v.full_state);

    let mut m = ok.clone();
    m.seq = 0;
    assert_eq!(
        ValidProgress::try_from(m).unwrap_err(),
        out_of_range("seq", 0, 1, u64::MAX)
    );

    let mut m = ok.clone();
    m.updates[1].generated_tokens = 10_000_001;
    let err = ValidProgress::try_from(m).unwrap_err();
    assert_eq!(
        err,
        ValidationError::Item {
            field: "updates",
            index: 1,
            source: Box::new(out_of_range("generated_tokens", 10_000_001, 0, 10_000_000)),
        }
    );
    assert_eq!(
        err.to_string(),
        "updates[1]: generated_tokens is 10000001, it must be in 0..=10000000"
    );
    assert_eq!(err.reason_label(), "out_of_range");

    let mut m = ok.clone();
    m.updates[0].prompt_tokens = 10_000_001;
    assert!(ValidProgress::try_from(m).is_err());
    let mut m = ok.clone();
    m.updates[0].prompt_tokens = 0;
    assert!(
        ValidProgress::try_from(m).is_ok(),
        "0 prompt tokens = unknown"
    );

    let mut m = ok.clone();
    m.updates[0].request_id = String::new();
    assert!(matches!(
        ValidProgress::try_from(m),
        Err(ValidationError::Item { index: 0, .. })
    ));

    let mut m = ok.clone();
    m.updates.push(rp("a", 5));
    assert_eq!(
        ValidProgress::try_from(m).unwrap_err(),
        ValidationError::Duplicate {
            field: "updates",
            request_id: "a".into()
        }
    );

    let mut m = ok;
    m.updates = (0..=MAX_UPDATES_PER_PROGRESS)
        .map(|i| rp(&i.to_string(), 1))
        .collect();
    assert_eq!(
        ValidProgress::try_from(m).unwrap_err(),
        ValidationError::TooMany {
            field: "updates",
            count: 16_385,
            max: 16_384
        }
    );

    let empty = v1::Progress {
        seq: 9,
        updates: vec![],
        full_state: true,
        traceparent: String::new(),
        tracestate: String::new(),
    };
    assert!(
        ValidProgress::try_from(empty).is_ok(),
        "an idle worker's full state is empty"
    );
}

#[test]
fn report_rules() {
    let r = v1::WorkerReport { kind: None };
    assert_eq!(
        ValidReport::try_from(r).unwrap_err(),
        ValidationError::Missing {
            field: "WorkerReport.kind"
        }
    );
    let r = v1::WorkerReport {
        kind: Some(v1::worker_report::Kind::Heartbeat(v1::Heartbeat { seq: 4 })),
    };
    assert_eq!(ValidReport::try_from(r).expect("valid").seq(), Some(4));
    let r = v1::WorkerReport {
        kind: Some(v1::worker_report::Kind::Heartbeat(v1::Heartbeat { seq: 0 })),
    };
    assert!(ValidReport::try_from(r).is_err());
    let r = v1::WorkerReport {
        kind: Some(v1::worker_report::Kind::Hello(hello())),
    };
    assert_eq!(ValidReport::try_from(r).expect("valid").seq(), None);
}

#[test]
fn watch_rules() {
    let m = v1::WatchRequest {
        group: "g".into(),
        epoch: 0,
        last_version: 0,
    };
    assert!(ValidWatch::try_from(m).is_ok());
    let m = v1::WatchRequest {
        group: String::new(),
        epoch: 1,
        last_version: 2,
    };
    assert!(ValidWatch::try_from(m).is_err());
}

#[test]
fn reserve_rules() {
    let ok = v1::ReserveRequest {
        group: "g".into(),
        reservations: vec![reservation("a"), reservation("b")],
    };
    assert_eq!(
        ValidReserve::try_from(ok.clone())
            .expect("valid")
            .reservations
            .len(),
        2
    );
    let mut m = ok.clone();
    m.reservations[1].incarnation = 0;
    assert!(matches!(
        ValidReserve::try_from(m),
        Err(ValidationError::Item { index: 1, .. })
    ));
    let mut m = ok.clone();
    m.reservations[0].prompt_tokens = 0;
    assert!(ValidReserve::try_from(m).is_err());
    let mut m = ok.clone();
    m.reservations[0].worker_id = MAX_WORKER_ID + 1;
    assert!(ValidReserve::try_from(m).is_err());
    // the hints travel as Assign took them: the expected output in range and within
    // max_tokens, the class id any value
    let mut m = ok.clone();
    m.reservations[0].expected_output_tokens = Some(0);
    assert!(ValidReserve::try_from(m).is_err());
    let mut m = ok.clone();
    m.reservations[0].max_tokens = Some(10);
    m.reservations[0].expected_output_tokens = Some(11);
    assert!(matches!(
        ValidReserve::try_from(m),
        Err(ValidationError::Item { index: 0, source, .. }) if source.reason_label() == "exceeds"
    ));
    let mut m = ok.clone();
    m.reservations[0].max_tokens = Some(10);
    m.reservations[0].expected_output_tokens = Some(10);
    m.reservations[0].request_class_id = Some(u64::MAX);
    let r = &ValidReserve::try_from(m).expect("valid").reservations[0];
    assert_eq!(
        (r.expected_output_tokens, r.request_class_id),
        (Some(10), Some(u64::MAX))
    );
    let mut m = ok;
    m.reservations.push(reservation("a"));
    assert!(matches!(
        ValidReserve::try_from(m),
        Err(ValidationError::Duplicate { .. })
    ));
}

#[test]
fn release_rules() {
    let m = v1::ReleaseRequest {
        group: "g".into(),
        request_ids: vec!["a".into(), "b".into()],
    };
    assert_eq!(
        ValidRelease::try_from(m).expect("valid").request_ids.len(),
        2
    );
    let m = v1::ReleaseRequest {
        group: "g".into(),
        request_ids: vec!["a".into(), String::new()],
    };
    assert!(ValidRelease::try_from(m).is_err());
    let m = v1::ReleaseRequest {
        group: "g".into(),
        request_ids: vec!["a".into(), "a".into()],
    };
    assert!(ValidRelease::try_from(m).is_err());
}

#[test]
fn set_cordon_rules() {
    let m = v1::SetCordonRequest {
        group: "g".into(),
        worker_id: MAX_WORKER_ID,
        cordoned: true,
    };
    let v = ValidSetCordon::try_from(m).expect("valid");
    assert_eq!((v.worker_id, v.cordoned), (MAX_WORKER_ID, true));
    let m = v1::SetCordonRequest {
        group: "g".into(),
        worker_id: MAX_WORKER_ID + 1,
        cordoned: true,
    };
    assert!(ValidSetCordon::try_from(m).is_err());
    let m = v1::SetCordonRequest {
        group: String::new(),
        worker_id: 0,
        cordoned: false,
    };
    assert!(ValidSetCordon::try_from(m).is_err());
}

#[test]
fn telemetry_change_rules() {
    use v1::telemetry_change::{
        Kind, RequestProgress, WorkerDisconnected, WorkerHello, WorkerSync,
    };
    let change = |k| v1::TelemetryChange { kind: Some(k) };

    let hello = WorkerHello {
        worker_id: 2,
        incarnation: 9,
        capacity: 64,
        endpoint: String::new(),
    };
    let v = ValidTelemetryChange::try_from(change(Kind::WorkerHello(hello.clone()))).unwrap();
    assert_eq!((v.worker_id(), v.incarnation()), (2, 9));
    let mut h = hello.clone();
    h.capacity = 0;
    assert!(ValidTelemetryChange::try_from(change(Kind::WorkerHello(h))).is_err());
    let mut h = hello;
    h.incarnation = 0;
    assert!(ValidTelemetryChange::try_from(change(Kind::WorkerHello(h))).is_err());

    let d = WorkerDisconnected {
        worker_id: 70_000,
        incarnation: 1,
        disconnected_at_unix_ms: 5,
    };
    assert_eq!(
        ValidTelemetryChange::try_from(change(Kind::WorkerDisconnected(d))).unwrap_err(),
        out_of_range("worker_id", 70_000, 0, 1_023)
    );

    let p = RequestProgress {
        worker_id: 1,
        incarnation: 1,
        request_id: "r".into(),
        prompt_tokens: 0,
        generated_tokens: 3,
        finished: true,
        unkeyed: false,
    };
    let v = ValidTelemetryChange::try_from(change(Kind::RequestProgress(p.clone()))).unwrap();
    assert!(matches!(
        v,
        ValidTelemetryChange::RequestProgress { ref progress, .. }
            if progress.finished && progress.generated_tokens == 3
    ));
    let mut bad = p;
    bad.generated_tokens = MAX_TOKENS + 1;
    assert!(ValidTelemetryChange::try_from(change(Kind::RequestProgress(bad))).is_err());

    let s = WorkerSync {
        worker_id: 1,
        incarnation: 1,
        request_ids: vec!["a".into(), "a".into()],
    };
    assert!(matches!(
        ValidTelemetryChange::try_from(change(Kind::WorkerSync(s))),
        Err(ValidationError::Duplicate { .. })
    ));
    let s = WorkerSync {
        worker_id: 1,
        incarnation: 1,
        request_ids: vec![],
    };
    assert!(ValidTelemetryChange::try_from(change(Kind::WorkerSync(s))).is_ok());

    assert_eq!(
        ValidTelemetryChange::try_from(v1::TelemetryChange { kind: None }).unwrap_err(),
        ValidationError::Missing {
            field: "TelemetryChange.kind"
        }
    );
}

#[test]
fn maps_to_invalid_argument() {
    let mut m = assign();
    m.prompt_tokens = 0;
    let status: tonic::Status = ValidAssign::try_from(m).unwrap_err().into();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert_eq!(
        status.message(),
        "prompt_tokens is 0, it must be in 1..=10000000"
    );
}

#[test]
fn ids_are_usable_as_map_keys_by_str() {
    let mut set = std::collections::HashSet::new();
    set.insert(RequestId::new("r1").expect("valid"));
    assert!(set.contains("r1"));
    assert_eq!(format!("{:?}", GroupId::new("g").expect("valid")), "\"g\"");
}

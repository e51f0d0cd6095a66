#![allow(clippy::unwrap_used)] // tests may panic on purpose

use super::*;

fn header(len: u32) -> Vec<u8> {
    let mut h = vec![0u8];
    h.extend_from_slice(&len.to_be_bytes());
    h
}

#[test]
fn a_message_whole_in_one_chunk_leaves_nothing_unfinished() {
    let mut f = Framing::default();
    let mut chunk = header(3);
    chunk.extend_from_slice(b"abc");
    chunk.extend(header(0));
    chunk.extend(header(1));
    chunk.push(b'z');
    assert_eq!(f.read(&chunk, None).ok(), Some(0));
}

#[test]
fn an_unfinished_message_is_its_declared_length_until_its_last_byte() {
    let mut f = Framing::default();
    let mut chunk = header(10);
    chunk.extend_from_slice(b"abcd");
    assert_eq!(f.read(&chunk, None).ok(), Some(10 + HEADER_BYTES));
    assert_eq!(f.read(b"efg", None).ok(), Some(10 + HEADER_BYTES));
    // the last bytes, and the first two of the next header (a length not known yet)
    let mut chunk = b"hij".to_vec();
    chunk.extend_from_slice(&header(7)[..2]);
    assert_eq!(f.read(&chunk, None).ok(), Some(0));
    // the rest of that header and one byte of its body
    let mut chunk = header(7)[2..].to_vec();
    chunk.push(b'x');
    assert_eq!(f.read(&chunk, None).ok(), Some(7 + HEADER_BYTES));
}

#[test]
fn a_header_above_the_methods_limit_is_refused_before_its_body() {
    let mut f = Framing::default();
    let Err(TooLarge { len, limit }) = f.read(&header(5000), Some(4096)) else {
        panic!("a 5000-byte message under a 4096-byte limit was let through");
    };
    assert_eq!((len, limit), (5000, 4096));
    assert_eq!(
        Framing::default().read(&header(4096), Some(4096)).ok(),
        Some(4101)
    );
}

#[test]
fn limits_by_method_then_by_service() {
    let limits = MessageLimits::every_port();
    assert_eq!(limits.limit("/grpc.health.v1.Health/Check"), Some(4 << 10));
    assert_eq!(
        limits.limit("/balanceroute.v1.Snapshot/Get"),
        Some(64 << 10)
    );
    assert_eq!(
        limits.limit("/balanceroute.v1.Decision/Assign"),
        Some(64 << 10)
    );
    // the service's own (tonic) limit alone
    assert_eq!(limits.limit("/balanceroute.v1.Snapshot/Apply"), None);
    assert_eq!(limits.limit("/balanceroute.v1.Telemetry/Report"), None);
    let limits = limits.with_method("balanceroute.v1.Decision", "Assign", 9);
    assert_eq!(limits.limit("/balanceroute.v1.Decision/Assign"), Some(9));
    assert_eq!(
        limits.limit("/balanceroute.v1.Decision/Cancel"),
        Some(64 << 10)
    );
}

#[test]
fn the_budget_refuses_past_either_limit_and_counts_by_scope() {
    let refused = Arc::new(Mutex::new(Vec::new()));
    let seen = refused.clone();
    let budget = Arc::new(
        InFlightBudget::new(100, 60)
            .with_hooks(Some(Arc::new(move |s| seen.lock().unwrap().push(s))), None),
    );
    let a: ConnectionKey = (None, Some("127.0.0.1:1".parse().unwrap()));
    let b: ConnectionKey = (None, Some("127.0.0.1:2".parse().unwrap()));
    let charge = |c: ConnectionKey| Charge {
        budget: budget.clone(),
        connection: c,
        bytes: 0,
    };
    let mut a1 = charge(a);
    a1.hold(50).unwrap();
    assert_eq!(charge(a).hold(20), Err(Scope::Connection));
    let mut b1 = charge(b);
    b1.hold(50).unwrap();
    assert_eq!(charge(b).hold(1), Err(Scope::Process));
    assert_eq!(budget.held(), 100);
    // a finished message gives its bytes back, and so does a dropped stream
    a1.hold(0).unwrap();
    drop(b1);
    assert_eq!(budget.held(), 0);
    assert!(budget.connections.lock().unwrap().is_empty());
    charge(a).hold(60).unwrap();
    assert_eq!(
        *refused.lock().unwrap(),
        vec![Scope::Connection, Scope::Process]
    );
}

#[test]
fn a_held_charge_grows_is_refused_by_scope_and_is_given_back_when_dropped() {
    let refused = Arc::new(Mutex::new(Vec::new()));
    let gauge = Arc::new(AtomicUsize::new(usize::MAX));
    let (seen, shown) = (refused.clone(), gauge.clone());
    let budget = Arc::new(InFlightBudget::new(100, 60).with_hooks(
        Some(Arc::new(move |s| seen.lock().unwrap().push(s))),
        Some(Arc::new(move |b| shown.store(b, Ordering::Relaxed))),
    ));
    let port: SocketAddr = "127.0.0.1:8080".parse().unwrap();
    let a: ConnectionKey = (Some(port), Some("127.0.0.1:1".parse().unwrap()));
    let b: ConnectionKey = (Some(port), Some("127.0.0.1:2".parse().unwrap()));
    let mut a1 = budget.try_hold(a, 50).unwrap();
    assert_eq!((budget.held(), gauge.load(Ordering::Relaxed)), (50, 50));
    assert_eq!(budget.try_hold(a, 20).unwrap_err(), Scope::Connection);
    // growing past the connection's share is refused and keeps what was held
    assert_eq!(a1.try_set(61), Err(Scope::Connection));
    assert_eq!(budget.held(), 50);
    a1.try_set(60).unwrap();
    let b1 = budget.try_hold(b, 40).unwrap();
    assert_eq!(budget.try_hold(b, 1).unwrap_err(), Scope::Process);
    assert_eq!(budget.held(), 100, "a refused charge holds nothing");
    a1.try_set(10).unwrap();
    assert_eq!(budget.held(), 50);
    drop(a1);
    drop(b1);
    assert_eq!((budget.held(), gauge.load(Ordering::Relaxed)), (0, 0));
    assert!(budget.connections.lock().unwrap().is_empty());
    // nothing to hold leaves no trace of the connection
    let none = budget.try_hold(a, 0).unwrap();
    assert!(budget.connections.lock().unwrap().is_empty());
    drop(none);
    assert_eq!(
        *refused.lock().unwrap(),
        vec![Scope::Connection, Scope::Connection, Scope::Process]
    );
}

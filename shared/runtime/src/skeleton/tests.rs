use super::*;
use std::time::Duration;

#[test]
fn ready_file_is_json_with_the_protocol_key_and_written_whole() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ready.json");
    let addrs = BoundAddrs {
        grpc: Some("127.0.0.1:4001".parse().unwrap()),
        http: None,
        admin: "127.0.0.1:4002".parse().unwrap(),
        more: Default::default(),
    };
    write_ready_file(&path, &addrs).unwrap();
    assert_eq!(
        std::fs::read_to_string(&path).unwrap(),
        r#"{"grpc":"127.0.0.1:4001","admin":"127.0.0.1:4002"}"#
    );
    assert_eq!(read_ready_file(&path).unwrap(), addrs);
    // Only the file itself is left: the temporary was renamed, not copied.
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("ready.json")]);
    // A rewrite replaces it.
    let http = BoundAddrs {
        grpc: None,
        http: Some("127.0.0.1:4003".parse().unwrap()),
        admin: "127.0.0.1:4004".parse().unwrap(),
        more: Default::default(),
    };
    write_ready_file(&path, &http).unwrap();
    assert_eq!(
        std::fs::read_to_string(&path).unwrap(),
        r#"{"http":"127.0.0.1:4003","admin":"127.0.0.1:4004"}"#
    );
}

/// An optional listener (br-decision's ext_proc port) is one more key beside the others.
#[tokio::test]
async fn ready_file_lists_optional_listeners_by_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ready.json");
    let ext: SocketAddr = "127.0.0.1:4005".parse().unwrap();
    let r: Running<Grpc> = Running::spawn(
        "127.0.0.1:4001".parse().unwrap(),
        "127.0.0.1:4002".parse().unwrap(),
        Readiness::default(),
        CancellationToken::new(),
        (),
        async { Ok(ServeOutcome::Drained) },
    )
    .with_listener("ext_proc", ext);
    assert_eq!(r.listener("ext_proc"), Some(ext));
    assert_eq!(r.listener("other"), None);
    write_ready_file(&path, &r.addrs()).unwrap();
    assert_eq!(
        std::fs::read_to_string(&path).unwrap(),
        r#"{"grpc":"127.0.0.1:4001","admin":"127.0.0.1:4002","ext_proc":"127.0.0.1:4005"}"#
    );
    assert_eq!(read_ready_file(&path).unwrap(), r.addrs());
}

#[test]
fn ready_file_in_a_missing_directory_fails() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nope").join("ready.json");
    let addrs = BoundAddrs {
        grpc: None,
        http: None,
        admin: "127.0.0.1:1".parse().unwrap(),
        more: Default::default(),
    };
    assert!(write_ready_file(&path, &addrs).is_err());
}

fn common(listen: &str, admin: &str) -> CommonArgs {
    use clap::Parser as _;
    #[derive(clap::Parser)]
    struct A {
        #[command(flatten)]
        common: CommonArgs,
    }
    A::try_parse_from(["x", "--listen", listen, "--admin-listen", admin])
        .unwrap()
        .common
}

#[tokio::test]
async fn bind_errors_name_the_flag_and_address() {
    let taken = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let c = common(&addr, "127.0.0.1:0");
    let e = bind_grpc(&c, &Edge::default()).await.unwrap_err();
    assert!(
        matches!(
            e,
            StartError::Bind {
                flag: "--listen",
                ..
            }
        ),
        "{e}"
    );
    assert!(
        e.to_string()
            .starts_with(&format!("binding --listen {addr}: "))
    );
    let e = bind_listen(&c, &Edge::default()).await.unwrap_err();
    assert!(
        e.to_string()
            .starts_with(&format!("binding --listen {addr}: "))
    );
    let c = common("127.0.0.1:0", &addr);
    let e = start_admin(
        &c,
        &Edge::default(),
        &prometheus::Registry::new(),
        &Readiness::default(),
        &CancellationToken::new(),
    )
    .await
    .unwrap_err();
    assert!(
        e.to_string()
            .starts_with(&format!("binding --admin-listen {addr}: ")),
        "{e}"
    );
}

#[tokio::test]
async fn running_reports_its_addresses_and_waits_for_its_task() {
    let shutdown = CancellationToken::new();
    let readiness = Readiness::new(true);
    let listen: SocketAddr = "127.0.0.1:7001".parse().unwrap();
    let admin: SocketAddr = "127.0.0.1:7002".parse().unwrap();
    let stop = shutdown.clone();
    let r: Running<Grpc, u64> =
        Running::spawn(listen, admin, readiness, shutdown.clone(), 42, async move {
            stop.cancelled().await;
            Ok(ServeOutcome::GraceExpired)
        });
    assert_eq!(r.grpc_addr(), listen);
    assert_eq!(r.admin_addr(), admin);
    assert_eq!(
        r.addrs(),
        BoundAddrs {
            grpc: Some(listen),
            http: None,
            admin,
            more: Default::default(),
        }
    );
    assert!(r.is_ready());
    assert_eq!(*r.extra(), 42);
    let outcome = tokio::time::timeout(Duration::from_secs(10), r.stop())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(outcome, ServeOutcome::GraceExpired);
    assert!(shutdown.is_cancelled());

    let r: Running<Http> = Running::spawn(
        listen,
        admin,
        Readiness::default(),
        CancellationToken::new(),
        (),
        async { panic!("the serving task dies") },
    );
    assert_eq!(r.http_addr(), listen);
    assert_eq!(r.addrs().http, Some(listen));
    let e = tokio::time::timeout(Duration::from_secs(10), r.wait())
        .await
        .unwrap()
        .unwrap_err();
    assert!(matches!(e, ServeError::Task(_)), "{e}");
}

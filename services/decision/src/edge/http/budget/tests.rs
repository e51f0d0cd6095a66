use std::sync::Mutex;

use http_body_util::{BodyExt as _, StreamBody};
use tokio::sync::mpsc;

use super::*;

type Sender = mpsc::Sender<Result<Frame<Bytes>, axum::Error>>;

/// A body whose frames the test sends one at a time; it never says it has ended before the
/// sender is dropped (as a chunked HTTP/1 body).
fn streamed() -> (Sender, Body) {
    let (tx, rx) = mpsc::channel(4);
    (tx, Body::new(StreamBody::new(ReceiverStream::new(rx))))
}

async fn send(tx: &Sender, bytes: usize) {
    tx.send(Ok(Frame::data(Bytes::from(vec![b' '; bytes]))))
        .await
        .unwrap();
}

/// The next data frame's length; panics on an error or the end.
async fn next_len(body: &mut Body) -> usize {
    let frame = body.frame().await.unwrap().unwrap();
    frame.into_data().unwrap().len()
}

/// A budget of `process` and `connection` bytes whose refusals are recorded.
fn budget(process: usize, connection: usize) -> (Arc<InFlightBudget>, Arc<Mutex<Vec<Scope>>>) {
    let refused = Arc::new(Mutex::new(Vec::new()));
    let seen = refused.clone();
    let budget = InFlightBudget::new(process, connection)
        .with_hooks(Some(Arc::new(move |s| seen.lock().unwrap().push(s))), None);
    (Arc::new(budget), refused)
}

fn on(budget: &Arc<InFlightBudget>, remote_port: u16) -> BodyBudget {
    BodyBudget {
        budget: budget.clone(),
        connection: (
            Some(SocketAddr::from(([127, 0, 0, 1], 8080))),
            Some(SocketAddr::from(([127, 0, 0, 1], remote_port))),
        ),
    }
}

#[tokio::test]
async fn a_body_whole_in_its_first_frame_is_never_charged() {
    let (budget, refused) = budget(100, 100);
    // the budget is full: anything charged would be refused
    let _full = budget.try_hold(on(&budget, 1).connection, 100).unwrap();
    let (tx, rx) = streamed();
    let mut body = charged(rx, Some(20), on(&budget, 2));
    send(&tx, 20).await;
    assert_eq!(next_len(&mut body).await, 20);
    // without a Content-Length, a body that says it has ended with its frame
    let body = charged(Body::from(vec![b' '; 30]), None, on(&budget, 3));
    assert_eq!(
        axum::body::to_bytes(body, MAX_BODY_BYTES)
            .await
            .unwrap()
            .len(),
        30
    );
    assert_eq!(budget.held(), 100);
    assert!(refused.lock().unwrap().is_empty());
    // where the same body split in two is charged, and refused
    let (tx, rx) = streamed();
    let mut body = charged(rx, Some(20), on(&budget, 4));
    send(&tx, 10).await;
    assert!(body.frame().await.unwrap().is_err());
    assert_eq!(*refused.lock().unwrap(), vec![Scope::Process]);
}

#[tokio::test]
async fn an_unfinished_body_holds_its_declared_length_until_its_last_byte() {
    let (budget, _) = budget(1000, 1000);
    let (tx, rx) = streamed();
    let mut body = charged(rx, Some(100), on(&budget, 1));
    send(&tx, 40).await;
    assert_eq!(next_len(&mut body).await, 40);
    assert_eq!(budget.held(), 100);
    send(&tx, 50).await;
    assert_eq!(next_len(&mut body).await, 50);
    assert_eq!(budget.held(), 100);
    send(&tx, 10).await;
    assert_eq!(next_len(&mut body).await, 10);
    assert_eq!(budget.held(), 0);
}

#[tokio::test]
async fn a_body_without_a_length_holds_what_has_arrived_until_its_end() {
    let (budget, _) = budget(1000, 1000);
    let (tx, rx) = streamed();
    let mut body = charged(rx, None, on(&budget, 1));
    send(&tx, 10).await;
    assert_eq!(next_len(&mut body).await, 10);
    assert_eq!(budget.held(), 10);
    send(&tx, 20).await;
    assert_eq!(next_len(&mut body).await, 20);
    assert_eq!(budget.held(), 30);
    drop(tx);
    assert!(body.frame().await.is_none());
    assert_eq!(budget.held(), 0);
}

#[tokio::test]
async fn a_body_dropped_or_broken_half_way_gives_its_charge_back() {
    let (budget, _) = budget(1000, 1000);
    let (tx, rx) = streamed();
    let mut body = charged(rx, Some(100), on(&budget, 1));
    send(&tx, 40).await;
    next_len(&mut body).await;
    assert_eq!(budget.held(), 100);
    drop(body);
    assert_eq!(budget.held(), 0);

    let (tx, rx) = streamed();
    let mut body = charged(rx, Some(100), on(&budget, 2));
    send(&tx, 40).await;
    next_len(&mut body).await;
    assert_eq!(budget.held(), 100);
    tx.send(Err(axum::Error::new(std::io::Error::other("reset"))))
        .await
        .unwrap();
    assert!(body.frame().await.unwrap().is_err());
    assert_eq!(budget.held(), 0);
}

#[tokio::test]
async fn a_body_the_budget_cannot_hold_is_refused_by_scope_and_counted() {
    let (budget, refused) = budget(150, 100);
    let (a, rx) = streamed();
    let mut held = charged(rx, Some(80), on(&budget, 1));
    send(&a, 40).await;
    next_len(&mut held).await;

    // a second body on the same connection passes the connection's share
    let (tx, rx) = streamed();
    let mut body = charged(rx, Some(30), on(&budget, 1));
    send(&tx, 10).await;
    let e = body.frame().await.unwrap().unwrap_err();
    assert_eq!(
        OverBudget::in_chain(&e),
        Some(OverBudget(Scope::Connection))
    );
    assert!(e.to_string().contains("connection's budget"), "{e}");
    assert!(
        body.frame().await.is_none(),
        "nothing is read after a refusal"
    );
    assert_eq!(budget.held(), 80);

    // another connection's passes the process's, found where the JSON reader looks for it
    let (tx, rx) = streamed();
    let body = charged(rx, Some(80), on(&budget, 2));
    send(&tx, 40).await;
    let e = axum::body::to_bytes(body, MAX_BODY_BYTES)
        .await
        .unwrap_err();
    let over = OverBudget::in_chain(&e).unwrap();
    assert_eq!(over, OverBudget(Scope::Process));
    assert!(
        over.to_string().contains("--max-in-flight-message-bytes)"),
        "{over}"
    );
    assert_eq!(budget.held(), 80);

    assert_eq!(
        *refused.lock().unwrap(),
        vec![Scope::Connection, Scope::Process]
    );
    drop(held);
    assert_eq!(budget.held(), 0);
}

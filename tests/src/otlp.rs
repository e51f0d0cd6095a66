//! An OTLP/gRPC trace receiver for the end-to-end tests: the collector's `TraceService` (the
//! opentelemetry-proto definitions, served by tonic) on 127.0.0.1:0, keeping every span the
//! services export, flattened with the `service.name` of the process that sent it. Tests
//! point the services at [`Receiver::endpoint`] (`--otlp-endpoint`) and wait for the spans
//! they expect with [`Receiver::wait_for`].

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;

/// One span as the receiver got it. Ids are lower-case hex, as `traceparent` writes them; an
/// empty `parent_span_id` is a root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Span {
    /// The exporting process's `service.name` (`br-decision`, ...).
    pub service: String,
    pub name: String,
    pub kind: SpanKind,
    pub trace_id: String,
    pub span_id: String,
    pub parent_span_id: String,
    /// (trace id, span id) of each linked span.
    pub links: Vec<(String, String)>,
    /// String and integer attributes, as text.
    pub attributes: Vec<(String, String)>,
}

impl Span {
    /// An attribute's value as text.
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attributes
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn text(v: Option<&opentelemetry_proto::tonic::common::v1::AnyValue>) -> Option<String> {
    match v?.value.as_ref()? {
        Value::StringValue(s) => Some(s.clone()),
        Value::IntValue(i) => Some(i.to_string()),
        Value::BoolValue(b) => Some(b.to_string()),
        Value::DoubleValue(d) => Some(d.to_string()),
        _ => None,
    }
}

#[derive(Clone, Default)]
struct Collector {
    spans: Arc<Mutex<Vec<Span>>>,
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut got = Vec::new();
        for rs in request.into_inner().resource_spans {
            let service = rs
                .resource
                .as_ref()
                .and_then(|r| r.attributes.iter().find(|a| a.key == "service.name"))
                .and_then(|a| text(a.value.as_ref()))
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for s in ss.spans {
                    got.push(Span {
                        service: service.clone(),
                        kind: SpanKind::try_from(s.kind).unwrap_or(SpanKind::Unspecified),
                        name: s.name,
                        trace_id: hex(&s.trace_id),
                        span_id: hex(&s.span_id),
                        parent_span_id: hex(&s.parent_span_id),
                        links: s
                            .links
                            .iter()
                            .map(|l| (hex(&l.trace_id), hex(&l.span_id)))
                            .collect(),
                        attributes: s
                            .attributes
                            .iter()
                            .filter_map(|a| Some((a.key.clone(), text(a.value.as_ref())?)))
                            .collect(),
                    });
                }
            }
        }
        self.spans.lock().unwrap().extend(got);
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// A running receiver; it stops when dropped.
pub struct Receiver {
    addr: SocketAddr,
    collector: Collector,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Receiver {
    /// Binds 127.0.0.1:0 and serves until dropped.
    pub async fn start() -> Receiver {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("binding the OTLP receiver");
        let addr = listener.local_addr().expect("its address");
        let collector = Collector::default();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let svc = TraceServiceServer::new(collector.clone());
        tokio::spawn(async move {
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
            let _ = tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming_shutdown(incoming, async {
                    let _ = stopped.await;
                })
                .await;
        });
        Receiver {
            addr,
            collector,
            stop: Some(stop),
        }
    }

    /// What to pass as `--otlp-endpoint`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<Span> {
        self.collector.spans.lock().unwrap().clone()
    }

    /// Polls the spans received until `find` returns something (the exporters send in
    /// batches, every `OTEL_BSP_SCHEDULE_DELAY`); panics naming `what` after `within`, with
    /// what did arrive.
    pub async fn wait_for<T>(
        &self,
        within: Duration,
        what: &str,
        mut find: impl FnMut(&[Span]) -> Option<T>,
    ) -> T {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let spans = self.spans();
            if let Some(t) = find(&spans) {
                return t;
            }
            if tokio::time::Instant::now() >= deadline {
                let seen: Vec<String> = spans
                    .iter()
                    .map(|s| {
                        format!(
                            "{} {:?} {:?} trace {}",
                            s.service, s.name, s.kind, s.trace_id
                        )
                    })
                    .collect();
                panic!(
                    "the OTLP receiver did not get {what} within {within:?}; it got {} spans:\n{}",
                    spans.len(),
                    seen.join("\n")
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

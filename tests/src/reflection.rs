//! gRPC server reflection clients (v1 and v1alpha): what a port says it serves.

use tonic::Status;
use tonic::transport::Channel;

/// The service names reflection v1 lists.
pub async fn list_v1(ch: Channel) -> Result<Vec<String>, Status> {
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    use tonic_reflection::pb::v1::{ServerReflectionRequest, ServiceResponse};
    let req = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut answers = ServerReflectionClient::new(ch)
        .server_reflection_info(tokio_stream::iter([req]))
        .await?
        .into_inner();
    match answers.message().await?.and_then(|m| m.message_response) {
        Some(MessageResponse::ListServicesResponse(list)) => Ok(list
            .service
            .into_iter()
            .map(|ServiceResponse { name }| name)
            .collect()),
        other => Err(Status::unknown(format!("not a service list: {other:?}"))),
    }
}

/// The service names reflection v1alpha lists.
pub async fn list_v1alpha(ch: Channel) -> Result<Vec<String>, Status> {
    use tonic_reflection::pb::v1alpha::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1alpha::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1alpha::server_reflection_response::MessageResponse;
    use tonic_reflection::pb::v1alpha::{ServerReflectionRequest, ServiceResponse};
    let req = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut answers = ServerReflectionClient::new(ch)
        .server_reflection_info(tokio_stream::iter([req]))
        .await?
        .into_inner();
    match answers.message().await?.and_then(|m| m.message_response) {
        Some(MessageResponse::ListServicesResponse(list)) => Ok(list
            .service
            .into_iter()
            .map(|ServiceResponse { name }| name)
            .collect()),
        other => Err(Status::unknown(format!("not a service list: {other:?}"))),
    }
}

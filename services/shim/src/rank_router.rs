//! The routes of a shim serving several ranks of one engine server (`--worker-ids`): the
//! path prefix `/rank/<n>/` picks the rank (see the `topology` module for why a path).

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};

use crate::topology::RANK_PREFIX;
use crate::{GENERATION_PATHS, Shim};

/// Splits `/rank/<n>/rest` into `(n, "/rest")`; None when the path has no rank prefix.
/// `Err` when it has one that is not a number.
fn split_rank(path: &str) -> Option<Result<(u32, &str), ()>> {
    let rest = path.strip_prefix(RANK_PREFIX)?;
    let (n, tail) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    Some(n.parse::<u32>().map(|n| (n, tail)).map_err(|_| ()))
}

/// The routes of a shim serving several ranks: `/rank/<n>/...` goes to rank n's proxy with
/// the prefix stripped. Without a prefix, a generation request is refused (its rank, and so
/// the worker whose load it is, would be unknown); anything else (`/v1/models`, `/health`)
/// goes to the engine through the first rank.
pub fn rank_router(ranks: BTreeMap<u32, Arc<Shim>>) -> Router {
    Router::new().fallback(dispatch).with_state(Arc::new(ranks))
}

fn not_found(first: &Shim, msg: String) -> Response {
    first.refuse_for(StatusCode::NOT_FOUND, "no_rank", msg)
}

async fn dispatch(
    State(ranks): State<Arc<BTreeMap<u32, Arc<Shim>>>>,
    mut req: Request,
) -> Response {
    let Some((_, first)) = ranks.first_key_value() else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let served = || {
        let ids: Vec<String> = ranks.keys().map(ToString::to_string).collect();
        ids.join(",")
    };
    let path = req.uri().path().to_owned();
    match split_rank(&path) {
        Some(Ok((n, tail))) => {
            let Some(shim) = ranks.get(&n) else {
                return not_found(
                    first,
                    format!("this shim serves ranks {}, not {n}", served()),
                );
            };
            let pq = match req.uri().query() {
                Some(q) => format!("{tail}?{q}"),
                None => tail.to_owned(),
            };
            let Ok(uri) = pq.parse::<Uri>() else {
                return StatusCode::BAD_REQUEST.into_response();
            };
            *req.uri_mut() = uri;
            crate::proxy(State(shim.clone()), req).await
        }
        Some(Err(())) => not_found(
            first,
            format!(
                "{path}: the rank must be a number (this shim serves ranks {})",
                served()
            ),
        ),
        None if req.method() == Method::POST && GENERATION_PATHS.contains(&path.as_str()) => {
            not_found(
                first,
                format!(
                    "this shim serves ranks {}: send {path} to /rank/<n>{path} (the endpoint \
                     Assign answered with)",
                    served()
                ),
            )
        }
        None => crate::proxy(State(first.clone()), req).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rank_prefix_is_split_off() {
        assert_eq!(
            split_rank("/rank/3/v1/completions"),
            Some(Ok((3, "/v1/completions")))
        );
        assert_eq!(split_rank("/rank/12"), Some(Ok((12, "/"))));
        assert_eq!(split_rank("/rank/x/v1"), Some(Err(())));
        assert_eq!(split_rank("/v1/completions"), None);
        assert_eq!(split_rank("/ranking"), None);
    }
}

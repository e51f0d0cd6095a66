//! The address a gRPC client dials, as the user wrote it: `http://` or `https://`.
//!
//! Under mutual TLS the TLS is done by [`crate::tls::connector`], beneath tonic, so tonic must
//! be handed `http://`: its own connector refuses `https://` when it is built without its TLS
//! feature ("Connecting to HTTPS without TLS enabled"), which told an operator nothing. Users
//! write either; [`dial_address`] turns `https://` into what tonic needs when a certificate is
//! given, and refuses it with advice when none is. [`endpoint`] does that and parses the result:
//! what every client of the services dials with (the shim's reporter, the Assign client,
//! decision's and ingest's links to the snapshot service, brctl, the watcher).

/// An address a client cannot dial as written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddressError {
    /// A scheme other than http or https.
    #[error("{addr:?}: the scheme must be http:// or https://")]
    Scheme { addr: String },
    /// `https://` with no certificate to make the TLS connection with.
    #[error(
        "{addr:?} asks for TLS but no certificate was given: pass --tls-cert, --tls-key and \
         --tls-ca (or BALANCEROUTE_TLS_CERT, _KEY, _CA); with them the address may stay http://"
    )]
    HttpsWithoutTls { addr: String },
}

/// The URL to give tonic for `addr`: `https://` becomes `http://` when `tls` (the connection's
/// TLS comes from the certificate, not the scheme); `http://` and an address without a scheme
/// are returned as they are.
pub fn dial_address(addr: &str, tls: bool) -> Result<String, AddressError> {
    let Some((scheme, rest)) = addr.split_once("://") else {
        return Ok(addr.to_owned());
    };
    match scheme.to_ascii_lowercase().as_str() {
        "http" => Ok(addr.to_owned()),
        "https" if tls => Ok(format!("http://{rest}")),
        "https" => Err(AddressError::HttpsWithoutTls {
            addr: addr.to_owned(),
        }),
        _ => Err(AddressError::Scheme {
            addr: addr.to_owned(),
        }),
    }
}

/// An address a client cannot make an endpoint of.
#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    /// The scheme is wrong, or `https://` came without a certificate.
    #[error(transparent)]
    Address(#[from] AddressError),
    /// Not a URI tonic can dial.
    #[error("{addr:?} is not a URL: {source}")]
    Uri {
        addr: String,
        source: tonic::transport::Error,
    },
}

/// The tonic endpoint for `addr` as the user wrote it, `http://` or `https://` ([`dial_address`];
/// `tls`: the connection's TLS comes from a certificate, see [`crate::tls::connect_lazy`]).
pub fn endpoint(addr: &str, tls: bool) -> Result<tonic::transport::Endpoint, EndpointError> {
    let url = dial_address(addr, tls)?;
    tonic::transport::Endpoint::from_shared(url).map_err(|source| EndpointError::Uri {
        addr: addr.to_owned(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn https_is_dialled_as_http_when_a_certificate_makes_the_tls() {
        assert_eq!(
            dial_address("https://snapshot:50061", true).as_deref(),
            Ok("http://snapshot:50061")
        );
        assert_eq!(
            dial_address("HTTPS://snapshot:50061", true).as_deref(),
            Ok("http://snapshot:50061")
        );
        for tls in [false, true] {
            assert_eq!(
                dial_address("http://127.0.0.1:50060", tls).as_deref(),
                Ok("http://127.0.0.1:50060")
            );
            assert_eq!(
                dial_address("127.0.0.1:50060", tls).as_deref(),
                Ok("127.0.0.1:50060")
            );
        }
    }

    #[test]
    fn an_endpoint_is_made_of_either_scheme_under_tls_and_refused_with_advice_otherwise() {
        let e = endpoint("https://snapshot:50061", true).expect("https under TLS");
        assert_eq!(e.uri().to_string(), "http://snapshot:50061/");
        let e = endpoint("http://snapshot:50061", true).expect("http under TLS");
        assert_eq!(e.uri().to_string(), "http://snapshot:50061/");
        let e = endpoint("https://snapshot:50061", false).unwrap_err();
        assert!(matches!(
            e,
            EndpointError::Address(AddressError::HttpsWithoutTls { .. })
        ));
        assert!(e.to_string().contains("--tls-cert"), "{e}");
        let e = endpoint("http://snap shot:50061", false).unwrap_err();
        assert!(matches!(e, EndpointError::Uri { .. }), "{e}");
        assert!(e.to_string().contains("snap shot"), "{e}");
    }

    #[test]
    fn https_without_a_certificate_and_other_schemes_are_refused_with_advice() {
        let e = dial_address("https://snapshot:50061", false).unwrap_err();
        assert!(matches!(e, AddressError::HttpsWithoutTls { .. }));
        assert!(e.to_string().contains("--tls-cert"), "{e}");
        let e = dial_address("ftp://snapshot:50061", true).unwrap_err();
        assert!(matches!(e, AddressError::Scheme { .. }), "{e}");
    }
}

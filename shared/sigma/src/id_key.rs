//! σ's table key for a request: the id's bytes kept in the table's own slot when they fit.
//!
//! Every progress report looks its request up by id, on the snapshot writer and on every
//! replica. With the id behind a pointer (`Arc<str>`), confirming a probe's match read the id
//! from another cache line, a second miss per report on a σ larger than the cache. Ids of up to
//! [`INLINE_ID_BYTES`] bytes, which covers the ids engines and gateways make (`cmpl-` or
//! `chatcmpl-` and a UUID's 32 hex digits: 37 and 41 bytes; a dashed UUID: 36), are compared
//! where the table probes; longer ones keep the shared id.

use std::hash::{Hash, Hasher};

use br_proto::valid::RequestId;
use hashbrown::Equivalent;

/// The longest id kept inline (the key is then 48 bytes).
pub(crate) const INLINE_ID_BYTES: usize = 46;

#[derive(Clone)]
pub(crate) enum IdKey {
    Inline {
        len: u8,
        bytes: [u8; INLINE_ID_BYTES],
    },
    Shared(RequestId),
}

impl IdKey {
    pub(crate) fn new(id: &RequestId) -> IdKey {
        let s = id.as_str().as_bytes();
        if s.len() > INLINE_ID_BYTES {
            return IdKey::Shared(id.clone());
        }
        let mut bytes = [0; INLINE_ID_BYTES];
        bytes[..s.len()].copy_from_slice(s);
        IdKey::Inline {
            len: s.len() as u8,
            bytes,
        }
    }

    fn as_bytes(&self) -> &[u8] {
        match self {
            IdKey::Inline { len, bytes } => &bytes[..usize::from(*len)],
            IdKey::Shared(id) => id.as_str().as_bytes(),
        }
    }
}

impl std::fmt::Debug for IdKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&String::from_utf8_lossy(self.as_bytes()), f)
    }
}

// Hashed and compared as the id's bytes, the same way [`ById`] is, so a lookup by `&str`
// finds the key whichever form it has.
impl Hash for IdKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write(self.as_bytes());
    }
}

impl PartialEq for IdKey {
    fn eq(&self, other: &Self) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl Eq for IdKey {}

/// A lookup of σ's table by request id.
pub(crate) struct ById<'a>(pub(crate) &'a str);

impl Hash for ById<'_> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write(self.0.as_bytes());
    }
}

impl Equivalent<IdKey> for ById<'_> {
    fn equivalent(&self, key: &IdKey) -> bool {
        key.as_bytes() == self.0.as_bytes()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may panic on purpose
mod tests {
    use std::hash::BuildHasher as _;

    use rustc_hash::FxBuildHasher;

    use super::*;

    fn key(s: &str) -> IdKey {
        IdKey::new(&RequestId::new(s).unwrap())
    }

    #[test]
    fn ids_up_to_the_inline_length_are_inline_and_longer_ones_shared() {
        let at = "x".repeat(INLINE_ID_BYTES);
        let over = "x".repeat(INLINE_ID_BYTES + 1);
        assert!(matches!(key("a"), IdKey::Inline { .. }));
        assert!(matches!(key(&at), IdKey::Inline { .. }));
        assert!(matches!(key(&over), IdKey::Shared(_)));
        assert_eq!(std::mem::size_of::<IdKey>(), 48);
    }

    #[test]
    fn a_key_hashes_and_compares_as_the_lookup_of_its_id_in_either_form() {
        let h = FxBuildHasher;
        let long = "chatcmpl-".to_owned() + &"0123456789abcdef".repeat(4);
        for id in ["rq", "cmpl-0123456789abcdef0123456789abcdef", long.as_str()] {
            let k = key(id);
            assert_eq!(h.hash_one(&k), h.hash_one(ById(id)), "{id}");
            assert!(ById(id).equivalent(&k), "{id}");
            // A prefix, an extension or one byte changed is another id.
            assert!(!ById(&id[..id.len() - 1]).equivalent(&k), "{id}");
            assert!(!ById(&format!("{id}0")).equivalent(&k), "{id}");
            assert!(
                !ById(&format!("{}Z", &id[..id.len() - 1])).equivalent(&k),
                "{id}"
            );
        }
        // The inline form pads with zero bytes; an id cannot end in NUL (no control
        // characters), but the length decides regardless.
        assert!(!ById("ab").equivalent(&key("a")));
        assert!(key("a") != key("ab"));
    }
}

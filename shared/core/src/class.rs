//! Request classes: the id of a class key, one definition for every crate.

/// The id of a request's class key (`AssignRequest.request_class`: the gateway's template,
/// tenant or tool-use label): the 64-bit FNV-1a hash of its bytes, as
/// `Reservation.request_class_id` defines it. What σ carries and [`crate::RequestInfo::class`]
/// holds; the services, the simulator and the emulator all compute it here, so a key means the
/// same class everywhere.
///
/// A hash rather than an id interned in a table: it is the same in every process and version
/// (decision replicas, the snapshot service, a restarted replica reading σ), so it travels
/// through σ as it is, and nothing has to hold (and bound) a table of keys. FNV-1a is a few
/// lines anyone can reimplement from the contract, and spreads short keys well; at 64 bits two
/// of even ten thousand keys collide with a chance of about 3·10⁻¹², and a collision would only
/// pool the two classes' statistics. Not keyed: the keys come from the operator's gateways.
pub fn class_id(key: &str) -> u64 {
    const OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    key.bytes()
        .fold(OFFSET_BASIS, |h, b| (h ^ u64::from(b)).wrapping_mul(PRIME))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn class_ids_are_fnv1a_64() {
        // FNV-1a's published test vectors (the empty string is the offset basis).
        assert_eq!(class_id(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(class_id("a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(class_id("foobar"), 0x8594_4171_f739_67e8);
        assert_ne!(class_id("c1"), class_id("c10"));
    }
}

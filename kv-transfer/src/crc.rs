//! CRC-32C (Castagnoli, the chunk checksum of the protocol) over data in parts.
//!
//! `crc-fast` folds with carry-less multiplies (VPCLMULQDQ where the CPU has it): about twice
//! the `crc32` instruction's rate here (56 vs 28 GB/s on a 4 MiB buffer), and every pushed
//! byte is checksummed on both ends of a push.

use crc_fast::{CrcAlgorithm, Digest};

/// CRC-32C of the concatenation of `parts`.
pub fn crc32c<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> u32 {
    let mut c = Crc32c::new();
    for p in parts {
        c.update(p);
    }
    c.value()
}

/// A running CRC-32C.
#[derive(Clone)]
pub(crate) struct Crc32c(Digest);

impl Crc32c {
    pub(crate) fn new() -> Self {
        Self(Digest::new(CrcAlgorithm::Crc32Iscsi))
    }

    /// Appends `data`.
    pub(crate) fn update(&mut self, data: &[u8]) {
        self.0.update(data);
    }

    /// The CRC of the data so far.
    pub(crate) fn value(&self) -> u32 {
        // A 32-bit CRC in the low half of the u64 state.
        self.0.finalize() as u32
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig {
            rng_seed: proptest::test_runner::RngSeed::Fixed(0xC2C),
            failure_persistence: None,
            ..ProptestConfig::default()
        })]
        /// Against the `crc32c` crate (SSE4.2 `crc32` instruction), split anywhere.
        #[test]
        fn equals_the_reference_crate(data in proptest::collection::vec(any::<u8>(), 0..5000), cut in 0usize..5000) {
            let cut = cut.min(data.len());
            let want = crc32c::crc32c(&data);
            prop_assert_eq!(super::crc32c([&data[..cut], &data[cut..]]), want);
            prop_assert_eq!(super::crc32c([data.as_slice()]), want);
            let mut running = super::Crc32c::new();
            running.update(&data[..cut]);
            running.update(&data[cut..]);
            prop_assert_eq!(running.value(), want);
        }
    }

    #[test]
    fn check_value() {
        // The catalogue's check value for CRC-32/ISCSI.
        assert_eq!(super::crc32c([&b"123456789"[..]]), 0xe306_9283);
    }
}

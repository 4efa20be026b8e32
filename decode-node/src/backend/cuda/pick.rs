//! Tokens picked where the logits are (#21 item 2): `sample_rows` over the LM head's output
//! in device memory, so a step brings back a few words per row, not `vocab` floats. What it
//! must meet is `model::pick::pick_row`; `selftest` and the model's check at load compare the
//! two on the device at hand.

use attention::cuda::{
    PART_LOGITS, PART_THREADS, SAMPLE_OUT_WORDS, SAMPLE_SPEC_WORDS, SAMPLE_THREADS, SAMPLE_TOP,
};

use super::BackendError;
use super::blas::Blas;
use super::driver::{Shared, f32_bytes, htod};
use crate::model::pick::{PickSpec, Picked};

/// The 32-bit words of `sample_rows`' spec for `picks` (a row without one is greedy with no
/// top list, and its result is ignored).
pub(super) fn spec_words(picks: &[Option<PickSpec>]) -> Vec<u32> {
    let mut w = Vec::with_capacity(picks.len() * SAMPLE_SPEC_WORDS);
    for p in picks {
        let (temperature, top_k, top_p, top, draw) = match p {
            Some(p) => (
                p.temperature,
                p.top_k.min(u32::MAX as usize) as u32,
                p.top_p,
                p.top_logprobs.min(SAMPLE_TOP) as u32,
                p.draw.unwrap_or(0.0),
            ),
            None => (0.0, 0, 0.0, 0, 0.0),
        };
        // A greedy row's draw is never read; one without a draw is greedy whatever its
        // temperature, as on the host.
        let temperature = if p.is_some_and(|p| p.draw.is_none()) {
            0.0
        } else {
            temperature
        };
        let d = draw.to_bits();
        w.extend([
            temperature.to_bits(),
            top_k,
            top_p.to_bits(),
            top,
            d as u32,
            (d >> 32) as u32,
        ]);
    }
    w
}

/// Reads `sample_rows`' result words: each row with a spec that the device picked.
pub(super) fn parse_out(words: &[u32], picks: &[Option<PickSpec>]) -> Vec<Option<Picked>> {
    words
        .chunks_exact(SAMPLE_OUT_WORDS)
        .zip(picks)
        .map(|(o, p)| {
            if p.is_none() || o[0] != 0 {
                return None;
            }
            let count = (o[3] as usize).min(SAMPLE_TOP);
            Some(Picked {
                token: o[1],
                logprob: f32::from_bits(o[2]),
                top: (0..count)
                    .map(|j| (o[4 + 2 * j], f32::from_bits(o[5 + 2 * j])))
                    .collect(),
            })
        })
        .collect()
}

/// Picks the token of each row of `logits` (device, `picks.len() x vocab` f32) that has a
/// spec, with one launch and one wait. `None` for rows without a spec and rows the device
/// leaves to the host (their logits are still at `logits`).
pub(super) fn sample_rows(
    sh: &Shared,
    g: &mut Blas,
    logits: u64,
    vocab: usize,
    picks: &[Option<PickSpec>],
) -> Result<Vec<Option<Picked>>, BackendError> {
    let n = picks.len();
    if n == 0 || picks.iter().all(Option::is_none) {
        return Ok(vec![None; n]);
    }
    let vocab_i = i32::try_from(vocab)
        .map_err(|_| BackendError::Unsupported(format!("a vocabulary of {vocab}")))?;
    let spec = spec_words(picks);
    let out_words = n * SAMPLE_OUT_WORDS;
    // Each row's first two passes in slices over the device (`row_max_parts`,
    // `row_sum_parts`): their results follow the spec and the output, the sums 8-aligned.
    let nparts = vocab.div_ceil(PART_LOGITS);
    let nparts_i = i32::try_from(nparts)
        .map_err(|_| BackendError::Unsupported(format!("a vocabulary of {vocab}")))?;
    let parts_at = (spec.len() + out_words) * 4;
    let sums_at = (parts_at + n * nparts * 3 * 4).next_multiple_of(8);
    let base = g.pick.ptr(&sh.stream, sums_at + n * nparts * 2 * 8)?;
    let out = base + (spec.len() * 4) as u64;
    let (parts, sums) = (base + parts_at as u64, base + sums_at as u64);
    // The pick's own pinned buffer: the residual's staging may still be read by an upload.
    let stage = g.pick_staging.get(spec.len().max(out_words))?;
    for (s, w) in stage.iter_mut().zip(&spec) {
        *s = f32::from_bits(*w);
    }
    htod(base, f32_bytes(&stage[..spec.len()]), &sh.stream)?;
    let grid = (nparts as u32, n as u32);
    // SAFETY: `logits` holds n rows of `vocab` floats (the caller's), `base` the spec, `out`
    // room for n results, `parts` and `sums` for n x nparts of each pass's (3 words; 2
    // doubles); a block of PART_THREADS per slice of PART_LOGITS and of SAMPLE_THREADS per
    // row, as the kernels assume.
    unsafe {
        sh.launch(
            &sh.k.row_max_parts,
            grid,
            PART_THREADS,
            &[&logits, &vocab_i, &nparts_i, &parts],
        )?;
        sh.launch(
            &sh.k.row_sum_parts,
            grid,
            PART_THREADS,
            &[&logits, &base, &vocab_i, &parts, &nparts_i, &sums],
        )?;
        sh.launch(
            &sh.k.sample_rows,
            (n as u32, 1),
            SAMPLE_THREADS,
            &[&logits, &base, &out, &vocab_i, &parts, &sums, &nparts_i],
        )?;
    }
    let back = &mut g.pick_staging.get(spec.len().max(out_words))?[..out_words];
    sh.read_back(back, out)?;
    let words: Vec<u32> = back.iter().map(|f| f.to_bits()).collect();
    Ok(parse_out(&words, picks))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_and_result_words_round_trip_what_the_kernel_reads_and_writes() {
        let picks = [
            Some(PickSpec {
                temperature: 0.7,
                top_k: 40,
                top_p: 0.9,
                draw: Some(0.123456789),
                top_logprobs: 3,
            }),
            None,
            Some(PickSpec {
                temperature: 1.0,
                top_k: 0,
                top_p: 0.0,
                draw: None,
                top_logprobs: 50,
            }),
        ];
        let w = spec_words(&picks);
        assert_eq!(w.len(), 3 * SAMPLE_SPEC_WORDS);
        assert_eq!(f32::from_bits(w[0]), 0.7);
        assert_eq!((w[1], f32::from_bits(w[2]), w[3]), (40, 0.9, 3));
        let d = f64::from_bits(u64::from(w[4]) | (u64::from(w[5]) << 32));
        assert_eq!(d, 0.123456789);
        // No draw: greedy; the top list is capped at what the kernel writes.
        assert_eq!((f32::from_bits(w[12]), w[15]), (0.0, SAMPLE_TOP as u32));

        let mut out = vec![0u32; 3 * SAMPLE_OUT_WORDS];
        out[..6].copy_from_slice(&[0, 17, (-0.5f32).to_bits(), 1, 17, (-0.5f32).to_bits()]);
        out[SAMPLE_OUT_WORDS * 2] = 1; // left to the host
        let got = parse_out(&out, &picks);
        assert_eq!(
            got[0],
            Some(Picked {
                token: 17,
                logprob: -0.5,
                top: vec![(17, -0.5)]
            })
        );
        assert_eq!((got[1].as_ref(), got[2].as_ref()), (None, None));
    }
}

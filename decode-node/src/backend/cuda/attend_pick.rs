//! Which kernel attention takes on this device, per group size (#21 item 3): `attend_tc`
//! (tensor cores) where it gives the CPU's results here and, unless forced, took less time than
//! the kernel it would replace (`attend_warps`, or the general one) on a synthetic call at
//! start; and whether that kernel prefetches its next loads into L2, where that took less
//! time on the same call. Chosen once, when the device's KV store is made.

use std::sync::Arc;
use std::sync::atomic::{AtomicU16, Ordering};

use attention::BlockGeometry;

use super::attn_bench::Synthetic;
use super::blas::Timer;
use super::driver::{AttendChoice, PrefetchChoice, Shared, WARPS_MAX_GROUP};
use super::selftest::{ATTENTION_TOLERANCE, check_split_attention};
use crate::backend::BackendError;

/// Tokens of each KV head the timed call attends, the longest first: the first whose KV fits.
/// At 8k the two kernels' times were within the device's noise at start (an H200, session
/// 53: G=8 kept attend_warps at 41 against 38 us, where `bench kernels` read attend_tc 30%
/// faster at 8k and 50% at 64k); at 32k each call reads ~134 MB (Qwen3-14B's 8 KV heads), so
/// the time is the kernels' and not their launches'.
const TIMED_CONTEXTS: [usize; 2] = [32768, 8192];
/// Timed calls of each kernel a round (after one untimed).
const TIMED_CALLS: usize = 10;
/// Rounds, each kernel's in turn: each keeps its fastest round, so a slow moment of the
/// device (clocks still rising at start) counts against neither.
const TIMED_ROUNDS: usize = 3;

/// Sets [`Shared::tc_groups`] for `geom`'s blocks: for each group size `attend_tc` is built
/// for, on where it agrees with the CPU and (unless `DECODE_NODE_ATTENTION_KERNEL=tc`) was the
/// faster of the two. Off everywhere on a device without MMAs, or where asked for `split` or
/// `warps`. Then, unless `DECODE_NODE_ATTENTION_PREFETCH` says, sets the group's bit of
/// [`Shared::prefetch_groups`] where the kernel it takes was faster prefetching its next loads.
pub(super) fn pick(sh: &Arc<Shared>, geom: &BlockGeometry) {
    {
        let Ok(mut last) = sh.tc_picked_for.lock() else {
            return;
        };
        if *last == Some(*geom) {
            return;
        }
        *last = Some(*geom);
    }
    sh.tc_groups.store(0, Ordering::Release);
    if matches!(sh.attend_choice, AttendChoice::Split | AttendChoice::Warps) {
        return;
    }
    if !sh.mma {
        if sh.attend_choice == AttendChoice::Tc {
            tracing::warn!(
                "DECODE_NODE_ATTENTION_KERNEL=tc: this device has no tensor-core MMAs (sm_80 on); attention keeps attend_warps"
            );
        }
        return;
    }
    let (dt, bs, d) = (geom.dtype, geom.block_size, geom.head_dim);
    let groups: Vec<usize> = (1..=WARPS_MAX_GROUP)
        .filter(|&g| sh.k.tc(dt, bs, g, d).is_some())
        .collect();
    if groups.is_empty() {
        return;
    }
    let times_kernel = sh.attend_choice == AttendChoice::Timed;
    let times_prefetch = sh.prefetch_choice == PrefetchChoice::Timed;
    let mut timed = if times_kernel || times_prefetch {
        match synthetic(sh, geom) {
            Ok(call) => Some(call),
            Err(e) if times_kernel => {
                tracing::warn!(error = %e, "could not time attend_tc at start; attention keeps attend_warps");
                return;
            }
            // attend_tc forced: it stays, without the prefetch.
            Err(e) => {
                tracing::warn!(error = %e, "could not time the attention prefetch at start; not used");
                None
            }
        }
    } else {
        None
    };
    let prefetch_default = sh.prefetch_choice == PrefetchChoice::On;
    let mut on = 0u16;
    for g in groups {
        sh.tc_groups.store(1 << g, Ordering::Release);
        // Checked as it may run: prefetching, unless that is off.
        set_bit(
            &sh.prefetch_groups,
            g,
            sh.prefetch_choice != PrefetchChoice::Off,
        );
        let checked = check_split_attention(sh, dt, g, d, bs);
        set_bit(&sh.prefetch_groups, g, prefetch_default);
        match checked {
            Ok(err) if err <= ATTENTION_TOLERANCE => {}
            Ok(err) => {
                tracing::error!(
                    group = g,
                    head_dim = d,
                    block_size = bs,
                    rel_err = err,
                    "attend_tc disagrees with the CPU on this device; not used"
                );
                continue;
            }
            Err(e) => {
                tracing::warn!(group = g, error = %e, "could not check attend_tc on this device; not used");
                continue;
            }
        }
        let Some(call) = timed.as_mut() else {
            on |= 1 << g;
            continue;
        };
        call.set_group(g);
        if times_kernel && !tc_was_faster(sh, call, geom, g) {
            sh.tc_groups.store(0, Ordering::Release);
        } else {
            on |= 1 << g;
        }
        if times_prefetch {
            pick_prefetch(sh, call, g);
        }
        sh.tc_groups.store(0, Ordering::Release);
    }
    sh.tc_groups.store(on, Ordering::Release);
}

/// Times `attend_tc` against the kernel it would replace on `call` (of `g` heads a group):
/// true where it was the faster; false (the other stays) where it was not or a timing failed.
fn tc_was_faster(sh: &Shared, call: &Synthetic, geom: &BlockGeometry, g: usize) -> bool {
    let (tc, other) = fastest_of_rounds(|tc| {
        sh.tc_groups
            .store(if tc { 1 << g } else { 0 }, Ordering::Release);
        time_calls(call)
    });
    sh.tc_groups.store(0, Ordering::Release);
    let other_name = call.store.kernel_name(g);
    match (tc, other) {
        (Ok(tc), Ok(other)) => {
            tracing::info!(
                group = g,
                head_dim = geom.head_dim,
                block_size = geom.block_size,
                attend_tc_us = tc * 1e6,
                other_us = other * 1e6,
                other = other_name,
                "attention kernel timed at start"
            );
            takes_faster(tc, other)
        }
        (tc, other) => {
            tracing::warn!(
                group = g,
                ?tc,
                ?other,
                "timing attend_tc failed; the group keeps {other_name}"
            );
            false
        }
    }
}

/// Sets group `g`'s bit of [`Shared::prefetch_groups`] where the kernel `call` takes now (as
/// [`Shared::tc_groups`] stands) was faster prefetching; not for the general kernel, which
/// takes no flags.
fn pick_prefetch(sh: &Shared, call: &Synthetic, g: usize) {
    let kernel = call.store.kernel_name(g);
    if kernel == "split" {
        return;
    }
    let (with, without) = fastest_of_rounds(|pf| {
        set_bit(&sh.prefetch_groups, g, pf);
        time_calls(call)
    });
    let faster = match (with, without) {
        (Ok(with), Ok(without)) => {
            tracing::info!(
                group = g,
                kernel,
                prefetch_us = with * 1e6,
                no_prefetch_us = without * 1e6,
                "attention prefetch timed at start"
            );
            takes_faster(with, without)
        }
        (with, without) => {
            tracing::warn!(
                group = g,
                kernel,
                ?with,
                ?without,
                "timing the attention prefetch failed; not used"
            );
            false
        }
    };
    set_bit(&sh.prefetch_groups, g, faster);
}

/// Sets or clears bit `g` of `bits`.
fn set_bit(bits: &AtomicU16, g: usize, on: bool) {
    if on {
        bits.fetch_or(1 << g, Ordering::AcqRel);
    } else {
        bits.fetch_and(!(1 << g), Ordering::AcqRel);
    }
}

/// A candidate (the tensor-core kernel, or prefetching) replaces what is in place only where it
/// took less time (a tie keeps what is in place).
fn takes_faster(candidate_s: f64, in_place_s: f64) -> bool {
    candidate_s < in_place_s
}

/// The synthetic call of the longest of [`TIMED_CONTEXTS`] whose KV the device holds.
fn synthetic(sh: &Arc<Shared>, geom: &BlockGeometry) -> Result<Synthetic, BackendError> {
    let mut last = None;
    for context in TIMED_CONTEXTS {
        match Synthetic::new(sh, *geom, WARPS_MAX_GROUP, context) {
            Ok(call) => return Ok(call),
            Err(e) => {
                tracing::debug!(context, error = %e, "no synthetic attention call of this context");
                last = Some(e);
            }
        }
    }
    Err(last.unwrap_or_else(|| BackendError::Unsupported("no context to time".into())))
}

/// Seconds of one call by the candidate (`time(true)`: `attend_tc`, or prefetching) and by
/// what is in place (`time(false)`, the last asked for): each one's fastest of
/// [`TIMED_ROUNDS`] rounds, taken in turn. One whose timing fails once is not timed again.
fn fastest_of_rounds(
    mut time: impl FnMut(bool) -> Result<f64, BackendError>,
) -> (Result<f64, BackendError>, Result<f64, BackendError>) {
    let mut best = [Ok(f64::INFINITY), Ok(f64::INFINITY)];
    for _ in 0..TIMED_ROUNDS {
        for (i, tc) in [true, false].into_iter().enumerate() {
            if let Ok(b) = best[i] {
                best[i] = time(tc).map(|t| b.min(t));
            }
        }
    }
    let [tc, other] = best;
    (tc, other)
}

/// Seconds of one call as the device runs it, over [`TIMED_CALLS`] queued back to back.
fn time_calls(call: &Synthetic) -> Result<f64, BackendError> {
    let stream = &call.store.shared().stream;
    // One untimed call first: a kernel's first launch loads its code.
    call.call()?;
    let timer = Timer::new()?;
    timer.start(stream)?;
    for _ in 0..TIMED_CALLS {
        call.call()?;
    }
    Ok(timer.stop(stream)? / TIMED_CALLS as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_environment_names_the_kernel() {
        assert_eq!(AttendChoice::parse(None), Ok(AttendChoice::Timed));
        assert_eq!(AttendChoice::parse(Some("")), Ok(AttendChoice::Timed));
        assert_eq!(AttendChoice::parse(Some("split")), Ok(AttendChoice::Split));
        assert_eq!(AttendChoice::parse(Some("warps")), Ok(AttendChoice::Warps));
        assert_eq!(AttendChoice::parse(Some("tc")), Ok(AttendChoice::Tc));
        let e = AttendChoice::parse(Some("tensor")).unwrap_err();
        assert!(e.contains("split, warps or tc"), "{e}");
    }

    #[test]
    fn each_kernel_keeps_its_fastest_round_and_the_other_kernel_is_asked_last() {
        let mut asked = Vec::new();
        let tc_times = [30e-6, 20e-6, 25e-6];
        let other_times = [28e-6, 29e-6, 27e-6];
        let (tc, other) = fastest_of_rounds(|tc| {
            asked.push(tc);
            let round = asked.iter().filter(|&&t| t == tc).count() - 1;
            Ok(if tc {
                tc_times[round]
            } else {
                other_times[round]
            })
        });
        assert_eq!(asked, [true, false].repeat(TIMED_ROUNDS));
        assert_eq!((tc.unwrap(), other.unwrap()), (20e-6, 27e-6));
    }

    #[test]
    fn a_failed_timing_is_not_asked_again() {
        let mut calls = [0, 0];
        let (tc, other) = fastest_of_rounds(|tc| {
            calls[usize::from(!tc)] += 1;
            if tc {
                Err(BackendError::Unsupported("no".into()))
            } else {
                Ok(1e-5)
            }
        });
        assert!(tc.is_err());
        assert_eq!(other.unwrap(), 1e-5);
        assert_eq!(calls, [1, TIMED_ROUNDS]);
    }

    #[test]
    fn only_a_faster_candidate_replaces_what_is_in_place() {
        assert!(takes_faster(20e-6, 30e-6));
        assert!(!takes_faster(30e-6, 30e-6));
        assert!(!takes_faster(40e-6, 30e-6));
        assert!(!takes_faster(f64::NAN, 30e-6));
    }

    #[test]
    fn a_group_bit_is_set_and_cleared_alone() {
        let bits = AtomicU16::new(1 << 3);
        set_bit(&bits, 5, true);
        assert_eq!(bits.load(Ordering::Relaxed), (1 << 3) | (1 << 5));
        set_bit(&bits, 3, false);
        assert_eq!(bits.load(Ordering::Relaxed), 1 << 5);
        set_bit(&bits, 3, false);
        assert_eq!(bits.load(Ordering::Relaxed), 1 << 5);
    }

    #[test]
    fn the_environment_says_whether_attention_prefetches() {
        assert_eq!(PrefetchChoice::parse(None), Ok(PrefetchChoice::Timed));
        assert_eq!(PrefetchChoice::parse(Some("on")), Ok(PrefetchChoice::On));
        assert_eq!(PrefetchChoice::parse(Some("0")), Ok(PrefetchChoice::Off));
        assert_eq!(PrefetchChoice::On.initial_groups(), u16::MAX);
        assert_eq!(PrefetchChoice::Timed.initial_groups(), 0);
        let e = PrefetchChoice::parse(Some("yes")).unwrap_err();
        assert!(e.contains("on or off"), "{e}");
    }
}

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
    let mut how = How {
        times_kernel: sh.attend_choice == AttendChoice::Timed,
        times_prefetch: sh.prefetch_choice == PrefetchChoice::Timed,
        prefetch: sh.prefetch_choice,
    };
    let call = if how.times_kernel || how.times_prefetch {
        match synthetic(sh, geom) {
            Ok(call) => Some(call),
            Err(e) if how.times_kernel => {
                tracing::warn!(error = %e, "could not time attend_tc at start; attention keeps attend_warps");
                return;
            }
            // attend_tc forced: it stays, without the prefetch.
            Err(e) => {
                tracing::warn!(error = %e, "could not time the attention prefetch at start; not used");
                how.times_prefetch = false;
                None
            }
        }
    } else {
        None
    };
    let mut trials = OnDevice { sh, geom, call };
    let chosen = choose(&groups, how, &mut trials);
    sh.prefetch_groups.store(chosen.prefetch, Ordering::Release);
    sh.tc_groups.store(chosen.tc, Ordering::Release);
}

/// What start-up may measure and what it must keep as asked.
#[derive(Debug, Clone, Copy)]
struct How {
    /// `attend_tc` against the kernel it would replace (else `attend_tc`, forced).
    times_kernel: bool,
    /// With and without the prefetch (else as `prefetch` says).
    times_prefetch: bool,
    prefetch: PrefetchChoice,
}

/// The groups that take `attend_tc`, and those whose kernel prefetches (bit `g` each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Chosen {
    tc: u16,
    prefetch: u16,
}

/// What start-up does with one group's kernels: behind a trait, so the choice is tested
/// without a device.
trait Trials {
    /// The group's attention with `attend_tc` (`tc`, else the kernel in its place), prefetching
    /// or not, checked against the CPU: its relative error.
    fn check(&mut self, g: usize, tc: bool, prefetch: bool) -> Result<f64, BackendError>;
    /// Seconds of one such call.
    fn time(&mut self, g: usize, tc: bool, prefetch: bool) -> Result<f64, BackendError>;
    /// The kernel the group takes: `attend_tc`, or the one in its place (`split` takes no
    /// flags, so it has no prefetch to time).
    fn kernel(&self, g: usize, tc: bool) -> &'static str;
}

/// Per group: `attend_tc` where it agrees with the CPU and (if timed) was the faster; then
/// the prefetch where the kernel taken agrees prefetching and (if timed) was faster so. A
/// group whose `attend_tc` fails its check keeps the prefetch as asked (off where timed).
fn choose(groups: &[usize], how: How, trials: &mut impl Trials) -> Chosen {
    let asked = how.prefetch == PrefetchChoice::On;
    let mut chosen = Chosen {
        tc: 0,
        prefetch: if asked { u16::MAX } else { 0 },
    };
    for &g in groups {
        // Checked as it will be timed: prefetching where that is asked for (where timed, the
        // prefetch is checked apart, on the kernel the group takes).
        match trials.check(g, true, asked) {
            Ok(err) if err <= ATTENTION_TOLERANCE => {}
            r => {
                tracing::error!(group = g, result = ?r, "attend_tc disagrees with the CPU on this device (or could not be checked); not used");
                continue;
            }
        }
        let tc = !how.times_kernel || tc_was_faster(trials, g, asked);
        if tc {
            chosen.tc |= 1 << g;
        }
        if how.times_prefetch && prefetch_was_faster(trials, g, tc) {
            chosen.prefetch |= 1 << g;
        }
    }
    chosen
}

/// Times `attend_tc` against the kernel it would replace for group `g` (both prefetching or
/// not, as asked): true where it was the faster; false (the other stays) where it was not or
/// a timing failed.
fn tc_was_faster(trials: &mut impl Trials, g: usize, prefetch: bool) -> bool {
    let (tc, other) = fastest_of_rounds(|tc| trials.time(g, tc, prefetch));
    let other_name = trials.kernel(g, false);
    match (tc, other) {
        (Ok(tc), Ok(other)) => {
            tracing::info!(
                group = g,
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

/// True where the kernel group `g` takes (`attend_tc` if `tc`) agrees with the CPU
/// prefetching and was faster so; never for the general kernel, which takes no flags.
fn prefetch_was_faster(trials: &mut impl Trials, g: usize, tc: bool) -> bool {
    let kernel = trials.kernel(g, tc);
    if kernel == "split" {
        return false;
    }
    match trials.check(g, tc, true) {
        Ok(err) if err <= ATTENTION_TOLERANCE => {}
        r => {
            tracing::error!(group = g, kernel, result = ?r, "the attention kernel disagrees with the CPU prefetching (or could not be checked); no prefetch");
            return false;
        }
    }
    match fastest_of_rounds(|pf| trials.time(g, tc, pf)) {
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
    }
}

/// [`Trials`] on the device: the kernels switched through `sh`'s group bits, checked by the
/// selftest's attention check and timed on the synthetic call (where there is one).
struct OnDevice<'a> {
    sh: &'a Arc<Shared>,
    geom: &'a BlockGeometry,
    call: Option<Synthetic>,
}

impl OnDevice<'_> {
    /// Group `g`'s calls take `attend_tc` (or not) and prefetch (or not); the other groups'
    /// bits as they were.
    fn switch(&self, g: usize, tc: bool, prefetch: bool) {
        set_bit(&self.sh.tc_groups, g, tc);
        set_bit(&self.sh.prefetch_groups, g, prefetch);
    }
}

impl Trials for OnDevice<'_> {
    fn check(&mut self, g: usize, tc: bool, prefetch: bool) -> Result<f64, BackendError> {
        self.switch(g, tc, prefetch);
        let (dt, d, bs) = (self.geom.dtype, self.geom.head_dim, self.geom.block_size);
        check_split_attention(self.sh, dt, g, d, bs)
    }

    fn time(&mut self, g: usize, tc: bool, prefetch: bool) -> Result<f64, BackendError> {
        self.switch(g, tc, prefetch);
        let call = self
            .call
            .as_mut()
            .ok_or_else(|| BackendError::Unsupported("no synthetic call to time".into()))?;
        call.set_group(g);
        time_calls(call)
    }

    fn kernel(&self, g: usize, tc: bool) -> &'static str {
        match &self.call {
            Some(call) => call.store.kernel_name_as(g, tc),
            None if tc => "attend_tc",
            None => "attend_warps",
        }
    }
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

    /// Trials with set results: `bad_tc` groups disagree on tensor cores, `bad_pf` groups
    /// disagree prefetching, times by (group, tc, prefetch), and every call recorded.
    #[derive(Default)]
    struct Fake {
        bad_tc: Vec<usize>,
        bad_pf: Vec<usize>,
        split: Vec<usize>,
        times: std::collections::HashMap<(usize, bool, bool), f64>,
        asked: Vec<(&'static str, usize, bool, bool)>,
    }

    impl Trials for Fake {
        fn check(&mut self, g: usize, tc: bool, pf: bool) -> Result<f64, BackendError> {
            self.asked.push(("check", g, tc, pf));
            let bad = (tc && self.bad_tc.contains(&g)) || (pf && self.bad_pf.contains(&g));
            Ok(if bad { 1.0 } else { 0.0 })
        }

        fn time(&mut self, g: usize, tc: bool, pf: bool) -> Result<f64, BackendError> {
            self.asked.push(("time", g, tc, pf));
            self.times
                .get(&(g, tc, pf))
                .copied()
                .ok_or_else(|| BackendError::Unsupported("no time".into()))
        }

        fn kernel(&self, g: usize, tc: bool) -> &'static str {
            match (tc, self.split.contains(&g)) {
                (true, _) => "attend_tc",
                (false, true) => "split",
                (false, false) => "attend_warps",
            }
        }
    }

    const TIMED: How = How {
        times_kernel: true,
        times_prefetch: true,
        prefetch: PrefetchChoice::Timed,
    };

    #[test]
    fn the_faster_kernel_then_the_faster_prefetch_of_that_kernel() {
        let mut f = Fake::default();
        // Group 5: attend_tc faster, and faster prefetching. Group 8: attend_warps faster;
        // its prefetch slower.
        for (k, t) in [
            ((5, true, false), 10.0),
            ((5, false, false), 20.0),
            ((5, true, true), 8.0),
            ((5, false, true), 30.0),
            ((8, true, false), 20.0),
            ((8, false, false), 10.0),
            ((8, false, true), 11.0),
            ((8, true, true), 1.0),
        ] {
            f.times.insert(k, t);
        }
        let c = choose(&[5, 8], TIMED, &mut f);
        assert_eq!(
            c,
            Chosen {
                tc: 1 << 5,
                prefetch: 1 << 5
            }
        );
        // The prefetch was timed on the kernel each group takes, never on the other.
        assert!(f.asked.contains(&("time", 5, true, true)));
        assert!(!f.asked.contains(&("time", 5, false, true)));
        assert!(f.asked.contains(&("time", 8, false, true)));
        assert!(!f.asked.contains(&("time", 8, true, true)));
        // Checked prefetching before either was timed so.
        let first_check = f.asked.iter().position(|a| *a == ("check", 8, false, true));
        let first_time = f.asked.iter().position(|a| *a == ("time", 8, false, true));
        assert!(first_check < first_time);
    }

    #[test]
    fn a_kernel_that_disagrees_is_not_taken_nor_prefetched() {
        let mut f = Fake {
            bad_tc: vec![4],
            bad_pf: vec![5],
            ..Fake::default()
        };
        for g in [4, 5] {
            for tc in [true, false] {
                for pf in [true, false] {
                    f.times.insert((g, tc, pf), if pf { 1.0 } else { 2.0 });
                }
            }
        }
        f.times.insert((5, true, false), 1.0);
        let c = choose(&[4, 5], TIMED, &mut f);
        // 4: attend_tc disagrees: neither bit, and nothing of it timed. 5: attend_tc agrees
        // and is faster, but disagrees prefetching: never timed so.
        assert_eq!(
            c,
            Chosen {
                tc: 1 << 5,
                prefetch: 0
            }
        );
        assert!(!f.asked.iter().any(|a| a.0 == "time" && a.1 == 4));
        assert!(!f.asked.iter().any(|a| a.0 == "time" && a.1 == 5 && a.3));
        let how = How {
            prefetch: PrefetchChoice::Off,
            times_prefetch: false,
            ..TIMED
        };
        let mut f = Fake {
            bad_pf: vec![5],
            ..f
        };
        f.asked.clear();
        // With the prefetch off, nothing runs prefetching.
        assert_eq!(
            choose(&[5], how, &mut f),
            Chosen {
                tc: 1 << 5,
                prefetch: 0
            }
        );
        assert!(f.asked.iter().all(|a| !a.3), "{:?}", f.asked);
    }

    #[test]
    fn forced_choices_are_kept_and_not_timed() {
        // attend_tc forced, prefetch on: every group's bit, nothing timed.
        let how = How {
            times_kernel: false,
            times_prefetch: false,
            prefetch: PrefetchChoice::On,
        };
        let mut f = Fake::default();
        let c = choose(&[1, 5], how, &mut f);
        assert_eq!(
            c,
            Chosen {
                tc: (1 << 1) | (1 << 5),
                prefetch: u16::MAX
            }
        );
        assert!(f.asked.iter().all(|a| a.0 == "check" && a.3));
        // The general kernel takes no flags: its prefetch is not timed.
        let mut f = Fake {
            split: vec![3],
            ..Fake::default()
        };
        f.times.insert((3, true, false), 2.0);
        f.times.insert((3, false, false), 1.0);
        assert_eq!(choose(&[3], TIMED, &mut f), Chosen { tc: 0, prefetch: 0 });
        assert!(!f.asked.iter().any(|a| a.0 == "time" && a.3));
        // A timing that fails keeps what is in place.
        let mut f = Fake::default();
        assert_eq!(choose(&[2], TIMED, &mut f), Chosen { tc: 0, prefetch: 0 });
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

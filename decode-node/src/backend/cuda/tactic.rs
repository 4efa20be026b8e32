//! Which kernel computes a small-batch product `y = x · wᵀ`: cuBLAS, `gemv_b{B}` (FMAs, a warp
//! per row of w) or `gemv_tc` (tensor-core MMAs, 16 rows of w per CUDA block). Which is
//! fastest depends on the device, the batch and the matrix (on an H200 `gemv_b1` beat cuBLAS
//! at batch 1 and lost to it by 0.6x at batch 8), so by default each shape's first product
//! times every kernel that passed the start-up check against cuBLAS and keeps the fastest.
//! The host-side rules live here; the timing and the launches in `blas`.

use std::collections::HashMap;

use attention::KvDType;

use super::driver::GEMV_MAX_BATCH;

/// How one product is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Tactic {
    Cublas,
    Gemv,
    GemvTc,
}

impl Tactic {
    /// The name `DECODE_NODE_GEMV_TACTIC` takes and the logs print.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Tactic::Cublas => "cublas",
            Tactic::Gemv => "gemv",
            Tactic::GemvTc => "tc",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        [Tactic::Cublas, Tactic::Gemv, Tactic::GemvTc]
            .into_iter()
            .find(|t| t.name() == s.trim())
    }
}

/// A product's shape: weight type, rows of w, batch, columns.
pub(crate) type Shape = (KvDType, usize, usize, usize);

/// The small-batch kernels' rule and what it chose per shape.
#[derive(Debug)]
pub(crate) struct Tactics {
    /// Largest batch the kernels may take (0: cuBLAS only, `DECODE_NODE_GEMV=0`).
    pub(crate) up_to: usize,
    /// One tactic wherever it can take the product (`DECODE_NODE_GEMV_TACTIC`); `None`: timed.
    pub(crate) forced: Option<Tactic>,
    /// The device has the MMAs `gemv_tc` is built on (sm_80 and later).
    pub(crate) mma: bool,
    /// The kernels that agree with cuBLAS on this device (the start-up check).
    pub(crate) gemv_ok: bool,
    pub(crate) tc_ok: bool,
    /// The timed choice of each shape seen.
    chosen: HashMap<Shape, Tactic>,
}

/// What to do for one product.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Choice {
    Use(Tactic),
    /// Time these (cuBLAS first) and keep the fastest for the shape.
    Time(Vec<Tactic>),
}

impl Tactics {
    /// The rule from `DECODE_NODE_GEMV` (0: off), `DECODE_NODE_GEMV_MAX_BATCH` (up to 8, the
    /// default) and `DECODE_NODE_GEMV_TACTIC` (`cublas`, `gemv`, `tc`; unset or anything else:
    /// timed). The kernels count as failing the start-up check until it passes.
    pub(crate) fn from_env(
        gemv: Option<&str>,
        max_batch: Option<&str>,
        tactic: Option<&str>,
    ) -> Self {
        let up_to = if gemv == Some("0") {
            0
        } else {
            max_batch
                .and_then(|v| v.trim().parse::<usize>().ok())
                .map_or(GEMV_MAX_BATCH, |b| b.min(GEMV_MAX_BATCH))
        };
        Self {
            up_to,
            forced: tactic.and_then(Tactic::parse),
            mma: false,
            gemv_ok: false,
            tc_ok: false,
            chosen: HashMap::new(),
        }
    }

    /// How to compute a product of `shape` whose operands `fit` the small-batch kernels
    /// (16-bit, whole 16-byte chunks at 16-byte aligned addresses, i32 sizes).
    pub(crate) fn choose(&self, shape: Shape, fits: bool) -> Choice {
        let (_, _, batch, _) = shape;
        if !fits || batch == 0 || batch > self.up_to {
            return Choice::Use(Tactic::Cublas);
        }
        // Every product of a step asks: nothing is built before a shape's choice is known.
        let passed = |t: Tactic| match t {
            Tactic::Cublas => true,
            Tactic::Gemv => self.gemv_ok,
            Tactic::GemvTc => self.tc_ok,
        };
        if let Some(t) = self.forced {
            return Choice::Use(if passed(t) { t } else { Tactic::Cublas });
        }
        if !self.gemv_ok && !self.tc_ok {
            return Choice::Use(Tactic::Cublas);
        }
        match self.chosen.get(&shape) {
            Some(&t) => Choice::Use(t),
            None => Choice::Time(
                [Tactic::Cublas, Tactic::Gemv, Tactic::GemvTc]
                    .into_iter()
                    .filter(|&t| passed(t))
                    .collect(),
            ),
        }
    }

    /// Records the fastest of `timed` (seconds per product, in the order they were timed; a
    /// tactic that failed has none) for `shape` and returns it. A tie keeps the earlier one.
    pub(crate) fn keep_fastest(&mut self, shape: Shape, timed: &[(Tactic, Option<f64>)]) -> Tactic {
        let best = timed
            .iter()
            .filter_map(|&(t, s)| s.filter(|s| s.is_finite()).map(|s| (t, s)))
            .fold(None::<(Tactic, f64)>, |best, (t, s)| match best {
                Some((_, b)) if b <= s => best,
                _ => Some((t, s)),
            })
            .map_or(Tactic::Cublas, |(t, _)| t);
        self.chosen.insert(shape, best);
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: Shape = (KvDType::Bf16, 7168, 4, 5120);

    fn passed(mut t: Tactics) -> Tactics {
        t.gemv_ok = true;
        t.tc_ok = true;
        t
    }

    #[test]
    fn the_environment_sets_the_batches_and_a_forced_tactic() {
        let t = Tactics::from_env(None, None, None);
        assert_eq!((t.up_to, t.forced), (GEMV_MAX_BATCH, None));
        assert_eq!(Tactics::from_env(Some("0"), Some("4"), None).up_to, 0);
        assert_eq!(Tactics::from_env(None, Some("2"), None).up_to, 2);
        assert_eq!(Tactics::from_env(None, Some("99"), None).up_to, 8);
        assert_eq!(Tactics::from_env(None, Some("x"), None).up_to, 8);
        assert_eq!(
            Tactics::from_env(None, None, Some(" tc")).forced,
            Some(Tactic::GemvTc)
        );
        assert_eq!(Tactics::from_env(None, None, Some("auto")).forced, None);
    }

    #[test]
    fn only_checked_kernels_are_timed_and_large_batches_take_cublas() {
        let mut t = Tactics::from_env(None, None, None);
        // Nothing passed the start-up check: cuBLAS, untimed.
        assert_eq!(t.choose(SHAPE, true), Choice::Use(Tactic::Cublas));
        t.tc_ok = true;
        assert_eq!(
            t.choose(SHAPE, true),
            Choice::Time(vec![Tactic::Cublas, Tactic::GemvTc])
        );
        let t = passed(t);
        assert_eq!(t.choose(SHAPE, false), Choice::Use(Tactic::Cublas));
        assert_eq!(
            t.choose((KvDType::Bf16, 7168, 9, 5120), true),
            Choice::Use(Tactic::Cublas)
        );
        assert_eq!(
            t.choose(SHAPE, true),
            Choice::Time(vec![Tactic::Cublas, Tactic::Gemv, Tactic::GemvTc])
        );
    }

    #[test]
    fn the_fastest_is_kept_per_shape() {
        let mut t = passed(Tactics::from_env(None, None, None));
        let kept = t.keep_fastest(
            SHAPE,
            &[
                (Tactic::Cublas, Some(3e-5)),
                (Tactic::Gemv, None),
                (Tactic::GemvTc, Some(2e-5)),
            ],
        );
        assert_eq!(kept, Tactic::GemvTc);
        assert_eq!(t.choose(SHAPE, true), Choice::Use(Tactic::GemvTc));
        // Another batch is timed apart.
        let other = (KvDType::Bf16, 7168, 1, 5120);
        assert!(matches!(t.choose(other, true), Choice::Time(_)));
        // Nothing timed, or a tie: cuBLAS, the earlier.
        assert_eq!(
            t.keep_fastest(other, &[(Tactic::Gemv, None)]),
            Tactic::Cublas
        );
        assert_eq!(
            t.keep_fastest(
                other,
                &[(Tactic::Cublas, Some(1e-5)), (Tactic::Gemv, Some(1e-5))]
            ),
            Tactic::Cublas
        );
    }

    #[test]
    fn a_forced_tactic_holds_where_it_passed_the_check() {
        let mut t = passed(Tactics::from_env(None, None, Some("gemv")));
        assert_eq!(t.choose(SHAPE, true), Choice::Use(Tactic::Gemv));
        t.gemv_ok = false;
        assert_eq!(t.choose(SHAPE, true), Choice::Use(Tactic::Cublas));
        let t = passed(Tactics::from_env(None, None, Some("cublas")));
        assert_eq!(t.choose(SHAPE, true), Choice::Use(Tactic::Cublas));
    }
}

//! A window of decode steps for a device profiler (`DECODE_NODE_PROFILE_STEPS=B:SKIP:N`): the
//! backend's profiler runs through N steps of batch size B, after SKIP such steps, so
//! `ncu --profile-from-start off` records one steady step's kernels and not the checks and
//! timings a node runs at start (thousands of launches).

/// Where the window stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ProfileWindow {
    batch: usize,
    /// Steps of `batch` still to pass before the profiler starts.
    skip: usize,
    /// Steps still to profile once started.
    left: usize,
    on: bool,
}

/// What the step loop does about the profiler around one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Switch {
    Start,
    Stop,
    None,
}

impl ProfileWindow {
    /// The window `B:SKIP:N` names (`N` >= 1, `B` >= 1).
    pub(super) fn parse(v: &str) -> Result<Self, String> {
        let parts: Vec<&str> = v.split(':').collect();
        let bad =
            || format!("DECODE_NODE_PROFILE_STEPS={v}: expected BATCH:SKIP:STEPS, e.g. 8:4:2");
        let [batch, skip, steps] = parts[..] else {
            return Err(bad());
        };
        let num = |s: &str| s.trim().parse::<usize>().map_err(|_| bad());
        let (batch, skip, left) = (num(batch)?, num(skip)?, num(steps)?);
        if batch == 0 || left == 0 {
            return Err(bad());
        }
        Ok(Self {
            batch,
            skip,
            left,
            on: false,
        })
    }

    /// The window set in the environment, if any (a bad value is logged and ignored).
    pub(super) fn from_env() -> Option<Self> {
        let v = std::env::var("DECODE_NODE_PROFILE_STEPS").ok()?;
        match Self::parse(&v) {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::error!("{e}; no profile window");
                None
            }
        }
    }

    /// Before a step of `batch` rows: `Start` where the window opens on it.
    pub(super) fn before(&mut self, batch: usize) -> Switch {
        if self.on || self.left == 0 || batch != self.batch {
            return Switch::None;
        }
        if self.skip > 0 {
            self.skip -= 1;
            return Switch::None;
        }
        self.on = true;
        Switch::Start
    }

    /// After a step: `Stop` where the window's last step was it.
    pub(super) fn after(&mut self) -> Switch {
        if !self.on {
            return Switch::None;
        }
        self.left -= 1;
        if self.left > 0 {
            return Switch::None;
        }
        self.on = false;
        Switch::Stop
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_spans_steps_of_its_batch_after_the_skipped_ones() {
        let mut w = ProfileWindow::parse("8:2:2").unwrap();
        let mut seen = Vec::new();
        for batch in [3, 8, 5, 8, 8, 8, 8, 8] {
            let a = w.before(batch);
            let b = w.after();
            seen.push((batch, a, b));
        }
        use Switch::{None as N, Start, Stop};
        assert_eq!(
            seen,
            [
                (3, N, N),
                (8, N, N),
                (5, N, N),
                (8, N, N),
                (8, Start, N),
                (8, N, Stop),
                (8, N, N),
                (8, N, N),
            ]
        );
    }

    #[test]
    fn a_window_open_through_other_batch_sizes_still_stops() {
        let mut w = ProfileWindow::parse("1:0:2").unwrap();
        assert_eq!(w.before(1), Switch::Start);
        assert_eq!(w.after(), Switch::None);
        assert_eq!(w.before(2), Switch::None);
        assert_eq!(w.after(), Switch::Stop);
    }

    #[test]
    fn bad_values_say_what_is_expected() {
        for v in [
            "", "8", "8:1", "8:1:0", "0:1:1", "a:1:1", "8:1:1:1", "8:-1:1",
        ] {
            let e = ProfileWindow::parse(v).unwrap_err();
            assert!(e.contains("BATCH:SKIP:STEPS"), "{v}: {e}");
        }
        assert_eq!(
            ProfileWindow::parse(" 4 : 0 : 3 ").map(|w| (w.batch, w.skip, w.left)),
            Ok((4, 0, 3))
        );
    }
}

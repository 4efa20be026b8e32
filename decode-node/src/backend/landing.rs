//! Where the CPU part of a resident layer's attention lands without the step thread waiting
//! for it (#21 item 5): each CPU job writes its sequence's partials into memory the device
//! reads, and the last one to land raises a flag the device's stream waits on just before
//! the merge. The step thread queues the merge and the layer's second half at once and goes
//! on planning the next layer while the CPU parts run.
//!
//! A [`Landing`] is one layer of one step: a row per sequence, each row one [`Partial`] per
//! KV head. The memory behind it is the backend's ([`LandingMem`]: pinned, device-mapped
//! host memory on CUDA; a plain vector for the host's reference residual). Rows are handed out
//! as [`Ticket`]s, one each, so no two writers ever share a row; a ticket dropped without
//! landing (a job that failed or was abandoned) lands its row empty and marks the landing
//! broken, so the device never waits forever on a flag nobody will raise.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};

use attention::Partial;

use super::BackendError;

/// The memory of a [`Landing`]: its floats' bits as words (written with relaxed stores, which
/// are plain stores on x86-64 and arm64) and the flag word the device waits on.
pub trait LandingMem: Send + Sync + fmt::Debug {
    /// At least `rows * heads * (head_dim + 1)` words: every row's outputs
    /// (`[rows][kv_heads][group][head_dim]`), then every row's base-2 LSEs
    /// (`[rows][kv_heads][group]`): the layout the host's partials upload in.
    fn words(&self) -> &[AtomicU32];
    /// Raised to the landing's sequence number once every row has landed.
    fn flag(&self) -> &AtomicU32;
    /// Where the device reads the words and the flag, if it does.
    fn device(&self) -> Option<(u64, u64)> {
        None
    }
}

/// A landing's memory on the host alone: for backends (and tests) that read it on the host.
#[derive(Debug)]
pub struct HostLandingMem {
    words: Vec<AtomicU32>,
    flag: AtomicU32,
}

impl HostLandingMem {
    /// Room for `words` words, flag down.
    pub fn new(words: usize) -> Self {
        Self {
            words: (0..words).map(|_| AtomicU32::new(0)).collect(),
            flag: AtomicU32::new(0),
        }
    }
}

impl LandingMem for HostLandingMem {
    fn words(&self) -> &[AtomicU32] {
        &self.words
    }

    fn flag(&self) -> &AtomicU32 {
        &self.flag
    }
}

/// What a [`Landing`] holds: `rows` rows of `kv_heads` partials of `group` x `head_dim`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LandingShape {
    pub rows: usize,
    pub kv_heads: usize,
    pub group: usize,
    pub head_dim: usize,
}

impl LandingShape {
    /// `rows` rows of resident layer `l`'s heads.
    pub fn of(l: &super::ResidentLayer<'_>, rows: usize) -> Self {
        let kv_heads = l.num_kv_heads;
        Self {
            rows,
            kv_heads,
            group: l.num_heads / kv_heads.max(1),
            head_dim: l.head_dim,
        }
    }

    /// Words its outputs and LSEs take.
    pub fn words(&self) -> usize {
        self.lse_at() + self.rows * self.kv_heads * self.group
    }

    /// Where the LSEs start, after every row's outputs.
    fn lse_at(&self) -> usize {
        self.rows * self.kv_heads * self.group * self.head_dim
    }
}

/// One layer's CPU partials on their way to the device. See the module doc.
#[derive(Debug)]
pub struct Landing {
    mem: Arc<dyn LandingMem>,
    seq: u32,
    shape: LandingShape,
    /// Rows not landed yet.
    left: AtomicUsize,
    /// Tickets handed out (once).
    handed: AtomicBool,
    /// Cleared when a row landed empty because its ticket was dropped or its partials did not
    /// fit.
    whole: AtomicBool,
}

impl Landing {
    /// A landing of `shape` in `mem`, which raises its flag to `seq` when the last row lands.
    /// `mem` must not be in use by another landing whose flag the device may still wait on.
    pub fn new(
        mem: Arc<dyn LandingMem>,
        seq: u32,
        shape: LandingShape,
    ) -> Result<Arc<Self>, BackendError> {
        let need = shape.words();
        if mem.words().len() < need {
            return Err(BackendError::Unsupported(format!(
                "a landing of {need} words in {} words of memory",
                mem.words().len()
            )));
        }
        Ok(Arc::new(Self {
            mem,
            seq,
            shape,
            left: AtomicUsize::new(shape.rows),
            handed: AtomicBool::new(false),
            whole: AtomicBool::new(true),
        }))
    }

    /// One ticket per row, in row order; empty after the first call. A landing of no rows is
    /// raised here.
    pub fn tickets(self: &Arc<Self>) -> Vec<Ticket> {
        if self.handed.swap(true, Ordering::AcqRel) {
            return Vec::new();
        }
        if self.shape.rows == 0 {
            self.mem.flag().store(self.seq, Ordering::Release);
        }
        (0..self.shape.rows)
            .map(|row| Ticket {
                landing: Arc::clone(self),
                row,
                landed: false,
            })
            .collect()
    }

    /// Lands every row from `rows` (one per row, or none: every row empty) unless its
    /// tickets were handed out already: what is left to do where the CPU part came back
    /// ready after all. Rows that do not fit land empty and break the landing.
    pub fn land_rest(self: &Arc<Self>, rows: &[Vec<Partial>]) -> Result<(), BackendError> {
        let tickets = self.tickets();
        if tickets.is_empty() {
            return Ok(());
        }
        if rows.is_empty() {
            tickets.into_iter().for_each(Ticket::land_empty);
            return Ok(());
        }
        if rows.len() != tickets.len() {
            return Err(BackendError::Unsupported(format!(
                "{} rows of CPU partials for a landing of {}",
                rows.len(),
                tickets.len()
            )));
        }
        tickets
            .into_iter()
            .zip(rows)
            .try_for_each(|(t, row)| t.land(row))
    }

    /// The value the flag is raised to.
    pub fn seq(&self) -> u32 {
        self.seq
    }

    /// The memory it lands in.
    pub fn mem(&self) -> &Arc<dyn LandingMem> {
        &self.mem
    }

    /// What it holds.
    pub fn shape(&self) -> LandingShape {
        self.shape
    }

    /// Every row has landed.
    pub fn raised(&self) -> bool {
        self.mem.flag().load(Ordering::Acquire) == self.seq
    }

    /// False when a row landed empty because its ticket was dropped or refused its partials.
    pub fn whole(&self) -> bool {
        self.whole.load(Ordering::Acquire)
    }

    /// Every row's partials, read back on the host once [`Landing::raised`]: what a host
    /// backend merges; `None` while rows are still out.
    pub fn read(&self) -> Option<Vec<Vec<Partial>>> {
        if !self.raised() {
            return None;
        }
        let LandingShape {
            rows,
            kv_heads,
            group: g,
            head_dim: d,
        } = self.shape;
        let w = self.mem.words();
        let lse_at = self.shape.lse_at();
        let floats = |at: usize, n: usize| -> Vec<f32> {
            w[at..at + n]
                .iter()
                .map(|x| f32::from_bits(x.load(Ordering::Relaxed)))
                .collect()
        };
        Some(
            (0..rows)
                .map(|r| {
                    (0..kv_heads)
                        .map(|h| {
                            let i = r * kv_heads + h;
                            Partial {
                                out: floats(i * g * d, g * d),
                                lse2: floats(lse_at + i * g, g),
                                num_heads: g,
                                head_dim: d,
                            }
                        })
                        .collect()
                })
                .collect(),
        )
    }

    /// Writes `row`: `parts` where given, else an empty partial per head.
    fn write(&self, row: usize, parts: Option<&[Partial]>) {
        let (d, g, hk) = (self.shape.head_dim, self.shape.group, self.shape.kv_heads);
        let w = self.mem.words();
        let (out_at, lse_at) = (row * hk * g * d, self.shape.lse_at() + row * hk * g);
        let store = |dst: &AtomicU32, x: f32| dst.store(x.to_bits(), Ordering::Relaxed);
        let (outs, lses) = (&w[out_at..out_at + hk * g * d], &w[lse_at..lse_at + hk * g]);
        match parts {
            // The row's heads lie one after another in both ranges.
            Some(p) => {
                let src = |f: fn(&Partial) -> &[f32]| p.iter().flat_map(f).copied();
                outs.iter()
                    .zip(src(|p| &p.out))
                    .for_each(|(o, x)| store(o, x));
                lses.iter()
                    .zip(src(|p| &p.lse2))
                    .for_each(|(o, x)| store(o, x));
            }
            None => {
                outs.iter().for_each(|o| store(o, 0.0));
                lses.iter().for_each(|o| store(o, f32::NEG_INFINITY));
            }
        }
    }

    /// Counts a row landed; the last raises the flag (after every row's writes: the count
    /// orders them before it).
    fn count_down(&self) {
        if self.left.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.mem.flag().store(self.seq, Ordering::Release);
        }
    }
}

/// The right to land one row of a [`Landing`]. Dropped without [`Ticket::land`], it lands the
/// row empty and marks the landing broken.
#[derive(Debug)]
pub struct Ticket {
    landing: Arc<Landing>,
    row: usize,
    landed: bool,
}

impl Ticket {
    /// The row this ticket lands.
    pub fn row(&self) -> usize {
        self.row
    }

    /// Writes the row's partials (one per KV head, each `group` x `head_dim`) and counts it
    /// landed. Partials of another shape are refused: the row lands empty, the landing is
    /// marked broken, and the error says why.
    pub fn land(mut self, parts: &[Partial]) -> Result<(), BackendError> {
        let l = self.landing.shape;
        let fits = parts.len() == l.kv_heads
            && parts
                .iter()
                .all(|p| p.out.len() == l.group * l.head_dim && p.lse2.len() == l.group);
        if !fits {
            // Drop lands it empty and breaks the landing.
            return Err(BackendError::Unsupported(format!(
                "{} CPU partials for a landing row of {} KV heads of {} x {}",
                parts.len(),
                l.kv_heads,
                l.group,
                l.head_dim
            )));
        }
        self.landing.write(self.row, Some(parts));
        self.landed = true;
        self.landing.count_down();
        Ok(())
    }

    /// Lands the row empty: a sequence without a CPU part this layer.
    pub fn land_empty(mut self) {
        self.landing.write(self.row, None);
        self.landed = true;
        self.landing.count_down();
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if !self.landed {
            self.landing.whole.store(false, Ordering::Release);
            self.landing.write(self.row, None);
            self.landing.count_down();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn partial(seed: f32, g: usize, d: usize) -> Partial {
        Partial {
            out: (0..g * d).map(|i| seed + i as f32).collect(),
            lse2: (0..g).map(|i| seed * 0.5 + i as f32).collect(),
            num_heads: g,
            head_dim: d,
        }
    }

    fn shape(rows: usize) -> LandingShape {
        LandingShape {
            rows,
            kv_heads: 2,
            group: 3,
            head_dim: 4,
        }
    }

    fn landing(rows: usize) -> Arc<Landing> {
        let shape = shape(rows);
        let mem = Arc::new(HostLandingMem::new(shape.words()));
        Landing::new(mem, 7, shape).unwrap()
    }

    /// Rows landed from several threads in any order read back as landed; the flag rises
    /// with the last row and not before.
    #[test]
    fn rows_land_from_any_thread_and_the_last_raises_the_flag() {
        let l = landing(3);
        let mut tickets = l.tickets();
        assert_eq!(tickets.len(), 3);
        assert!(l.tickets().is_empty(), "tickets are handed out once");
        let last = tickets.remove(1);
        let rows: Vec<Vec<Partial>> = (0..3)
            .map(|r| (0..2).map(|h| partial((10 * r + h) as f32, 3, 4)).collect())
            .collect();
        std::thread::scope(|s| {
            for t in tickets {
                let parts = &rows[t.row()];
                s.spawn(move || t.land(parts).unwrap());
            }
        });
        assert!(!l.raised());
        assert_eq!(l.read(), None);
        last.land(&rows[1]).unwrap();
        assert!(l.raised() && l.whole());
        assert_eq!(l.read().unwrap(), rows);
    }

    /// A row without a CPU part lands as an empty partial; a dropped ticket or partials of
    /// the wrong shape land it empty too, still raise the flag, and mark the landing broken.
    #[test]
    fn dropped_or_misshapen_rows_land_empty_and_break_the_landing() {
        let l = landing(3);
        let mut t = l.tickets().into_iter();
        t.next().unwrap().land_empty();
        let bad = t.next().unwrap().land(&[partial(1.0, 3, 4)]);
        assert!(bad.is_err());
        assert!(!l.raised());
        drop(t);
        assert!(l.raised());
        assert!(!l.whole());
        for row in l.read().unwrap() {
            assert!(row.iter().all(Partial::is_empty), "{row:?}");
        }
        let ok = landing(1);
        ok.tickets().pop().unwrap().land_empty();
        assert!(ok.raised() && ok.whole());
    }

    /// What was not handed out lands from rows given ready (or empty), and only then.
    #[test]
    fn the_rest_lands_from_ready_rows_once() {
        let rows: Vec<Vec<Partial>> = (0..2)
            .map(|r| (0..2).map(|h| partial((r + 3 * h) as f32, 3, 4)).collect())
            .collect();
        let l = landing(2);
        l.land_rest(&rows).unwrap();
        assert!(l.raised() && l.whole());
        assert_eq!(l.read().unwrap(), rows);
        l.land_rest(&[]).unwrap();
        assert_eq!(l.read().unwrap(), rows, "handed out once");
        let empty = landing(2);
        empty.land_rest(&[]).unwrap();
        assert!(empty.raised() && empty.whole());
        let short = landing(2);
        assert!(short.land_rest(&rows[..1]).is_err());
        assert!(short.raised() && !short.whole());
    }

    /// Memory too small for the shape is refused; a landing of no rows is raised as soon as
    /// its (no) tickets are handed out.
    #[test]
    fn small_memory_is_refused_and_no_rows_raise_at_once() {
        let mem = Arc::new(HostLandingMem::new(10));
        assert!(Landing::new(mem.clone(), 1, shape(1)).is_err());
        let l = Landing::new(mem, 1, shape(0)).unwrap();
        assert!(!l.raised());
        assert!(l.tickets().is_empty());
        assert!(l.raised());
    }
}

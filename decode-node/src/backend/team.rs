//! A decode step's team: the CPU pool's other threads held for the length of one step, so
//! each of its small parallel regions starts in well under a microsecond.
//!
//! A CPU decode step of a small model is a few hundred short regions (SmolLM2-135M: ~150
//! projections of 30-150 µs at batch 1), separated by serial work of a few µs to a few tens.
//! Between two rayon regions an idle worker yields, then sleeps, and a sleeping one takes
//! 15-25 µs to wake on this class of VM (futex, IPI): at batch 1 the second core spent a
//! quarter of the step idle or waking. Here the other pool threads stay in [`Team::help`] for
//! the whole step: they poll for a posted region, and in between run whatever rayon work the
//! step thread queued (its attention fans out on rayon as before). Rayon has no setting for
//! how long its workers spin before sleeping, hence this module.
//!
//! A region is a task count and a `Fn(task)`, cut in one contiguous part per member; the step
//! thread runs tasks too and returns only after every task taken has ended. The step begins
//! once its helpers have arrived (or after [`JOIN_WAIT`]); one that arrives later may be
//! holding the step's own stolen work, so it leaves once idle for [`LATE_IDLE`] rather than
//! at the step's end ([`Team::help`]). Outside a step
//! (tests, prefill, a one-thread pool) [`for_each`] is a plain rayon loop.
//!
//! Measured against rayon regions (SmolLM2-135M, `bench decode`, AVX2, 2-core EPYC, four
//! alternating runs each, tokens/s): context 128 batch 1 99-118 -> 107-120, batch 8 411-433
//! -> 451-459; 4k full 77-85 -> 81-88, scout (budget 512) 73-75 -> 78-80; with
//! `--layer-ahead on` at batch 2, scout 83 -> 96, hgca 108 -> 122.

use std::any::Any;
use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::ptr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rayon::prelude::*;
use smallvec::SmallVec;

/// How long a helper polls without work before it yields its core between polls (as rayon's
/// idle workers do, without going on to sleep): longer than most serial gaps inside a step
/// (SmolLM2: ~6 µs at batch 1, ~25 at batch 8), short enough that the node's other threads
/// (gRPC, ingest) get a core back soon when they have work and the step thread is busy alone.
const SPIN_BEFORE_YIELD: Duration = Duration::from_micros(50);

/// How long the step thread waits for its helpers to arrive before it begins without the
/// late ones: a sleeping pool thread takes 15-25 µs to wake on this class of VM; one that
/// takes far longer was preempted, and the step cannot use its core meanwhile anyway.
const JOIN_WAIT: Duration = Duration::from_micros(500);

/// How long a helper that arrived after its step began stays without work before it leaves
/// (see [`Team::help`]): far longer than a step's serial gaps (~25 µs at batch 8), so it
/// helps to the end of most steps, and what a step stalls when the helper holds its work.
const LATE_IDLE: Duration = Duration::from_millis(1);

/// Most tasks a region takes: a part packs its bounds in one 64-bit word (a step's regions
/// have a few thousand).
const MAX_TASKS: usize = u32::MAX as usize;

/// The shared state of one step's team.
struct Team {
    /// Bumped each time a region is posted; helpers poll it (a read-only line until then).
    posted: AtomicUsize,
    /// The region being run, or null between regions.
    region: AtomicPtr<Region<'static>>,
    /// Helpers that may hold the region's pointer: the step thread does not leave a region
    /// (and free it) until this is zero.
    inside: AtomicUsize,
    /// The step is over: helpers return.
    done: AtomicBool,
    /// The step has begun: a helper arriving now is late (see [`Team::help`]).
    started: AtomicBool,
    /// Helpers that arrived before the step began.
    joined: AtomicUsize,
    /// A panic a task raised on a helper, raised again on the step thread.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    /// The step thread and its helpers.
    members: usize,
}

/// A posted region: `tasks` calls of `task`, cut into one contiguous part per member of the
/// team. Each member works its own part from the front, then takes tasks from the back of the
/// others'. Contiguous, because each row stream prefetches the lines ahead of it: tasks dealt
/// out one at a time from a shared counter had every thread fetch lines the other would read,
/// and a batch-1 step went at 70 tokens/s where rayon's halves went at 108 (SmolLM2, 2 cores).
struct Region<'f> {
    task: &'f (dyn Fn(usize) + Sync),
    parts: SmallVec<[Part; 8]>,
}

/// A part's tasks not yet taken: `front..back`, packed in one word so both ends move by CAS.
struct Part(AtomicU64);

impl Part {
    fn new(front: usize, back: usize) -> Self {
        Self(AtomicU64::new(((back as u64) << 32) | front as u64))
    }

    /// Takes the first task left (`from_back`: the last).
    fn take(&self, from_back: bool) -> Option<usize> {
        let mut now = self.0.load(Ordering::Relaxed);
        loop {
            let (front, back) = (now & u64::from(u32::MAX), now >> 32);
            if front >= back {
                return None;
            }
            let (next, task) = if from_back {
                ((back - 1) << 32 | front, back - 1)
            } else {
                (back << 32 | (front + 1), front)
            };
            match self
                .0
                .compare_exchange_weak(now, next, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return Some(task as usize),
                Err(seen) => now = seen,
            }
        }
    }

    /// Takes every task left, so nobody starts another.
    fn close(&self) {
        self.0.store(0, Ordering::Relaxed);
    }
}

impl<'f> Region<'f> {
    fn new(tasks: usize, members: usize, task: &'f (dyn Fn(usize) + Sync)) -> Self {
        debug_assert!(tasks <= MAX_TASKS);
        let members = members.max(1);
        let parts = (0..members)
            .map(|m| Part::new(tasks * m / members, tasks * (m + 1) / members))
            .collect();
        Self { task, parts }
    }

    /// Member `me`'s work: its own part, then what is left of the others'.
    fn work(&self, me: usize) {
        let n = self.parts.len();
        let me = me % n;
        while let Some(i) = self.parts[me].take(false) {
            (self.task)(i);
        }
        for other in (1..n).map(|k| (me + k) % n) {
            while let Some(i) = self.parts[other].take(true) {
                (self.task)(i);
            }
        }
    }

    fn close(&self) {
        self.parts.iter().for_each(Part::close);
    }
}

thread_local! {
    /// The team of the step this thread is running, if any.
    static CURRENT: Cell<*const Team> = const { Cell::new(ptr::null()) };
}

/// Runs `step` on this thread with the other threads of the current rayon pool as its team
/// ([`for_each`] then runs on them). Called off a pool, it moves to rayon's global one first
/// (every region would otherwise put the caller to sleep and wake it again); on a one-thread
/// pool, or inside a step, it just runs `step`.
pub(crate) fn run_step<R: Send>(step: impl FnOnce() -> R + Send) -> R {
    let Some(me) = rayon::current_thread_index() else {
        return rayon::scope(|_| run_step(step));
    };
    let threads = rayon::current_num_threads();
    if threads < 2 || !CURRENT.get().is_null() {
        return step();
    }
    let team = Team {
        posted: AtomicUsize::new(0),
        region: AtomicPtr::new(ptr::null_mut()),
        inside: AtomicUsize::new(0),
        done: AtomicBool::new(false),
        started: AtomicBool::new(false),
        joined: AtomicUsize::new(0),
        panic: Mutex::new(None),
        members: threads,
    };
    rayon::scope(|s| {
        // This thread's own copy runs whenever it next looks for rayon work (in a join
        // inside the step, or at the scope's end) and returns at once.
        // Members are numbered from the step thread's 0.
        s.spawn_broadcast(|_, ctx| match ctx.index() {
            i if i == me => {}
            i if i < me => team.help(i + 1),
            i => team.help(i),
        });
        // Set however the step ends, a panic included, so the helpers (and the scope) end.
        struct Finish<'t>(&'t Team);
        impl Drop for Finish<'_> {
            fn drop(&mut self) {
                CURRENT.set(ptr::null());
                self.0.done.store(true, Ordering::Release);
            }
        }
        let _finish = Finish(&team);
        team.wait_for_helpers();
        CURRENT.set(&team);
        step()
    })
}

/// Runs `task(i)` for every `i < tasks`, in parallel: on the step's team where this thread
/// runs a step ([`run_step`]), else on rayon.
pub(crate) fn for_each(tasks: usize, task: &(dyn Fn(usize) + Sync)) {
    let team = CURRENT.get();
    // SAFETY: CURRENT points at the team of the step this thread is inside (`run_step`
    // clears it before the team is dropped).
    let team = (!team.is_null()).then(|| unsafe { &*team });
    match team {
        // A region inside a region's task (none today) or past 32-bit task indices runs on
        // rayon: the team has one region slot, and parts pack their bounds in 32 bits.
        Some(team) if team.region.load(Ordering::Relaxed).is_null() && tasks <= MAX_TASKS => {
            team.run(tasks, task)
        }
        _ => (0..tasks).into_par_iter().for_each(task),
    }
}

impl Team {
    /// The step thread's side of a region: post it, work it, and wait out the helpers.
    fn run(&self, tasks: usize, task: &(dyn Fn(usize) + Sync)) {
        let region = Region::new(tasks, self.members, task);
        // The helpers see the region only between this store and the one in `Close`, and
        // `Close` waits until none holds it, so it never outlives this frame for them.
        self.region.store(
            ptr::from_ref(&region).cast::<Region<'static>>().cast_mut(),
            Ordering::SeqCst,
        );
        self.posted.fetch_add(1, Ordering::Release);
        /// Withdraws the region, also when a task panics on this thread.
        struct Close<'t>(&'t Team);
        impl Drop for Close<'_> {
            fn drop(&mut self) {
                self.0.region.store(ptr::null_mut(), Ordering::SeqCst);
                while self.0.inside.load(Ordering::SeqCst) != 0 {
                    std::hint::spin_loop();
                }
            }
        }
        let close = Close(self);
        region.work(0);
        drop(close);
        let panic = self
            .panic
            .lock()
            .map(|mut p| p.take())
            .unwrap_or_else(|p| p.into_inner().take());
        if let Some(p) = panic {
            resume_unwind(p);
        }
    }

    /// Waits (at most [`JOIN_WAIT`]) until every helper has arrived, then marks the step
    /// begun.
    fn wait_for_helpers(&self) {
        let helpers = self.members - 1;
        let deadline = Instant::now() + JOIN_WAIT;
        while self.joined.load(Ordering::Acquire) < helpers && Instant::now() < deadline {
            std::hint::spin_loop();
        }
        self.started.store(true, Ordering::Release);
    }

    /// A helper's loop for the length of the step: regions as they are posted, rayon work in
    /// between, polling without sleeping.
    ///
    /// Rayon hands a pool thread its part of the team as a broadcast job, which it may take
    /// while it waits inside a job it stole (a join's half) — and once the step has begun,
    /// that stolen job may be the step's own work: the step would wait for it, and a helper
    /// polling here until the step's end would wait for the step (a hang seen under `perf`
    /// at batch 8). Step work exists only once `started` is set, and a thread that stole some
    /// has seen that store, so a helper that reads it unset holds none and stays to the end.
    /// A later one may hold some: it joins the region under way, if any, helps as the others
    /// do, and leaves once it has found nothing to do for [`LATE_IDLE`], which is what a step
    /// waiting on it looks like, and finishes that work.
    fn help(&self, me: usize) {
        let late = self.started.load(Ordering::Acquire);
        if !late {
            self.joined.fetch_add(1, Ordering::Release);
        }
        let mut seen = self.posted.load(Ordering::Acquire);
        if late {
            // A region may be under way: waiting for the next one, a helper that came during
            // a region longer than LATE_IDLE never joined any and left (a test caught it).
            self.join_region(me);
        }
        // Polls since the last work, and when the idle stretch began (read from the clock
        // every 64 polls only: a read per poll was 2% of a helper's time).
        let (mut polls, mut idle_since) = (0u32, None::<Instant>);
        let mut yielding = false;
        while !self.done.load(Ordering::Acquire) {
            let posted = self.posted.load(Ordering::Acquire);
            if posted != seen {
                seen = posted;
                self.join_region(me);
                (polls, idle_since, yielding) = (0, None, false);
                continue;
            }
            if rayon::yield_now() == Some(rayon::Yield::Executed) {
                (polls, idle_since, yielding) = (0, None, false);
                continue;
            }
            polls = polls.wrapping_add(1);
            if polls % 64 == 0 {
                let idle = idle_since.get_or_insert_with(Instant::now).elapsed();
                if late && idle >= LATE_IDLE {
                    return;
                }
                yielding = idle >= SPIN_BEFORE_YIELD;
            }
            if yielding {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// Works the current region, if one is still posted.
    fn join_region(&self, me: usize) {
        // Counted before the pointer is read: a step thread that withdrew the region after
        // this increment waits for the decrement; one that withdrew it before leaves null.
        self.inside.fetch_add(1, Ordering::SeqCst);
        let region = self.region.load(Ordering::SeqCst);
        if !region.is_null() {
            // SAFETY: see `run`: the region lives until `inside` drops back.
            let region = unsafe { &*region };
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| region.work(me))) {
                // Take the rest so the step thread stops too, then hand it the panic.
                region.close();
                if let Ok(mut slot) = self.panic.lock() {
                    slot.get_or_insert(p);
                }
            }
        }
        self.inside.fetch_sub(1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU64;

    use super::*;

    /// Held by the late-helper stress test, which keeps 8 pool threads spinning on the
    /// machine's cores for seconds, and by the tests that need a helper to get a core within
    /// one step, which beside it might not.
    static CORES: Mutex<()> = Mutex::new(());

    fn cores() -> std::sync::MutexGuard<'static, ()> {
        // A failed test holding it poisons it; the others still run.
        CORES.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn pool(threads: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
    }

    #[test]
    fn every_task_runs_once_in_every_region() {
        for threads in [1, 2, 3] {
            let counts: Vec<AtomicU64> = (0..1000).map(|_| AtomicU64::new(0)).collect();
            pool(threads).install(|| {
                run_step(|| {
                    for region in 0..200 {
                        let n = (region * 7) % 1000;
                        for_each(n, &|i| {
                            counts[i].fetch_add(1, Ordering::Relaxed);
                        });
                        // Serial work and plain rayon between regions, as in a step.
                        let s: u64 = (0..1000u64).into_par_iter().sum();
                        assert_eq!(s, 499_500);
                    }
                })
            });
            let want: Vec<u64> = (0..1000)
                .map(|i| (0..200).filter(|r| (r * 7) % 1000 > i).count() as u64)
                .collect();
            let got: Vec<u64> = counts.iter().map(|c| c.load(Ordering::Relaxed)).collect();
            assert_eq!(got, want, "{threads} threads");
        }
    }

    #[test]
    fn helpers_share_the_tasks() {
        let _cores = cores();
        let p = pool(2);
        let on_helper = AtomicUsize::new(0);
        p.install(|| {
            let me = rayon::current_thread_index();
            run_step(|| {
                for _ in 0..50 {
                    for_each(64, &|_| {
                        std::thread::sleep(Duration::from_micros(20));
                        if rayon::current_thread_index() != me {
                            on_helper.fetch_add(1, Ordering::Relaxed);
                        }
                    });
                }
            })
        });
        assert!(on_helper.load(Ordering::Relaxed) > 0);
    }

    #[test]
    fn a_panicking_task_reaches_the_step_thread_and_the_team_ends() {
        let p = pool(2);
        for panic_on in [0, 63] {
            let caught = p.install(|| {
                catch_unwind(AssertUnwindSafe(|| {
                    run_step(|| {
                        for_each(64, &|i| {
                            std::thread::sleep(Duration::from_micros(50));
                            assert!(i != panic_on, "task {i}");
                        })
                    })
                }))
            });
            assert!(caught.is_err());
        }
        // The pool still works: no helper is stuck in the old step.
        let n = AtomicUsize::new(0);
        p.install(|| run_step(|| for_each(10, &|_| _ = n.fetch_add(1, Ordering::Relaxed))));
        assert_eq!(n.load(Ordering::Relaxed), 10);
    }

    #[test]
    fn a_region_inside_a_task_runs_on_rayon() {
        let n = AtomicUsize::new(0);
        pool(2).install(|| {
            run_step(|| {
                for_each(8, &|_| {
                    for_each(8, &|_| _ = n.fetch_add(1, Ordering::Relaxed))
                });
            })
        });
        assert_eq!(n.load(Ordering::Relaxed), 64);
    }

    /// A helper that steals the step's rayon work before it takes its place in the team
    /// (woken late, or preempted between rayon's look at its own queues and its steal) must
    /// not then hold the team's place inside that stolen work: the step would wait for the
    /// work, and the helper for the step's end. More threads than cores and steps that fan
    /// out at once make such a late helper common. The unfixed team on 2 cores hung after
    /// 2.5k steps with 4 threads, 3.6k with 8 (within 2 s) and 8.5k with 16; some runs got
    /// through, so a pass here is likely, not certain, to catch that bug come back.
    #[test]
    fn a_late_helper_holding_stolen_step_work_does_not_hang_the_step() {
        let _cores = cores();
        let done = std::sync::Arc::new(AtomicU64::new(0));
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let (counter, stopped) = (done.clone(), stop.clone());
        let stepper = std::thread::spawn(move || {
            let p = pool(8);
            let mut step = 0u64;
            while !stopped.load(Ordering::Relaxed) {
                let s: u64 = p.install(|| {
                    run_step(|| {
                        (0..16u64)
                            .into_par_iter()
                            .map(|i| (0..8u64).into_par_iter().map(|j| i * j + step).sum::<u64>())
                            .sum()
                    })
                });
                assert_eq!(s, 28 * 120 + 128 * step);
                step += 1;
                counter.store(step, Ordering::Release);
            }
        });
        // Steps take microseconds: five seconds without one is a hang (or a panic). Six
        // seconds of steps; the unfixed team hung after 2.5-3.6k steps, about a second.
        let start = Instant::now();
        let mut last = (0, Instant::now());
        while start.elapsed() < Duration::from_secs(6) {
            std::thread::sleep(Duration::from_millis(20));
            let now = done.load(Ordering::Acquire);
            if now != last.0 {
                last = (now, Instant::now());
            }
            assert!(
                last.1.elapsed() < Duration::from_secs(5),
                "no step ended in 5 s after step {now}: the team deadlocked"
            );
        }
        stop.store(true, Ordering::Relaxed);
        // Its pool's threads end with it, before the next test takes the cores.
        stepper.join().unwrap();
    }

    #[test]
    fn off_a_step_it_is_a_rayon_loop() {
        let n = AtomicUsize::new(0);
        for_each(100, &|_| _ = n.fetch_add(1, Ordering::Relaxed));
        assert_eq!(n.load(Ordering::Relaxed), 100);
    }
}
